"""The group side of the ingress contract: a payload in, chunk dicts out.

The ingress calls a TP group's ``generate(payload, num_tokens=T, block_hashes=H)`` through a
streaming ``DeploymentHandle``; the group streams ``stream_chunks(engine, payload)``. Payload:
``{"request_id", "prompt_token_ids", "sampling": {SamplingParams fields}}`` and, for a request
migrated from a failed group, ``"resume_output_ids"`` (the tokens it already produced: the
stream continues after them). Each chunk:
``{"request_id", "new_token_ids", "delta_text", "finished", "finish_reason",
"num_prompt_tokens", "num_output_tokens", "logprobs", "index"}`` where ``logprobs`` covers the
new tokens only (``[{"token_id", "logprob", "top_logprobs": [[id, lp], ...]}]``) and ``index``
is the choice (``sampling["n"]`` > 1: the chunks of the choices interleave; ``finished`` is the
choice's, and the stream ends after every choice finished). Only plain data crosses
the handle, so the ingress needs no engine types.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional

from workers.async_engine import AsyncLLMEngine
from workers.engine import RequestOutput
from workers.sampling_params import SamplingParams


def sampling_params(sampling: Mapping[str, Any]) -> SamplingParams:
    """The payload's ``sampling`` dict as ``SamplingParams``; ValueError names a bad field."""
    fields = dict(sampling)
    for key in ("stop", "stop_token_ids"):
        if fields.get(key) is not None:
            fields[key] = tuple(fields[key])
    try:
        return SamplingParams(**fields)
    except TypeError as exc:  # an unknown field
        raise ValueError(f"bad sampling settings: {exc}") from None


def output_chunk(out: RequestOutput, want_logprobs: bool) -> Dict[str, Any]:
    """One engine output as a chunk (``out.logprobs`` is cumulative: keep the new ones)."""
    logprobs: List[Dict[str, Any]] = []
    if want_logprobs and out.new_token_ids:
        logprobs = [{"token_id": t.token_id, "logprob": t.logprob,
                     "top_logprobs": [[i, lp] for i, lp in t.top_logprobs]}
                    for t in out.logprobs[-len(out.new_token_ids):]]
    return {
        "request_id": out.request_id,
        "new_token_ids": list(out.new_token_ids),
        "delta_text": out.delta_text,
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_output_tokens": len(out.output_token_ids),
        "logprobs": logprobs,
        "index": out.index,
    }


async def stream_chunks(engine: AsyncLLMEngine, payload: Mapping[str, Any],
                        routing_id: Optional[str] = None) -> AsyncIterator[Dict[str, Any]]:
    """Run one request on ``engine`` and stream its chunks.

    Closing or cancelling the iteration (the caller's handle call was cancelled: the client went
    away) closes the engine stream at once, which aborts the request and frees its blocks."""
    params = sampling_params(payload["sampling"])
    want_logprobs = params.logprobs is not None
    outputs = engine.generate(list(payload["prompt_token_ids"]), params, payload["request_id"],
                              routing_id=routing_id,
                              resume_output_ids=list(payload.get("resume_output_ids", ())))
    async with aclosing(outputs):
        async for out in outputs:
            yield output_chunk(out, want_logprobs)
