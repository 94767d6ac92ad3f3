"""The gRPC API's conversions (``cluster.api.grpc_protocol``) and options, without Ray running."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from cluster.api.grpc_protocol import (
    SERVICER_FUNCTION,
    chat_request,
    completion_request,
    completion_response,
    status_code,
)
from cluster.api.grpc_service import grpc_options
from cluster.api.protocol import ProtocolError
from cluster.proto.tpserve.v1 import tpserve_pb2 as pb


def test_unset_fields_take_the_http_defaults():
    body = completion_request(pb.CompletionRequest(model="m", prompt="hi"))
    assert body.max_tokens is None and body.prompt == "hi"
    sampling = body.sampling(4)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == \
        (1.0, 1.0, None, None)
    assert completion_request(pb.CompletionRequest(model="m", prompt="x", top_k=-1)).top_k is None


def test_floats_arrive_as_the_client_wrote_them():
    body = completion_request(pb.CompletionRequest(model="m", prompt_token_ids=[3, 4],
                                                   temperature=0.8, top_p=0.95, min_p=0.1,
                                                   seed=2**64 - 1))
    assert (body.temperature, body.top_p, body.min_p) == (0.8, 0.95, 0.1)
    assert body.prompt == [3, 4] and body.seed == 2**64 - 1


def test_bad_requests_name_the_field():
    with pytest.raises(ProtocolError, match="not both"):
        completion_request(pb.CompletionRequest(model="m", prompt="a", prompt_token_ids=[1]))
    with pytest.raises(ProtocolError, match="prompt is empty"):
        completion_request(pb.CompletionRequest(model="m"))
    with pytest.raises(ProtocolError) as info:
        chat_request(pb.ChatRequest(model="m", messages=[pb.ChatMessage(role="bot")]))
    assert info.value.param == "messages.0.role"
    with pytest.raises(ProtocolError, match="messages"):
        chat_request(pb.ChatRequest(model="m"))


def test_stop_is_limited_as_on_the_http_api():
    with pytest.raises(ProtocolError, match="at most 4 stop strings, got 5") as info:
        completion_request(pb.CompletionRequest(model="m", prompt="a", stop=list("abcde")))
    assert info.value.param == "stop"
    with pytest.raises(ProtocolError, match="at most 1024 characters") as info:
        chat_request(pb.ChatRequest(model="m", messages=[pb.ChatMessage(role="user",
                                                                        content="hi")],
                                    stop=["x" * 1025]))
    assert info.value.param == "stop"


def test_chat_messages_and_options():
    body = chat_request(pb.ChatRequest(model="m", max_tokens=5, stop=["x"], ignore_eos=True,
                                       messages=[pb.ChatMessage(role="user", content="hi")]))
    assert [m.template_message() for m in body.messages] == [{"role": "user", "content": "hi"}]
    assert body.requested_max_tokens == 5 and body.sampling(5).stop == ("x",)
    assert body.ignore_eos


@pytest.mark.parametrize("error,code", [
    (ProtocolError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (ProtocolError("key", 401), grpc.StatusCode.UNAUTHENTICATED),
    (ProtocolError("model", 404), grpc.StatusCode.NOT_FOUND),
    (ProtocolError("busy", 503, code="overloaded"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ProtocolError("failed", 503, code="group_failed"), grpc.StatusCode.UNAVAILABLE),
    (ProtocolError("bug", 500), grpc.StatusCode.INTERNAL),
    (ProtocolError("slow down", 429), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ProtocolError("too slow", 504), grpc.StatusCode.DEADLINE_EXCEEDED),
])
def test_status_codes(error, code):
    assert status_code(error) == code


def test_completion_response():
    out = completion_response("cmpl-1", "ab", [7, 8], "length", 3, 2)
    assert (out.id, out.text, list(out.token_ids), out.finish_reason) == \
        ("cmpl-1", "ab", [7, 8], "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 2)


def test_grpc_options_and_a_bad_port():
    from ray.serve.config import gRPCOptions

    assert grpc_options(0) is None
    options = gRPCOptions(**grpc_options(9000))
    assert options.port == 9000 and options.grpc_servicer_functions == [SERVICER_FUNCTION]
    assert len(options.grpc_servicer_func_callable) == 1  # importable, as Serve's proxy needs
    with pytest.raises(ValueError, match="--grpc-port"):
        grpc_options(70000)


def test_the_cli_refuses_a_bad_grpc_port_before_starting_ray(tiny_llama):
    result = subprocess.run([sys.executable, "-m", "cluster.cli.main", "serve", "--model",
                             str(tiny_llama), "--grpc-port", "-1"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "--grpc-port must be a TCP port" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_serve_config_file_serves_the_grpc_api():
    from pathlib import Path

    from cluster.serve_config import read_config_file

    schema = read_config_file(Path(__file__).resolve().parents[2] / "deploy/ray/serve.yaml")
    assert schema.grpc_options.grpc_servicer_functions == [SERVICER_FUNCTION]
