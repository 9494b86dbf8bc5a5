"""What a benchmark records about the machine it ran on and the code it ran: the CPU's model name
and the repository's git state (commit, uncommitted changes). Used by the benchmarks that write a
result file (bench_serve, bench_serve_model, bench_serve_llama_cpp, bench_synthesize, bench_startup,
bench_make_run, bench_tokenize, bench_lora)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def describe() -> dict:
    """The machine a serving or training figure was taken on: platform, CPU, cores, torch, and
    whether the CPU has native bf16 (which decides the fast dtype)."""
    import os

    import torch

    from gptforge.modeling.hf_causal import cpu_has_native_bf16

    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "native_bf16": cpu_has_native_bf16(),
    }
