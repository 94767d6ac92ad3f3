"""OpenAI protocol: request validation (400s that name the field), the token budget, and the
exact response, chunk and error shapes the official client parses."""

import json

import pytest

from cluster.api.protocol import (
    SSE_DONE,
    ChatFormat,
    ChoiceResult,
    CompletionFormat,
    ProtocolError,
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    error_body,
    models_list,
    parse_request,
    resolve_max_tokens,
    sse_event,
    token_logprobs,
)
from cluster.api.openai_requests import ChatCompletionRequest, CompletionRequest, ignored_fields
from workers.sampler import SampledToken
from workers.sampling_params import SamplingParams


def completion(**fields):
    return parse_request(json.dumps({"model": "m", "prompt": "hi", **fields}).encode(),
                         CompletionRequest)


def chat(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


def refused(build, **fields) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        build(**fields)
    assert info.value.status == 400
    return info.value


# ----- requests -----

@pytest.mark.parametrize("prompt,expected", [
    ("hello", "hello"),
    ([5, 6, 7], [5, 6, 7]),
    (["hello"], "hello"),
    ([[5, 6]], [5, 6]),
])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt == expected
    assert completion(prompt=prompt).prompts == [expected]


@pytest.mark.parametrize("prompt", [["a", "b c"], [[5, 6], [7], [8, 9, 10]]])
def test_a_batch_of_prompts_keeps_its_order(prompt):
    # Before: refused ("batched prompts are not supported"), as vLLM and OpenAI take them.
    assert completion(prompt=prompt).prompts == prompt


@pytest.mark.parametrize("prompt,words", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([[]], "prompt is empty"),
    (["a", ""], "prompt is empty"),
    ([[5], []], "prompt is empty"),
    ([[5], [6, -1]], "non-negative"),
    (["a"] * 257, "at most 256 prompts in a batch, got 257"),
    ([1, "a"], "expected one of str, list[int]"),
    ([3, -1], "non-negative"),
    (7, "expected one of"),
])
def test_bad_prompts(prompt, words):
    err = refused(completion, prompt=prompt)
    assert words in err.message and err.param == "prompt"


@pytest.mark.parametrize("fields,param,words", [
    ({"n": "two"}, "n", "valid integer"),
    ({"echo": True, "logprobs": 1}, "echo", "echo with logprobs is not supported"),
    ({"best_of": 3}, "best_of", "best_of is not supported"),
    ({"presence_penalty": "high"}, "presence_penalty", "valid number"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5", "valid number"),
    ({"max_tokens": 1.5}, "max_tokens", "valid integer"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"stop": 5}, "stop", "expected one of"),
    ({"seed": 2**64}, "seed", "less than"),
])
def test_unsupported_or_mistyped_fields(fields, param, words):
    err = refused(completion, **fields)
    assert err.param == param and words in err.message, err.message


@pytest.mark.parametrize("build", [completion, chat])
def test_stop_takes_at_most_four_strings_of_bounded_length(build):
    """As OpenAI: up to 4 stop strings; together at most 1024 characters."""
    assert build(stop=["a", "b", "c", "d" * 1021]).sampling(1).stop == (
        "a", "b", "c", "d" * 1021)
    err = refused(build, stop=["a", "b", "c", "d", "e"])
    assert err.param == "stop" and "at most 4 stop strings, got 5" in err.message, err.message
    for stop in ("x" * 1025, ["a", "x" * 1024]):
        err = refused(build, stop=stop)
        assert err.param == "stop" and "at most 1024 characters" in err.message, err.message


def test_chat_template_kwargs_hold_template_variables_and_name_request_templates():
    body = chat(chat_template="{{ 1 }}", chat_template_kwargs={"chat_template": "{{ 2 }}",
                                                                "enable_thinking": False})
    assert body.request_templates() == [("chat_template", "{{ 1 }}"),
                                        ("chat_template_kwargs.chat_template", "{{ 2 }}")]
    assert chat(chat_template_kwargs={"enable_thinking": False}).request_templates() == []
    for key in ("tokenize", "tools", "documents"):  # the template call's own parameters
        err = refused(chat, chat_template_kwargs={key: True})
        assert err.param == f"chat_template_kwargs.{key}", err.message
        assert "not a variable of the template" in err.message


def test_missing_model_and_invalid_json():
    with pytest.raises(ProtocolError, match="model: Field required"):
        parse_request(b'{"prompt": "x"}', CompletionRequest)
    with pytest.raises(ProtocolError, match="not valid JSON") as info:
        parse_request(b'{"model": ', CompletionRequest)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    with pytest.raises(ProtocolError, match="must be a JSON object"):
        parse_request(b"[1, 2]", CompletionRequest)


def test_sampling_defaults_and_extensions():
    req = completion(stop="\n", top_k=5, ignore_eos=True, seed=3, logprobs=2,
                     stop_token_ids=[9])
    assert req.sampling(10) == SamplingParams(
        max_tokens=10, temperature=1.0, top_p=1.0, top_k=5, seed=3, stop=("\n",),
        stop_token_ids=(9,), ignore_eos=True, logprobs=2)
    assert completion(temperature=0, top_p=0.5).sampling(4).temperature == 0.0


def test_chat_fields():
    req = chat(max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=3,
               stream=True, stream_options={"include_usage": True})
    assert req.requested_max_tokens == 7 and req.max_tokens_param == "max_completion_tokens"
    assert req.sampling(7).logprobs == 3 and req.include_usage
    assert chat(logprobs=True).sampling(1).logprobs == 0
    assert chat().sampling(1).logprobs is None
    assert not chat(stream_options={"include_usage": True}).include_usage  # stream is off
    with pytest.raises(ProtocolError, match="top_logprobs requires logprobs"):
        chat(top_logprobs=2).sampling(1)


def test_chat_messages():
    req = chat(messages=[{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}])
    assert [m.template_message() for m in req.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ProtocolError, match="only text content parts"):
        image.messages[0].template_message()
    assert refused(chat, messages=[]).param == "messages"
    assert refused(chat, messages=[{"role": "robot", "content": "x"}]).param == "messages.0.role"
    assert refused(chat, tools=[{"type": "function"}]).param == "tools.0.function"
    assert refused(chat, response_format={"type": "xml"}).param == "response_format.type"


# ----- the token budget -----

def test_max_tokens_within_context():
    assert resolve_max_tokens(10, 20, 100) == 10
    assert resolve_max_tokens(80, 20, 100) == 80
    assert resolve_max_tokens(None, 20, 100) == 80  # unset: the room left
    assert resolve_max_tokens(None, 20, 100, default=16) == 16
    assert resolve_max_tokens(None, 95, 100, default=16) == 5  # a default never overflows


@pytest.mark.parametrize("requested,prompt,words,param", [
    (0, 5, "max_tokens must be at least 1, got 0", "max_tokens"),
    (-3, 5, "at least 1", "max_tokens"),
    (96, 5, "max_tokens can be at most 95", "max_tokens"),
    (10**9, 5, "exceeds this model's context of 100 tokens", "max_tokens"),
    (1, 100, "the prompt has 100 tokens", "prompt"),
    (None, 150, "shorten the prompt", "prompt"),
])
def test_max_tokens_refused(requested, prompt, words, param):
    with pytest.raises(ProtocolError) as info:
        resolve_max_tokens(requested, prompt, 100)
    assert info.value.status == 400 and words in info.value.message
    assert info.value.param == param


def test_budget_names_the_param_the_user_sent():
    with pytest.raises(ProtocolError, match="max_completion_tokens=500") as info:
        resolve_max_tokens(500, 5, 100, param="max_completion_tokens", prompt_param="messages")
    assert info.value.param == "max_completion_tokens"


# ----- responses -----

def test_error_shape():
    assert error_body("bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}
    assert ProtocolError("down", 503).body()["error"]["type"] == "server_error"
    assert ProtocolError("key", 401, code="invalid_api_key").body()["error"]["code"] == \
        "invalid_api_key"


def test_completion_response_shape():
    fmt = CompletionFormat("cmpl-1", 123, "tiny")
    assert fmt.response([ChoiceResult("hello", "length")], 3, 2) == {
        "id": "cmpl-1", "object": "text_completion", "created": 123, "model": "tiny",
        "choices": [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def test_completion_stream_shape():
    fmt = CompletionFormat("cmpl-1", 123, "tiny", include_usage=True)
    assert fmt.start() == []
    delta = fmt.delta("he", None)
    assert delta == {"id": "cmpl-1", "object": "text_completion", "created": 123,
                     "model": "tiny", "usage": None,
                     "choices": [{"index": 0, "text": "he", "logprobs": None,
                                  "finish_reason": None}]}
    assert fmt.finish("stop")["choices"][0] == {"index": 0, "text": "", "logprobs": None,
                                                "finish_reason": "stop"}
    last = fmt.usage_chunk(3, 2)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 5
    assert "usage" not in CompletionFormat("c", 1, "m").delta("x", None)


def test_chat_response_and_stream_shape():
    fmt = ChatFormat("chatcmpl-1", 123, "tiny")
    body = fmt.response([ChoiceResult("hi", "stop")], 4, 1)
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    [first] = fmt.start()
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert fmt.delta("h", None)["choices"][0]["delta"] == {"content": "h"}
    end = fmt.finish("length")["choices"][0]
    assert end["delta"] == {} and end["finish_reason"] == "length"
    assert fmt.usage_chunk(4, 1)["choices"] == []


def test_logprobs_shapes():
    entries = token_logprobs([SampledToken(7, -0.5, ((7, -0.5), (8, -1.5))),
                              SampledToken(9, -0.1)],
                             lambda i: {7: "ab", 8: "x", 9: "c"}[i])
    assert entries == [TokenLogprob("ab", -0.5, (("ab", -0.5), ("x", -1.5))),
                       TokenLogprob("c", -0.1)]
    assert completion_logprobs(entries, 10) == {
        "tokens": ["ab", "c"], "token_logprobs": [-0.5, -0.1],
        "top_logprobs": [{"ab": -0.5, "x": -1.5}, {}], "text_offset": [10, 12]}
    first = chat_logprobs(entries)["content"][0]
    assert first == {"token": "ab", "logprob": -0.5, "bytes": [97, 98], "top_logprobs": [
        {"token": "ab", "logprob": -0.5, "bytes": [97, 98]},
        {"token": "x", "logprob": -1.5, "bytes": [120]}]}


def test_stream_text_offsets_continue_across_chunks():
    fmt = CompletionFormat("c", 1, "m")
    fmt.delta("hello", [TokenLogprob("hello", -1.0)])
    second = fmt.delta(" you", [TokenLogprob(" you", -1.0)])
    assert second["choices"][0]["logprobs"]["text_offset"] == [5]


def test_sse_framing_and_models():
    assert sse_event({"a": 1}) == 'data: {"a":1}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
    listing = models_list("tiny", "/m", 256, 5)
    assert listing["object"] == "list"
    assert listing["data"][0] == {"id": "tiny", "object": "model", "created": 5,
                                  "owned_by": "tpserve", "root": "/m", "max_model_len": 256}


# ----- every parameter honoured or refused by name (issue 14, defect 1) -----

@pytest.mark.parametrize("build,fields,param", [
    (completion, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (completion, {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    (completion, {"use_beam_search": True}, "use_beam_search"),
    (completion, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (completion, {"suffix": "x"}, "suffix"),
    (completion, {"best_of": 3}, "best_of"),
    (chat, {"functions": [{"name": "f"}]}, "functions"),
    (chat, {"function_call": "auto"}, "function_call"),
    (chat, {"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    (chat, {"skip_special_tokens": False}, "skip_special_tokens"),
    (chat, {"messages": [{"role": "assistant", "content": None, "function_call": {
        "name": "f", "arguments": "{}"}}]}, "messages[0].function_call"),
])
def test_known_but_unsupported_parameters_are_refused_by_name(build, fields, param):
    err = refused(build, **fields)
    assert err.param == param and param.split("[")[0] in err.message, err.message


def test_defaults_of_unsupported_parameters_pass():
    assert completion(use_beam_search=False, best_of=1, suffix=None,
                      response_format={"type": "text"}).n == 1
    assert chat(tool_choice="none", tools=[], skip_special_tokens=True).n == 1


def test_implemented_parameters_reach_the_engine():
    s = completion(min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=-0.5, logit_bias={"5": 2.0}, min_tokens=2,
                   include_stop_str_in_output=True, n=3, top_k=-1).sampling(8)
    assert s.min_p == 0.1 and s.repetition_penalty == 1.3
    assert s.presence_penalty == 0.5 and s.frequency_penalty == -0.5
    assert s.logit_bias == {5: 2.0} and s.min_tokens == 2 and s.n == 3
    assert s.include_stop_str_in_output is True and s.top_k is None  # vLLM's -1: off
    c = chat(chat_template_kwargs={"enable_thinking": False}, add_generation_prompt=False)
    assert c.chat_template_kwargs == {"enable_thinking": False}
    assert c.add_generation_prompt is False


def test_logit_bias_keys_must_be_token_ids():
    err = refused(completion, logit_bias={"hello": 1.0})
    assert err.param == "logit_bias" and "token id" in err.message


def test_unknown_fields_are_listed_for_a_warning():
    req = completion(frobnicate=True, user="u1", use_beam_search=False)
    assert req.user == "u1" and ignored_fields(req) == ["frobnicate"]
    assert ignored_fields(chat(tools=[], tool_choice="none", zzz=1)) == ["zzz"]
