"""The ingress's prompt work off its event loop (`cluster.api.prompt_pool`), without Ray: a real
checkpoint's tokenizer, real Jinja templates, real threads. A chat template sent in a request is
refused unless trusted; a trusted one that renders too long is stopped at the bound while the
event loop and other requests carry on."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.api.prompts import PromptCodec
from cluster.api.protocol import ProtocolError
from cluster.api.openai_requests import ChatCompletionRequest
from cluster.api.prompt_pool import PromptPool
from cluster.api.request_limits import IngressLimits

MESSAGES = [{"role": "user", "content": "hello world"}]
ECHO_TEMPLATE = "{{ messages[0]['content'] }}"
# 1e10 empty Jinja loop iterations: minutes of pure Python (the sandbox caps a range at 1e5).
ENDLESS_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                    "{% endfor %}" + ECHO_TEMPLATE)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def trusting(**limits) -> IngressLimits:
    return IngressLimits(trust_request_chat_template=True, **limits)


@pytest.fixture(scope="module")
def codec(tiny_llama):
    return PromptCodec(tiny_llama)


def test_request_templates_are_refused_unless_trusted(codec):
    pool = PromptPool(codec, IngressLimits())
    for body, param in [(chat(chat_template=ECHO_TEMPLATE), "chat_template"),
                        (chat(chat_template_kwargs={"chat_template": ECHO_TEMPLATE}),
                         "chat_template_kwargs.chat_template")]:
        with pytest.raises(ProtocolError, match="--trust-request-chat-template") as info:
            asyncio.run(pool.chat_prompt_ids(body))
        assert (info.value.status, info.value.param) == (400, param)
    own = asyncio.run(pool.chat_prompt_ids(chat()))
    assert own == codec.chat_prompt_ids(chat().messages, chat().template_options(), None)


def test_a_trusted_template_renders_within_its_size_limit(codec):
    pool = PromptPool(codec, trusting(max_chat_template_chars=len(ENDLESS_TEMPLATE) - 1))
    ids = asyncio.run(pool.chat_prompt_ids(chat(chat_template=ECHO_TEMPLATE)))
    assert ids == codec.tokenizer.encode("hello world", add_special_tokens=False)
    with pytest.raises(ProtocolError, match=f"at most {len(ENDLESS_TEMPLATE) - 1}") as info:
        asyncio.run(pool.chat_prompt_ids(chat(chat_template=ENDLESS_TEMPLATE)))
    assert info.value.param == "chat_template"
    with pytest.raises(ProtocolError, match="expected a Jinja template") as info:
        asyncio.run(pool.chat_prompt_ids(chat(chat_template_kwargs={"chat_template": 7})))
    assert info.value.param == "chat_template_kwargs.chat_template"


def test_a_slow_template_stops_at_the_bound_while_the_loop_and_others_go_on(codec):
    pool = PromptPool(codec, trusting(prompt_timeout_s=1.0), num_threads=2)

    async def scenario():
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        async def timed(body):
            try:
                return await pool.chat_prompt_ids(body)
            finally:
                finished[body.chat_template] = time.monotonic() - start

        finished = {}
        ticking = asyncio.create_task(ticker())
        start = time.monotonic()
        slow = asyncio.create_task(timed(chat(chat_template=ENDLESS_TEMPLATE)))
        await asyncio.sleep(0.2)  # the endless template renders
        other = await timed(chat())
        with pytest.raises(ProtocolError) as info:
            await slow
        ticking.cancel()
        return info.value, other, finished, max(b - a for a, b in zip(ticks, ticks[1:]))

    error, other, finished, longest_tick_s = asyncio.run(scenario())
    assert other == codec.chat_prompt_ids(chat().messages, chat().template_options(), None)
    assert finished[None] < 0.8 < 1.0 <= finished[ENDLESS_TEMPLATE] < 3.0, finished
    assert longest_tick_s < 0.5, f"the event loop stalled for {longest_tick_s:.2f} s"
    assert (error.status, error.param, error.code) == (400, "chat_template", "prompt_timeout")
    assert "bound of 1 s" in error.message, error.message


def test_a_stopped_template_frees_its_thread(codec):
    """With one thread: were the stopped template still running, nothing else would."""
    pool = PromptPool(codec, trusting(prompt_timeout_s=0.3), num_threads=1)

    async def scenario():
        for _ in range(2):
            with pytest.raises(ProtocolError, match="bound of 0.3 s"):
                await pool.chat_prompt_ids(chat(chat_template=ENDLESS_TEMPLATE))
        return await asyncio.wait_for(pool.chat_prompt_ids(chat(chat_template=ECHO_TEMPLATE)),
                                      5.0)

    assert asyncio.run(scenario()) == codec.tokenizer.encode("hello world",
                                                             add_special_tokens=False)
