"""The committed gRPC modules are what ``grpcio-tools`` generates from the committed .proto."""

from __future__ import annotations

import pytest

from cluster.proto import generate

pytest.importorskip("grpc_tools")


def test_generated_modules_match_the_proto(tmp_path):
    written = generate.generate(tmp_path)
    committed = generate.REPO / generate.PROTO.parent
    stale = [path.name for path in written
             if path.read_bytes() != (committed / path.name).read_bytes()]
    assert not stale, (f"{stale} differ from what {generate.PROTO} generates: run "
                       f"`python -m cluster.proto.generate` and commit the result")


def test_the_api_keeps_its_field_numbers():
    from cluster.proto.tpserve.v1 import tpserve_pb2 as pb

    def numbers(message):
        return {f.name: f.number for f in message.DESCRIPTOR.fields}

    assert numbers(pb.CompletionRequest).items() >= {
        "model": 1, "prompt": 2, "prompt_token_ids": 3, "max_tokens": 4, "temperature": 5,
        "top_p": 6, "top_k": 7, "seed": 8, "stop": 9}.items()
    assert numbers(pb.ChatRequest).items() >= {
        "model": 1, "messages": 2, "max_tokens": 3, "temperature": 4, "top_p": 5, "top_k": 6,
        "seed": 7, "stop": 8}.items()
    assert numbers(pb.CompletionResponse).items() >= {
        "id": 1, "text": 2, "token_ids": 3, "finish_reason": 4, "usage": 5}.items()
    assert numbers(pb.CompletionChunk).items() >= {"text": 1, "token_ids": 2,
                                                   "finish_reason": 3, "usage": 4}.items()
    assert numbers(pb.Usage) == {"prompt_tokens": 1, "completion_tokens": 2}
    service = pb.DESCRIPTOR.services_by_name["TPServe"]
    assert {m.name: m.server_streaming for m in service.methods} == {
        "Complete": False, "CompleteStream": True, "Chat": False, "ChatStream": True,
        "ListModels": False}
