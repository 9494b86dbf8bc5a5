"""Models and a running `gptforge serve` for the server's tests (tests/test_serve_*.py).

`tiny_gpt` makes a gptforge checkpoint whose greedy answers vary from token to token (random
weights at a large scale: the usual 0.02 init makes a random GPT repeat one token, which would
make "the same tokens" a weak check). `start_server` runs the real command line as a user does
and waits for /health.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from cli_support import BIN, REPO
from process_support import free_port, stop_process, wait_http

PARAMS = REPO / "params.yaml"  # tokenizer.path: the embedded GPT-2 tokenizer


def tiny_gpt(folder: Path, *, seed: int = 0, block_size: int = 1024, **arch) -> Path:
    """`arch`: GPTConfig's llama keys (arch="llama", n_kv_head=1, ...) for a llama-arch checkpoint."""
    from gptforge.modeling.gpt import GPT, GPTConfig
    from gptforge.modeling.weights import save_model

    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=block_size, **arch))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    save_model(model, folder)
    return folder


def tiny_classifier(folder: Path, base: Path) -> Path:
    from gptforge.finetune.classifier import GPTClassifier, save_classifier
    from gptforge.modeling.weights import load_model

    torch.manual_seed(1)
    save_classifier(GPTClassifier(load_model(base), 2, labels=["ham", "spam"], max_length=64), folder)
    return folder


class Server:
    """A `gptforge serve` subprocess on a free loopback port."""

    def __init__(self, models: list[str], cwd: Path, *args: str, env: dict | None = None, timeout: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cwd / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(
            [str(BIN / "gptforge"), "serve", *models, "--port", str(self.port), "--params", str(PARAMS), *args],
            cwd=cwd,
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_http(f"{self.url}/health", timeout, self.proc)
        except Exception:
            self.stop()
            sys.stderr.write(self.log.read_text())
            raise

    def stop(self) -> None:
        stop_process(self.proc)


def cli_generate(checkpoint, prompt: str, n: int, *extra: str) -> str:
    """`gptforge generate`'s greedy answer of n tokens, as the command prints it."""
    out = subprocess.run(
        [
            str(BIN / "gptforge"),
            "generate",
            prompt,
            "--checkpoint",
            str(checkpoint),
            "--temperature",
            "0",
            "--max-new-tokens",
            str(n),
            "--params",
            str(PARAMS),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout[:-1]  # generate prints the answer and a newline
