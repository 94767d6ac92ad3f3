"""OpenAI's (and vLLM's) request bodies for ``/v1/completions`` and ``/v1/chat/completions``.

Every field a client sends is either honoured or refused by name. Fields that OpenAI or vLLM
define and tpserve does not implement (beam search, ...) are accepted
only at their default values; any other value is a 400 naming the field. Fields nobody defines
are ignored and listed by ``ignored_fields()`` so the ingress can log them, as vLLM does.
Extensions beyond OpenAI's fields, as vLLM names them: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``stream_options.continuous_usage_stats``, ``add_special_tokens``,
and for chat ``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``. The fields that constrain the output (``response_format``,
``structured_outputs``, ``guided_*``): `cluster.api.structured_requests`. Tool calling (``tools``, ``tool_choice``,
``parallel_tool_calls``, assistant ``tool_calls``): `cluster.api.tools.definitions`; the deprecated
``functions`` and ``function_call`` are refused.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.api.protocol import ProtocolError
from cluster.api.tools.definitions import AssistantToolCall, ToolFields
from cluster.api.structured_requests import StructuredFields
from workers.sampling_params import SamplingParams

# Defined by OpenAI or vLLM, not implemented here: the values that mean "not asked for".
_REFUSED_COMMON: Dict[str, Tuple[Any, ...]] = {
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "logits_processors": (None,), "prompt_logprobs": (None,), "bad_words": (None, []),
    "allowed_token_ids": (None,), "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "priority": (None, 0),
    "prompt_embeds": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None,),
    "cache_salt": (None,), "return_token_ids": (None, False),
}
# Prompts in one batched /v1/completions request: each is an engine request of its own, routed on
# its own, so a batch this long is already a burst.
MAX_BATCH_PROMPTS = 256
# Stop strings, as OpenAI allows: each is matched against the tail of every choice's text at
# every step, so their number and length bound that work.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1024
_REFUSED_COMPLETION = {**_REFUSED_COMMON, "suffix": (None, ""), "best_of": (None, 1)}
_REFUSED_CHAT = {
    **_REFUSED_COMMON, "functions": (None, []), "function_call": (None, "none"),
    "reasoning_effort": (None,), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "web_search_options": (None,), "store": (None, False),
    "metadata": (None,), "documents": (None,), "mm_processor_kwargs": (None,),
    "echo": (None, False),
}
_REFUSED_IN_MESSAGES = {"function_call": (None,)}
# Parameters of transformers' apply_chat_template, which the server sets (or refuses as the
# request's own fields): chat_template_kwargs holds the template's variables only. Its
# chat_template is a template sent in the request (cluster.api.request_limits.check_chat_templates).
_TEMPLATE_CALL_PARAMS = (
    "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
)


def _refuse(raw: Any, refused: Dict[str, Tuple[Any, ...]], where: str = "") -> None:
    if not isinstance(raw, dict):
        return
    for name, accepted in refused.items():
        if name in raw and raw[name] not in accepted:
            param = f"{where}{name}"
            raise ProtocolError(f"{param} is not supported by this server (got "
                                f"{raw[name]!r}); leave it unset", param=param)


def ignored_fields(body: BaseModel) -> List[str]:
    """Fields in ``body`` that neither OpenAI nor vLLM define: ignored, to be logged. (Refused
    fields sent at their default values pass validation and are not listed.)"""
    refused = getattr(type(body), "_refused", {})
    return sorted(k for k in body.model_extra or () if k not in refused)


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with the usage.")
    continuous_usage_stats: bool = Field(False, description="Usage in every chunk (vLLM).")


class _SamplingFields(StructuredFields):
    """What completions and chat share (the output's constraint: `StructuredFields`)."""

    model_config = ConfigDict(extra="allow")
    _refused: ClassVar[Dict[str, Tuple[Any, ...]]] = _REFUSED_COMMON

    model: str = Field(description="The served model name (or the model directory).")
    max_tokens: Optional[int] = Field(None, description="Most tokens to generate.")
    temperature: Optional[float] = Field(None, description="0 is greedy; default 1.")
    top_p: Optional[float] = Field(None, description="Nucleus sampling mass; default 1.")
    top_k: Optional[int] = Field(None, description="Sample among the k likeliest; -1 or 0: off.")
    min_p: float = Field(0.0, description="Drop tokens below min_p x the likeliest's probability.")
    n: int = Field(1, description="Number of choices (one prefill, shared prompt blocks).")
    stream: bool = Field(False, description="Stream chunks by server-sent events.")
    stream_options: Optional[StreamOptions] = Field(None, description="Streaming options.")
    stop: Optional[Union[str, List[str]]] = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} stop strings ({MAX_STOP_CHARS} "
                          f"characters in all).")
    stop_token_ids: Optional[List[int]] = Field(None, description="Stop tokens.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string.")
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64,
                                description="Makes sampling reproducible (a 64-bit integer).")
    user: Optional[str] = Field(None, description="An end-user id (logged, not used).")
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    min_tokens: int = Field(0, ge=0, description="Generate at least this many tokens.")
    presence_penalty: float = Field(0.0, description="Penalty for tokens already generated.")
    frequency_penalty: float = Field(0.0, description="Penalty per occurrence so far.")
    repetition_penalty: float = Field(1.0, description="transformers' repetition penalty.")
    logit_bias: Optional[Dict[str, float]] = Field(None, description="Token id -> added logit.")
    add_special_tokens: Optional[bool] = Field(None, description="Add BOS etc. when tokenizing.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, raw: Any) -> Any:
        _refuse(raw, cls._refused)
        return raw

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: Optional[Union[str, List[str]]]
                      ) -> Optional[Union[str, List[str]]]:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        num_chars = sum(map(len, strings))
        if num_chars > MAX_STOP_CHARS:
            raise ValueError(f"stop strings of at most {MAX_STOP_CHARS} characters in all, "
                             f"got {num_chars}")
        return stop

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, top_k: Optional[int]) -> Optional[int]:
        return None if top_k in (-1, 0) else top_k

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: Optional[Dict[str, float]]) -> Optional[Dict[str, float]]:
        bad = [key for key in bias or {} if not key.strip().isdigit()]
        if bad:
            raise ValueError(f"keys must be token ids (non-negative integers), got {bad[:5]}")
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options
                    and self.stream_options.continuous_usage_stats)


    def requested_logprobs(self) -> Optional[int]:
        raise NotImplementedError

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The request's sampling for the group (`cluster.contract.GroupRequest.sampling`);
        ValueError from `SamplingParams` names a field out of its range."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k, min_p=self.min_p, n=self.n, seed=self.seed,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=self.requested_logprobs(),
            structured=self.constraint.output if self.constraint else None,
        )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids), or a batch of them (a list of
    texts or of token-id lists; each prompt's ``n`` choices come in order, OpenAI's indices)."""

    _refused: ClassVar[Dict[str, Tuple[Any, ...]]] = _REFUSED_COMPLETION

    prompt: Union[str, List[int], List[str], List[List[int]]] = Field(
        description=f"Text, token ids, or a batch of up to {MAX_BATCH_PROMPTS} of either.")
    logprobs: Optional[int] = Field(None, description="Top log-probabilities per token (0-20).")
    echo: bool = Field(False, description="Return the prompt before the completion.")

    @field_validator("prompt")
    @classmethod
    def _checked_prompts(cls, prompt: Any) -> Any:
        batch = _is_batch(prompt)
        if batch and len(prompt) > MAX_BATCH_PROMPTS:
            raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts in a batch, got {len(prompt)}")
        for one in (prompt if batch else [prompt]):
            if not one:
                raise ValueError("prompt is empty")
            if isinstance(one, list) and min(one) < 0:
                raise ValueError("prompt token ids must be non-negative")
        return prompt[0] if batch and len(prompt) == 1 else prompt

    @property
    def prompts(self) -> List[Union[str, List[int]]]:
        """The prompts in order: one, or the batch's."""
        return list(self.prompt) if _is_batch(self.prompt) else [self.prompt]  # type: ignore

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> "CompletionRequest":
        if self.echo and self.logprobs is not None:
            raise ProtocolError("echo with logprobs is not supported (the prompt's "
                                "log-probabilities are not computed); drop one of them",
                                param="echo")
        return self

    def requested_logprobs(self) -> Optional[int]:
        return self.logprobs


def _is_batch(prompt: Any) -> bool:
    """A list of prompts (texts or token-id lists), not one prompt of token ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="Only 'text' is supported.")
    text: Optional[str] = Field(None, description="The text of a 'text' part.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ContentPart]]] = Field(None, description="Text or parts.")
    name: Optional[str] = Field(None, description="The author's name.")
    tool_call_id: Optional[str] = Field(None, description="Which call a tool message answers.")
    tool_calls: Optional[List[AssistantToolCall]] = Field(
        None, description="An assistant message's calls of the request's tools.")

    def template_message(self, index: int = 0) -> Dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines, and tool
        calls with their arguments as mappings (a 400 naming ``messages[index]`` when they are
        not JSON objects)."""
        content = self.content
        if isinstance(content, list):
            bad = sorted({p.type for p in content if p.type != "text"})
            if bad:
                raise ProtocolError(f"only text content parts are supported, got {bad}",
                                    param="messages")
            content = "\n".join(p.text or "" for p in content)
        message = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key):
                message[key] = getattr(self, key)
        if self.tool_calls:
            message["tool_calls"] = [call.template_call(f"messages[{index}].tool_calls[{j}]")
                                     for j, call in enumerate(self.tool_calls)]
        return message


class _TemplateFields(BaseModel):
    """How the chat template renders ``messages`` (vLLM's extensions)."""

    model_config = ConfigDict(extra="allow")

    messages: List[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    chat_template: Optional[str] = Field(None, description="A Jinja template to use instead.")
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(
        None, description="Extra variables for the chat template (e.g. enable_thinking).")
    add_generation_prompt: bool = Field(True, description="End with the assistant's header.")
    continue_final_message: bool = Field(False, description="Continue the last message.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_in_messages(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and isinstance(raw.get("messages"), list):
            for i, message in enumerate(raw["messages"]):
                _refuse(message, _REFUSED_IN_MESSAGES, f"messages[{i}].")
        return raw

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: Optional[Dict[str, Any]]
                                 ) -> Optional[Dict[str, Any]]:
        for key in kwargs or ():
            if key in _TEMPLATE_CALL_PARAMS:
                param = f"chat_template_kwargs.{key}"
                raise ProtocolError(f"{param}: a parameter of the template call, not a "
                                    f"variable of the template; leave it out", param=param)
        return kwargs

    @model_validator(mode="after")
    def _one_way_to_end(self) -> "_TemplateFields":
        if self.continue_final_message and self.add_generation_prompt:
            raise ProtocolError("continue_final_message needs add_generation_prompt=false",
                                param="continue_final_message")
        return self

    @model_validator(mode="after")
    def _tool_call_arguments(self) -> "_TemplateFields":
        """Each assistant tool call's arguments are a JSON object (400 naming the call)."""
        for i, message in enumerate(self.messages):
            for j, call in enumerate(message.tool_calls or ()):
                call.template_call(f"messages[{i}].tool_calls[{j}]")
        return self

    def request_templates(self) -> List[Tuple[str, Any]]:
        """The chat templates the request sends, each with the field that carries it."""
        sent = [("chat_template", self.chat_template),
                ("chat_template_kwargs.chat_template",
                 (self.chat_template_kwargs or {}).get("chat_template"))]
        return [(param, template) for param, template in sent if template is not None]

    def template_options(self) -> Dict[str, Any]:
        """Keyword arguments for ``tokenizer.apply_chat_template``."""
        options: Dict[str, Any] = dict(self.chat_template_kwargs or {})
        options.update(add_generation_prompt=self.add_generation_prompt,
                       continue_final_message=self.continue_final_message)
        if self.chat_template is not None:
            options["chat_template"] = self.chat_template
        return options


class ChatCompletionRequest(ToolFields, _TemplateFields, _SamplingFields):
    """``POST /v1/chat/completions``; the prompt is the checkpoint's chat template applied."""

    _refused: ClassVar[Dict[str, Tuple[Any, ...]]] = _REFUSED_CHAT

    max_completion_tokens: Optional[int] = Field(None, description="Preferred to max_tokens.")
    logprobs: bool = Field(False, description="Return the sampled tokens' log-probabilities.")
    top_logprobs: Optional[int] = Field(None, description="Alternatives per token (0-20).")

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> Optional[int]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_options(self) -> Dict[str, Any]:
        """The template's options with the request's ``tools`` (rendered even with
        ``tool_choice`` none, as vLLM does)."""
        options = super().template_options()
        tools = self.template_tools()
        if tools:
            options["tools"] = tools
        return options


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``POST /tokenize`` with a prompt."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = Field(None, description="The served model (optional).")
    prompt: str = Field(description="Text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add BOS etc.")
    return_token_strs: bool = Field(False, description="Also return each token's string.")


class TokenizeChatRequest(_TemplateFields):
    """vLLM's ``POST /tokenize`` with chat messages: the chat template is applied first."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = Field(None, description="The served model (optional).")
    add_special_tokens: bool = Field(False, description="Add BOS etc. (the template has them).")
    return_token_strs: bool = Field(False, description="Also return each token's string.")


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = Field(None, description="The served model (optional).")
    tokens: List[int] = Field(description="Token ids to turn into text.")
