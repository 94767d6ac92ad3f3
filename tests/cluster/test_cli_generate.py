"""`tpserve generate` as a user runs it: a subprocess, JSON lines out, clear errors."""

import json
import subprocess
import sys

import pytest


def tpserve(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_json_lines_in_input_order(tiny_llama, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n{"prompt_token_ids": [5, 6, 7, 8]}\n')
    result = tpserve("generate", "--model", str(tiny_llama), "--max-tokens", "5",
                     "--block-size", "4", "--kv-blocks", "64", "--json",
                     "--prompts-file", str(prompts))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 2
    assert lines[1]["prompt_token_ids"] == [5, 6, 7, 8]
    for line in lines:
        assert len(line["output_token_ids"]) == 5 and isinstance(line["text"], str)


@pytest.mark.parametrize("content,match", [
    ('{"prompt": "ok"}\n{"prompt": \n', "line 2: not valid JSON"),
    ('{"text": "wrong key"}\n', 'line 1: expected {"prompt": "text"}'),
    ('{"prompt_token_ids": [1, "x"]}\n', "line 1: expected"),
    ("\n", "no prompts"),
])
def test_malformed_prompts_file(tiny_llama, tmp_path, content, match):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    result = tpserve("generate", "--model", str(tiny_llama), "--prompts-file", str(prompts))
    assert result.returncode == 2
    assert match in result.stderr and "Traceback" not in result.stderr


def test_missing_model_and_long_prompt_are_clear_errors(tiny_llama, tmp_path):
    missing = tpserve("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert missing.returncode == 2 and "nope" in missing.stderr
    assert "Traceback" not in missing.stderr
    long = tpserve("generate", "--model", str(tiny_llama), "--block-size", "4",
                   "--prompt", "hello " * 400)
    assert long.returncode == 2 and "the model's context is 256" in long.stderr
    assert "Traceback" not in long.stderr
