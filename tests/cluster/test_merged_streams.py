"""`MergedStreams`: a batch's per-prompt chunk streams as one (the Ray ingress test runs it
through Serve; here its ordering, index shift and failure handling on plain chunk streams)."""

import asyncio

import pytest

from cluster.api.request_run import MergedStreams
from cluster.api.protocol import ProtocolError
from cluster.contract import GroupChunk


def chunk(index, tag):
    """A chunk of choice ``index``, told apart by its one token, ``tag``."""
    return GroupChunk("r", (tag,), "", False, None, 1, 1, index=index)


class ChunkStream:
    """Chunks after given delays, the shape a GroupStream has (``finished``, ``cancel``)."""

    def __init__(self, delays, num_choices=1, fail_after=None):
        self.chunks = [(d, chunk(k % num_choices, k)) for k, d in enumerate(delays)]
        self.fail_after = fail_after
        self.finished = False
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.fail_after is not None and not self.chunks:
            await asyncio.sleep(self.fail_after)
            self.finished = True
            raise ProtocolError("the TP group failed", 503)
        delay, next_chunk = self.chunks.pop(0)
        await asyncio.sleep(delay)
        self.finished = not self.chunks and self.fail_after is None
        return next_chunk

    def cancel(self):
        self.finished = self.cancelled = True


def collect(merged):
    async def run():
        return [chunk async for chunk in merged]
    return asyncio.run(run())


def test_chunks_come_as_they_arrive_with_each_streams_choices_shifted():
    streams = [ChunkStream([0.03, 0.03], num_choices=2), ChunkStream([0.0, 0.05], num_choices=2)]
    merged = MergedStreams(streams, num_choices=2)
    got = [(c.index, c.new_token_ids[0]) for c in collect(merged)]
    # stream 1's first chunk (no delay) comes first; its choices are 2 and 3
    assert got[0] == (2, 0) and sorted(got) == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert merged.finished


def test_a_failing_stream_cancels_the_others_and_raises():
    slow = ChunkStream([0.0, 5.0])
    merged = MergedStreams([slow, ChunkStream([0.0], fail_after=0.05)], num_choices=1)

    async def run():
        seen = []
        with pytest.raises(ProtocolError, match="the TP group failed"):
            async for chunk in merged:
                seen.append(chunk)
        return seen

    assert len(asyncio.run(run())) == 2  # each stream's first chunk, then the failure
    assert slow.cancelled  # its 5 s chunk is not waited for


def test_a_last_chunk_that_came_while_the_reader_was_away_is_still_read():
    # The SSE writer asks `finished` between chunks, after sending the last one on (an await).
    # Stream 1's only chunk came during that send: its stream was finished, its chunk still in
    # the merge's pending read, and `finished` said True: the CI run of 2026-12-03 lost prompt
    # 1's whole output from a streamed batch that way (test_ingress_ray's batch test).
    merged = MergedStreams([ChunkStream([0.0]), ChunkStream([0.01])], num_choices=1)

    async def run():
        got = [await merged.__anext__()]
        await asyncio.sleep(0.05)  # sending the first chunk on
        while not merged.finished:
            got.append(await merged.__anext__())
        return got

    assert sorted(c.index for c in asyncio.run(run())) == [0, 1]
    assert merged.finished
