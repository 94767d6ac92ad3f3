"""The group side of the ingress contract (`cluster.contract`): a `GroupRequest` in, its
`GroupChunk`s out, one per engine output."""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator, Optional, Tuple

from cluster.contract import GroupChunk, GroupRequest
from workers.async_engine import AsyncLLMEngine
from workers.engine import RequestOutput
from workers.sampler import SampledToken


def output_chunk(out: RequestOutput, want_logprobs: bool) -> GroupChunk:
    """One engine output as a chunk (``out.logprobs`` is cumulative: keep the new ones)."""
    logprobs: Tuple[SampledToken, ...] = ()
    if want_logprobs and out.new_token_ids:
        logprobs = tuple(out.logprobs[-len(out.new_token_ids):])
    return GroupChunk(out.request_id, tuple(out.new_token_ids), out.delta_text, out.finished,
                      out.finish_reason, len(out.prompt_token_ids), len(out.output_token_ids),
                      logprobs, out.index)


async def stream_chunks(engine: AsyncLLMEngine, request: GroupRequest,
                        routing_id: Optional[str] = None) -> AsyncIterator[GroupChunk]:
    """Run one request on ``engine`` and stream its chunks.

    Closing or cancelling the iteration (the caller's handle call was cancelled: the client went
    away) closes the engine stream at once, which aborts the request and frees its blocks."""
    want_logprobs = request.sampling.logprobs is not None
    outputs = engine.generate(list(request.prompt_token_ids), request.sampling,
                              request.request_id, routing_id=routing_id,
                              resume_output_ids=list(request.resume_output_ids))
    async with aclosing(outputs):
        async for out in outputs:
            yield output_chunk(out, want_logprobs)
