"""The ingress's prompt handling (`cluster.api.prompts`) with a real checkpoint's tokenizer,
and with a checkpoint that has none: every refusal is a ProtocolError naming the field (a 400)."""

import shutil

import pytest

from cluster.api.prompts import PromptCodec
from cluster.api.protocol import ProtocolError
from cluster.api.openai_requests import ChatMessage
from workers.tokenizer import _TOKENIZER_FILES, load_tokenizer


@pytest.fixture(scope="module")
def no_tokenizer(tiny_llama, tmp_path_factory):
    bare = tmp_path_factory.mktemp("bare") / "llama"
    shutil.copytree(tiny_llama, bare)
    for name in _TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    return bare


def test_text_chat_and_ids_through_the_checkpoints_tokenizer(tiny_llama):
    codec, tokenizer = PromptCodec(tiny_llama), load_tokenizer(tiny_llama)
    assert codec.prompt_ids("hello world") == tokenizer.encode("hello world")
    assert codec.prompt_ids([5, 6, 7]) == [5, 6, 7]
    messages = [ChatMessage(role="user", content="hi")]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert "hi" in text  # the template wrote its own markup (and BOS): no special tokens added
    want = tokenizer.encode(text, add_special_tokens=False)
    assert codec.chat_prompt_ids(messages, {"add_generation_prompt": True}, None) == want
    assert codec.token_strs([5, 6]) == tokenizer.convert_ids_to_tokens([5, 6])
    assert codec.detokenize(codec.prompt_ids("hello world")) == "hello world"
    with pytest.raises(ProtocolError, match=r"prompt token ids must be in \[0, ") as exc:
        codec.prompt_ids([5, codec.vocab_size])
    assert exc.value.param == "prompt"


def test_without_a_tokenizer_token_ids_work_and_text_is_refused_by_name(no_tokenizer):
    codec = PromptCodec(no_tokenizer)
    assert codec.tokenizer is None
    assert codec.prompt_ids([5, 6, 7]) == [5, 6, 7] and codec.token_text(9) == "<9>"
    refusals = {
        "prompt": lambda: codec.prompt_ids("hello"),
        "messages": lambda: codec.chat_prompt_ids([ChatMessage(role="user", content="hi")],
                                                  {}, None),
        # /tokenize with return_token_strs: before, an AttributeError (a 500)
        "return_token_strs": lambda: codec.token_strs([5, 6]),
    }
    for param, call in refusals.items():
        with pytest.raises(ProtocolError, match="no tokenizer") as exc:
            call()
        assert exc.value.param == param
    with pytest.raises(ProtocolError, match="no tokenizer"):
        codec.detokenize([5, 6])
