"""Ray Serve's own request routers, set up to route tpserve's group deployment: the baselines the
serving benchmark compares the KV-aware router against. Not used in production.

* ``round_robin``: Serve's ``RoundRobinRouter`` (``ray.serve.experimental.round_robin_router``),
  unchanged.
* ``prefix_affinity``: Ray Serve LLM's ``PrefixCacheAffinityRouter``. As it is, it cannot route
  the group deployment: it keys its prefix tree on the text of the call's ``prompt`` or
  ``messages`` attribute (``_extract_text_from_request``), and the ingress calls
  ``generate(request, ...)`` with a `cluster.contract.GroupRequest` of token ids, so every
  decision raises ``ValueError("No request with message or prompt attribute found")``.
  `TokenPrefixAffinityRouter` changes only that extraction: one character per token id, so its
  prefix tree matches token prefixes exactly as it matches text; the policy is Serve's.

The public ``ray.serve.llm.request_router`` needs Ray's ``llm`` extra (pyarrow); without it the
same class is imported from where that module takes it (``ray.llm._internal...``; the public one
is a subclass that adds only a docstring).
"""

from __future__ import annotations

from typing import Any

try:
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter
except ImportError:  # ray[serve] without the llm extra
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )
from ray.serve.experimental.round_robin_router import RoundRobinRouter

from cluster.contract import GroupRequest

__all__ = ["RoundRobinRouter", "TokenPrefixAffinityRouter", "token_ids_as_text"]

_SURROGATES_START = 0xD800
_SURROGATES_SIZE = 0x800


def token_ids_as_text(token_ids: Any) -> str:
    """One character per token id (skipping the UTF-16 surrogate range): two prompts share a
    text prefix exactly as long as their shared token prefix."""
    return "".join(
        chr(t + _SURROGATES_SIZE if t >= _SURROGATES_START else t) for t in token_ids
    )


class TokenPrefixAffinityRouter(PrefixCacheAffinityRouter):
    """Serve's ``PrefixCacheAffinityRouter`` keyed on the request's prompt token ids."""

    def _extract_text_from_request(self, pending_request: Any) -> str:
        for arg in pending_request.args:
            if isinstance(arg, GroupRequest):
                return token_ids_as_text(arg.prompt_token_ids)
        return super()._extract_text_from_request(pending_request)
