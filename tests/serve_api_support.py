"""What the tests of `gptforge serve`'s API share (tests/test_serve_api.py, test_serve_process.py).

`folders`: the served models, made once per module that imports the fixture (a gptforge GPT
`tiny`, a Hugging Face Llama `llama`, a spam classifier `spam` on the GPT, and their `root`);
`PROMPT`; reading a running server's /metrics (`metric`, `running`); `wait_until` a condition.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from hf_models import make_tiny_causal_lm
from serve_support import tiny_classifier, tiny_gpt

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    gpt = tiny_gpt(root / "tiny")
    return {
        "tiny": gpt,
        "llama": make_tiny_causal_lm(root / "llama", "llama", max_positions=1024),
        # gptforge's own llama arch (grouped kv heads): served through its LlamaForCausalLM form
        "ours-llama": tiny_gpt(root / "ours-llama", seed=2, arch="llama", n_kv_head=1, bias=False),
        "spam": tiny_classifier(root / "spam", gpt),
        "root": root,
    }


def running(server) -> float:
    return metric(server, "gptforge_running_requests")


def metric(server, name: str) -> float:
    """A series of the server's /metrics, summed over its models."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf'^{name}\{{model="[^"]+"\}} (\S+)$', text, re.M))


def wait_until(condition, what: str, timeout: float = 120) -> None:
    """Poll `condition` until true. The timeout is a bound against a hang only: what is waited
    for comes within a few steps of the model, seconds on a loaded machine."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.05)
