"""The ingress's side of the checkpoint's tokenizer: prompts (text, token ids or chat messages)
to checked token ids, and token ids back to text. Every failure is a `ProtocolError` naming the
request field, so a client gets a 400, never a 500.

A checkpoint without tokenizer files is served too, on token ids alone: text in or out is then
refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from cluster.api.protocol import ProtocolError
from cluster.api.openai_requests import ChatMessage
from workers.model_config import load_model_config
from workers.tokenizer import load_tokenizer


class PromptCodec:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = load_tokenizer(Path(model_dir))  # None: token ids only
        self.vocab_size = load_model_config(Path(model_dir)).vocab_size

    def prompt_ids(self, prompt: Any, add_special_tokens: Optional[bool] = None) -> List[int]:
        """A completion's ``prompt``: text (tokenized) or token ids (checked)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ProtocolError("this model has no tokenizer: send the prompt as token ids",
                                    param="prompt")
            add = True if add_special_tokens is None else add_special_tokens
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add))
            if not ids:
                raise ProtocolError("the prompt tokenizes to no tokens", param="prompt")
            return ids
        self.check_token_ids(prompt, "prompt")
        return list(prompt)

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ProtocolError(f"{param} token ids must be in [0, {self.vocab_size}); got "
                                f"{bad[:5]}", param=param)

    def chat_prompt_ids(self, messages: Sequence[ChatMessage], options: Dict[str, Any],
                        add_special_tokens: Optional[bool]) -> List[int]:
        """Chat ``messages`` through the checkpoint's chat template."""
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer, so no chat template: use "
                                "/v1/completions with token ids", param="messages")
        conversation = [m.template_message(i) for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, **options)
        except Exception as exc:  # jinja errors (e.g. roles must alternate), no template
            raise ProtocolError(f"cannot apply the chat template: {exc}", param="messages")
        # The template writes BOS itself: special tokens are added only when asked (as vLLM).
        return list(self.tokenizer.encode(text, add_special_tokens=bool(add_special_tokens)))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer: text cannot be produced")
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_strs(self, token_ids: Sequence[int]) -> List[str]:
        """``/tokenize``'s ``token_strs``: each id's token as the vocabulary spells it."""
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer, so no token strings: drop "
                                "return_token_strs", param="return_token_strs")
        return self.tokenizer.convert_ids_to_tokens(list(token_ids))

    def token_text(self, token_id: int) -> str:
        """One output token's text (logprobs), ``<id>`` without a tokenizer."""
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])
