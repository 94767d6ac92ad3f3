"""Tokenizers and tiny checkpoints of the tool-calling model families, for tests: the tiny trained
BPE tokenizer of `tiny_models` plus each family's special tokens and a chat template with a tool
section in the family's format (written here from the formats, not copied from model files).

- ``llama3``: Llama 3.x headers; tools listed in the user turn, calls written as
  ``{"name": ..., "parameters": ...}`` separated by ``; ``, results in ``ipython`` turns;
  ``<|python_tag|>`` a special token.
- ``qwen2``: Qwen2.5 ChatML; tools in ``<tools>`` in the system turn, each call in
  ``<tool_call>\\n{...}\\n</tool_call>`` (not special tokens, as in Qwen2.5), results in
  ``<tool_response>`` inside user turns.
"""

from __future__ import annotations

from pathlib import Path

from tiny_models import build_checkpoint, set_generation_eos

MAX_MODEL_LEN = 2048

# Written for transformers' Jinja settings (trim_blocks, lstrip_blocks): every newline of the
# output is in a string.
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython' }}
{%- if messages[0].role == 'system' %}{{- '\n' + messages[0].content }}{%- endif %}
{{- '<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with a JSON for a function call with its proper arguments.\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\n' }}
{%- for tool in tools %}{{- (tool | tojson) + '\n' }}{%- endfor %}
{{- '<|eot_id|>' }}
{%- elif messages[0].role == 'system' %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' + messages[0].content + '<|eot_id|>' }}
{%- endif %}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'assistant' and m.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- for call in m.tool_calls %}
{%- if not loop.first %}{{- '; ' }}{%- endif %}
{{- '{"name": "' + call.function.name + '", "parameters": ' + (call.function.arguments | tojson) + '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- elif m.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""

QWEN2_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions. Their signatures are inside <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each call, return a JSON object with the function name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if m.content %}{{- '\n' + m.content }}{%- endif %}
{%- for call in m.tool_calls or [] %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

FAMILIES = {
    "llama3": dict(template=LLAMA3_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>",
                   special=["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                            "<|python_tag|>"], plain=[]),
    "qwen2": dict(template=QWEN2_TEMPLATE, bos=None, eos="<|im_end|>",
                  special=["<|im_start|>"], plain=["<tool_call>", "</tool_call>"]),
}


def save_tool_tokenizer(model_dir: Path, family: str) -> None:
    """Give the checkpoint in ``model_dir`` the ``family``'s tokenizer (replacing its own)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    spec = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.add_special_tokens({"additional_special_tokens": [
        t for t in [spec["bos"], spec["eos"], *spec["special"]] if t]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["plain"]])
    if spec["bos"]:
        tok.bos_token = spec["bos"]
    tok.eos_token = spec["eos"]
    tok.chat_template = spec["template"]
    tok.save_pretrained(str(model_dir))
    set_generation_eos(model_dir, tok.convert_tokens_to_ids(spec["eos"]))


def build_tool_checkpoint(out_dir: Path, family: str) -> Path:
    """A tiny random ``family`` checkpoint (llama for llama3, qwen2) with its tool tokenizer,
    and room for a prompt with tools (a few hundred tokens of the tiny vocabulary)."""
    kind = {"llama3": "llama", "qwen2": "qwen2"}[family]
    path = build_checkpoint(Path(out_dir), kind, max_position_embeddings=MAX_MODEL_LEN)
    save_tool_tokenizer(path, family)
    return path
