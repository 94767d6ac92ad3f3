"""What the check asks the running cluster, from the machine that ran `ray up`: its live nodes
(the dashboard's state API), the application's status (Serve's REST API), and requests through
the head's port 8000 with the `openai` client."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, List, Optional

from scripts.ray_up.phases import CheckFailed

PROMPT = "What is the capital of France? Answer in one word."
MAX_TOKENS = 12


def get_json(url: str, timeout_s: float = 10.0) -> Optional[Any]:
    """The JSON at `url`, or None while it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return None


def wait_for(what: str, probe: Callable[[], Optional[Any]], timeout_s: float,
             period_s: float = 2.0) -> Any:
    """`probe()`'s first value that is not None; `CheckFailed` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        time.sleep(period_s)
    raise CheckFailed(f"{what}: not after {timeout_s:.0f} s")


def alive_nodes(dashboard: str) -> List[Dict[str, Any]]:
    data = get_json(f"{dashboard}/api/v0/nodes?limit=100") or {}
    nodes = data.get("data", {}).get("result", {}).get("result", [])
    return [node for node in nodes if node.get("state") == "ALIVE"]


def app_status(dashboard: str, app: str) -> Optional[Dict[str, Any]]:
    """The application's entry in Serve's status, or None while Serve has none."""
    data = get_json(f"{dashboard}/api/serve/applications/") or {}
    return (data.get("applications") or {}).get(app)


def running_or_raise(dashboard: str, app: str) -> Optional[Dict[str, Any]]:
    """For `wait_for`: the status once RUNNING; `CheckFailed` once the deploy failed."""
    status = app_status(dashboard, app)
    if status is None:
        return None
    if status["status"] in ("DEPLOY_FAILED", "UNHEALTHY"):
        raise CheckFailed(f"serve deploy: application {app} is {status['status']}: "
                          f"{status.get('message', '')[-3000:]}")
    return status if status["status"] == "RUNNING" else None


def chat(base_url: str, api_key: Optional[str], model: str):
    """One greedy chat completion through the `openai` client."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0,
                           timeout=300)
    if api_key is None:  # the client always sends a key; none at all is a raw request
        client = client.with_options(default_headers={"Authorization": ""})
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
        temperature=0)


def status_of(call: Callable[[], Any]) -> int:
    """The HTTP status a call ends with: 200, or the status of the `openai` error."""
    import openai

    try:
        call()
        return 200
    except openai.APIStatusError as exc:
        return exc.status_code


def rotated(base_url: str, old: str, new: str, tries: int) -> Optional[bool]:
    """True when `tries` listings of the models with the new key all pass and as many with the
    old key all get 401 (the proxy spreads them over the ingress replicas); else None."""
    import openai

    def listing(key: str) -> int:
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)
        return status_of(client.models.list)

    codes = [(listing(new), listing(old)) for _ in range(tries)]
    return True if all(pair == (200, 401) for pair in codes) else None


def check_answer(completion, expected: Optional[str]) -> Dict[str, Any]:
    """The answer's figures; `CheckFailed` unless it holds real tokens (and, with `expected`,
    equals `transformers`' greedy answer on the same checkpoint)."""
    choice = completion.choices[0]
    text = choice.message.content or ""
    figures = {"answer": text, "completion_tokens": completion.usage.completion_tokens,
               "finish_reason": choice.finish_reason, "expected": expected}
    if not text.strip() or not 0 < completion.usage.completion_tokens <= MAX_TOKENS:
        raise CheckFailed(f"request: no real answer: {figures}")
    if expected is not None and text != expected:
        raise CheckFailed(f"request: the answer differs from transformers' greedy one: "
                          f"{figures}")
    return figures


def reference_answer(model_dir: str) -> str:
    """`transformers`' greedy answer to the check's prompt on the checkpoint at `model_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                        add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
