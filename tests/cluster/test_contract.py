"""`cluster.contract`: the load report's dict round trip and its refusals (by the key's name), and
the request and chunk as they cross Ray (pickled)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from cluster.contract import GroupChunk, GroupRequest, LoadReport
from workers.request import RequestId
from workers.sampler import SampledToken
from workers.sampling_params import SamplingParams

REPORT = LoadReport(seq=3, time=1700000000.5, num_blocks_used=12, num_blocks_total=100,
                    block_size=16, num_waiting_tokens=40,
                    cached_block_hashes=frozenset({2**63 + 1, 7, 9}),
                    accepted_ids=frozenset({"a1", "b2"}))


@pytest.mark.parametrize("report", [
    REPORT,
    dataclasses.replace(REPORT, is_engine_alive=False),
    dataclasses.replace(REPORT, cached_block_hashes=frozenset(), accepted_ids=frozenset()),
])
def test_a_report_comes_back_from_its_stats_unchanged(report):
    stats = report.to_stats()
    assert LoadReport.from_stats(stats) == report
    assert LoadReport.from_stats(pickle.loads(pickle.dumps(stats))) == report  # as Serve sends it
    assert LoadReport.seq_of(stats) == report.seq
    assert LoadReport.says_engine_died(stats) is not report.is_engine_alive


def test_stats_in_lists_and_without_engine_alive_parse_as_before():
    stats = {"seq": 1, "time": 2, "kv_blocks_used": 0, "kv_blocks_total": 10, "block_size": 4,
             "waiting_tokens": 0, "cached_block_hashes": [5, 5, 6], "accepted_ids": ["r"]}
    report = LoadReport.from_stats(stats)
    assert report.cached_block_hashes == {5, 6} and report.accepted_ids == {"r"}
    assert report.time == 2.0 and isinstance(report.time, float) and report.is_engine_alive
    assert not LoadReport.says_engine_died(stats) and not LoadReport.says_engine_died({})


def test_a_report_missing_keys_names_them():
    stats = REPORT.to_stats()
    del stats["block_size"], stats["accepted_ids"]
    with pytest.raises(ValueError, match=r"lack \['block_size', 'accepted_ids'\]"):
        LoadReport.from_stats(stats)
    with pytest.raises(ValueError, match="lack"):
        LoadReport.from_stats({})


@pytest.mark.parametrize("key,bad,words", [
    ("seq", "3", "'seq' must be an int"),
    ("kv_blocks_used", 1.5, "'kv_blocks_used' must be an int"),
    ("kv_blocks_total", None, "'kv_blocks_total' must be an int"),
    ("block_size", "16", "'block_size' must be an int"),
    ("waiting_tokens", [], "'waiting_tokens' must be an int"),
    ("time", "now", "'time' must be a number"),
    ("cached_block_hashes", "0123", "'cached_block_hashes' must be a collection"),
    ("cached_block_hashes", 7, "'cached_block_hashes' must be a collection"),
    ("accepted_ids", "r1", "'accepted_ids' must be a list of request ids"),
    ("accepted_ids", ["r1", 2], "'accepted_ids' must be a list of request ids"),
    ("engine_alive", 0.0, "'engine_alive' must be a bool"),
])
def test_each_malformed_report_field_is_refused_by_name(key, bad, words):
    with pytest.raises(ValueError, match=words):
        LoadReport.from_stats({**REPORT.to_stats(), key: bad})


def test_a_request_and_its_resumed_copy_cross_pickle_unchanged():
    request = GroupRequest(RequestId("req-1"), (1, 2, 3),
                           SamplingParams(max_tokens=8, temperature=0.0, stop=("zz",), n=1,
                                          logit_bias={5: -1.0}, logprobs=2))
    assert pickle.loads(pickle.dumps(request)) == request
    resumed = request.resumed([7, 8])
    assert resumed.resume_output_ids == (7, 8) and request.resume_output_ids == ()
    assert dataclasses.replace(resumed, resume_output_ids=()) == request
    assert pickle.loads(pickle.dumps(resumed)) == resumed
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.request_id = RequestId("other")  # type: ignore[misc]


def test_a_chunk_crosses_pickle_unchanged_and_no_larger_than_its_dict():
    chunk = GroupChunk(RequestId("req-1"), (17, 18), "ab", True, "length", 3, 5,
                       (SampledToken(17, -0.5, ((17, -0.5), (4, -1.5))),
                        SampledToken(18, -0.25, ((18, -0.25), (4, -2.0)))), index=1)
    assert pickle.loads(pickle.dumps(chunk)) == chunk
    plain = GroupChunk(RequestId("req-1"), (17,), "a", False, None, 3, 4)
    assert pickle.loads(pickle.dumps(plain)) == plain and plain.logprobs == () and plain.index == 0
    assert not hasattr(plain, "__dict__")  # slots: nothing rides along per chunk
    # What a chunk was before it had a type: the dataclass pickles smaller (no key per field).
    as_dict = {"request_id": "req-1", "new_token_ids": [17], "delta_text": "a",
               "finished": False, "finish_reason": None, "num_prompt_tokens": 3,
               "num_output_tokens": 4, "logprobs": [], "index": 0}
    assert len(pickle.dumps(plain, protocol=5)) < len(pickle.dumps(as_dict, protocol=5))
