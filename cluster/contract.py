"""What the ingress and a TP group exchange, as types both sides import.

    ingress --GroupRequest--> group deployment ``generate(request, num_tokens=T, block_hashes=H)``
    ingress <--GroupChunk...-- (streamed through the deployment handle, each chunk pickled)
    router  <--LoadReport.to_stats()-- group deployment ``record_routing_stats()`` (via Serve)

``num_tokens`` and ``block_hashes`` travel beside the request as keyword arguments because the
KV-aware router reads them before any replica sees the call (`cluster.routing.kv_router`).
Serve carries a replica's routing stats as a dict, so `LoadReport` crosses as one: the group
calls `LoadReport.to_stats`, the router `LoadReport.from_stats`, and no other code spells the
dict's keys. Nothing here imports from ``cluster.api``, ``cluster.groups`` or
``cluster.routing``: those import this.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Mapping, Optional, Sequence, Tuple

from kv.prefix_hash import BlockHash
from workers.sampling_params import SamplingParams

if TYPE_CHECKING:  # types only: their modules import torch, which the router process need not
    from workers.request import RequestId
    from workers.sampler import SampledToken

__all__ = ["GroupChunk", "GroupRequest", "LoadReport"]


@dataclass(frozen=True, slots=True)
class GroupRequest:
    """One prompt the ingress sends a TP group.

    ``request_id``: the engine's id for it (a batch's prompt p is ``<id>-<p>``); the chunks carry
    it back. ``sampling``: validated by the ingress already (`SamplingParams` checks on
    construction), ``sampling.n`` choices. ``resume_output_ids``: empty for a new request; for a
    request migrated from a failed group, the tokens it already produced (only a request of one
    choice moves once started): the group computes them again and the stream goes on after them,
    its chunks counting them in ``num_output_tokens`` but never sending them again."""

    request_id: RequestId
    prompt_token_ids: Tuple[int, ...]
    sampling: SamplingParams
    resume_output_ids: Tuple[int, ...] = ()

    def resumed(self, output_ids: Sequence[int]) -> "GroupRequest":
        """This request sent again after ``output_ids`` (its tokens so far) were produced."""
        return replace(self, resume_output_ids=tuple(output_ids))


@dataclass(frozen=True, slots=True)
class GroupChunk:
    """What one engine step produced for one choice of a request, streamed to the ingress.

    ``new_token_ids`` and ``delta_text`` are this step's only (possibly empty: text held back
    while a stop string may still match); ``num_output_tokens`` counts every output token of the
    choice so far, ``num_prompt_tokens`` the prompt's. ``logprobs`` has one entry per new token,
    in order, when the request asked for logprobs (``sampling.logprobs`` not None), else none: the
    engine's `workers.sampler.SampledToken`, whose ``top_logprobs`` are ``sampling.logprobs``
    (token id, logprob) pairs. ``index`` is the
    choice (0 .. ``sampling.n`` - 1): with several choices their chunks interleave. ``finished``
    is the choice's, with its ``finish_reason`` ("stop", "length" or "abort"; None until then);
    the stream ends after every choice finished, and a stream that ends before is a failure.

    Chunks cross Ray one pickle each, so a chunk holds nothing beyond these fields."""

    request_id: RequestId
    new_token_ids: Tuple[int, ...]
    delta_text: str
    finished: bool
    finish_reason: Optional[str]
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: Tuple[SampledToken, ...] = ()
    index: int = 0


# LoadReport field -> its key in Serve's routing-stats dict (the names the dict always had).
_INT_KEYS = {
    "seq": "seq",
    "num_blocks_used": "kv_blocks_used",
    "num_blocks_total": "kv_blocks_total",
    "block_size": "block_size",
    "num_waiting_tokens": "waiting_tokens",
}
_REQUIRED_KEYS = (*_INT_KEYS.values(), "time", "cached_block_hashes", "accepted_ids")
_COLLECTIONS = (list, tuple, set, frozenset)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A group's KV load as its ``record_routing_stats()`` reports it to the KV-aware router.

    ``seq`` grows with every snapshot (a new one tells the router the report changed);
    ``time`` is the group's clock, for people only (the router ages a report by its own clock
    from when it first saw the ``seq``). ``num_blocks_used`` of ``num_blocks_total`` KV blocks
    of ``block_size`` tokens are held, and ``num_waiting_tokens`` more tokens of accepted
    requests hold no block yet: together they cover every request in ``accepted_ids`` (the
    routing ids, Serve's internal request ids, of the requests accepted lately, also one still
    queued for the engine), so the router drops its charges for those. ``cached_block_hashes``:
    the blocks the group holds (its pool's most recently used up to its limit, then those only
    its host tier holds: a copy brings them back). ``is_engine_alive`` False: the engine died,
    the group's health check is about to fail, and the router sends it nothing.

    Costs: `to_stats` copies no collection; `from_stats` is O(accepted ids) (each is checked
    to be a string; the block hashes are not looked at one by one)."""

    seq: int
    time: float
    num_blocks_used: int
    num_blocks_total: int
    block_size: int
    num_waiting_tokens: int
    cached_block_hashes: FrozenSet[BlockHash]
    accepted_ids: FrozenSet[str]
    is_engine_alive: bool = True

    def to_stats(self) -> Dict[str, Any]:
        """The dict ``record_routing_stats`` returns (Serve hands it to the routers as is)."""
        stats: Dict[str, Any] = {key: getattr(self, name) for name, key in _INT_KEYS.items()}
        stats.update(time=self.time, cached_block_hashes=self.cached_block_hashes,
                     accepted_ids=self.accepted_ids, engine_alive=self.is_engine_alive)
        return stats

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> "LoadReport":
        """A replica's routing stats, parsed; ValueError names the missing or malformed key.
        The numbers' ranges are `cluster.routing.ranking.GroupLoad`'s to check."""
        missing = [key for key in _REQUIRED_KEYS if key not in stats]
        if missing:
            raise ValueError(f"routing stats lack {missing} (have {sorted(stats)})")
        for key in _INT_KEYS.values():
            if not isinstance(stats[key], int):
                raise ValueError(f"routing stats {key!r} must be an int, got {stats[key]!r}")
        if not isinstance(stats["time"], (int, float)):
            raise ValueError(f"routing stats 'time' must be a number, got {stats['time']!r}")
        hashes = stats["cached_block_hashes"]
        if not isinstance(hashes, _COLLECTIONS):
            raise ValueError(f"routing stats 'cached_block_hashes' must be a collection of "
                             f"block hashes, got {hashes!r:.80}")
        accepted = stats["accepted_ids"]
        if not isinstance(accepted, _COLLECTIONS) or not all(isinstance(i, str) for i in accepted):
            raise ValueError(f"routing stats 'accepted_ids' must be a list of request ids, "
                             f"got {accepted!r:.80}")
        alive = stats.get("engine_alive", True)
        if not isinstance(alive, bool):
            raise ValueError(f"routing stats 'engine_alive' must be a bool, got {alive!r}")
        return cls(time=float(stats["time"]), cached_block_hashes=frozenset(hashes),
                   accepted_ids=frozenset(accepted), is_engine_alive=alive,
                   **{name: stats[key] for name, key in _INT_KEYS.items()})

    @staticmethod
    def seq_of(stats: Mapping[str, Any]) -> Any:
        """A stats dict's ``seq`` unparsed (None if absent): has the report changed?"""
        return stats.get("seq")

    @staticmethod
    def says_engine_died(stats: Mapping[str, Any]) -> bool:
        """Whether a stats dict reports a dead engine, without parsing the rest."""
        return stats.get("engine_alive") is False
