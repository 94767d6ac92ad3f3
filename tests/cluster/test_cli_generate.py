"""`tpserve generate` as a user runs it: a subprocess, JSON lines out, clear errors. Most error
cases run the same entry point in this process (`cli_errors`): a subprocess per case would spend
seconds importing torch to print one line."""

import json
import subprocess
import sys

import pytest


def tpserve(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "cluster.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


def cli_errors(capsys, *args):
    """The exit code and stderr of ``tpserve *args`` run through the console script's entry
    point (`cluster.cli.main.main`) in this process."""
    from cluster.cli.main import main

    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    return code, capsys.readouterr().err


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
def test_malformed_prompts_file(tiny_llama, tmp_path, capsys, content, match):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    code, err = cli_errors(capsys, "generate", "--model", str(tiny_llama),
                           "--prompts-file", str(prompts))
    assert code == 2 and match in err, err


def test_missing_model_and_long_prompt_are_clear_errors(tiny_llama, tmp_path, capsys):
    missing = tpserve("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert missing.returncode == 2 and "nope" in missing.stderr
    assert "Traceback" not in missing.stderr
    code, err = cli_errors(capsys, "generate", "--model", str(tiny_llama), "--block-size", "4",
                           "--prompt", "hello " * 400)
    assert code == 2 and "the model's context is 256" in err, err


def test_generate_with_host_and_disk_tiers(tiny_llama, tmp_path):
    prompts = tmp_path / "p.jsonl"
    shared = list(range(10, 42))
    prompts.write_text("".join(json.dumps({"prompt_token_ids": shared + [50 + i]}) + "\n"
                               for i in range(3)))
    base = ("generate", "--model", str(tiny_llama), "--max-tokens", "4", "--block-size", "4",
            "--json", "--prompts-file", str(prompts))
    plain = tpserve(*base, "--kv-blocks", "64")
    tiered = tpserve(*base, "--kv-blocks", "12", "--max-num-seqs", "1", "--host-kv-blocks", "4",
                     "--disk-kv-dir", str(tmp_path / "kv"), "--disk-kv-blocks", "32",
                     "--kv-eviction", "hotness")
    assert plain.returncode == 0 and tiered.returncode == 0, tiered.stderr
    assert tiered.stdout == plain.stdout
    assert (tmp_path / "kv" / "engine0" / "rank0" / "tokens.snapshot").exists()


@pytest.mark.parametrize("args,match", [
    (("--disk-kv-dir", "/tmp/x", "--disk-kv-blocks", "4"), "needs a host tier"),
    (("--host-kv-blocks", "4", "--disk-kv-dir", "/tmp/x"), "--disk-kv-gb or --disk-kv-blocks"),
    (("--host-kv-blocks", "4", "--disk-kv-dir", "/tmp/x,,/tmp/y", "--disk-kv-blocks", "4"),
     "entry 2 is empty"),
    (("--host-kv-blocks", "4", "--disk-kv-dir", "/tmp/x,/tmp/y/../x", "--disk-kv-blocks", "4"),
     "is the same directory as '/tmp/x'"),
    (("--host-kv-blocks", "4", "--disk-kv-dir", "/dev/null/kv,/tmp/x", "--disk-kv-blocks", "4"),
     "'/dev/null/kv' cannot be created or written"),
    (("--host-kv-blocks", "0"), "--host-kv-blocks must be at least 1"),
    (("--host-kv-blocks", "4", "--no-prefix-cache"), "prefix-cached"),
    (("--kv-eviction", "mru"), "invalid choice"),
])
def test_bad_tier_flags_are_clear_errors(tiny_llama, capsys, args, match):
    code, err = cli_errors(capsys, "generate", "--model", str(tiny_llama), "--prompt", "hi", *args)
    assert code == 2 and match in err, err
