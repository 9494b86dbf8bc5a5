"""Which CPU kernel multiplies one or two rows by a bf16 or fp16 weight: `gemv_kernels(rows,
dtype, device)`, a context that decoding holds around a step.

On the CPU torch hands a bf16 matrix product to oneDNN (mkldnn) whenever it may; at one or two
rows, a decode step at batch 1, oneDNN's GEMM is about half as fast as ATen's own reduced-
precision matrix-vector kernel, which the same product reaches with oneDNN off
(`torch.backends.mkldnn.enabled`). At four rows and more oneDNN is the faster one. Measured on
one 2-core AMD EPYC with AVX-512 BF16, 2026-11-29, SmolLM2-135M's 210 decoder linears (212 MB
in bf16), medians of 7:

| rows | oneDNN | ATen's kernel |
|---:|---:|---:|
| 1 | 22.1 ms | 10.1 ms |
| 2 | 21.9 ms (GPT-2 124M's) | 12.9 ms |
| 4 | 24.5 ms | 25.1 ms |
| 16 | 31.0 ms | 94.0 ms |

A whole SmolLM2 decode step went from 29 to 58 tokens/s with the same greedy tokens (both
accumulate in float32). float32 products do not go through oneDNN and are left alone; fp16
gains less (10.6 -> 8.7 ms). The flag is process-wide: a step holds it for its own duration. Each
engine of `gptforge serve` runs in a process of its own by default; with `--engine-process off`
and several models, one engine's one-row step can send another engine's concurrent many-row
step to ATen's kernels too: slower for that step, the same products rounded by another kernel.
"""

from __future__ import annotations

import contextlib

import torch

GEMV_ROWS = 2  # at most this many rows: ATen's kernel
_REDUCED = (torch.bfloat16, torch.float16)


class _OneDNNOff:
    """torch.backends.mkldnn.enabled False for the duration, then as it was."""

    __slots__ = ("was",)

    def __enter__(self):
        self.was = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        return self

    def __exit__(self, *exc):
        torch._C._set_mkldnn_enabled(self.was)
        return False


def gemv_kernels(rows: int, dtype: torch.dtype, device: torch.device | str):
    """A context in which a product of `rows` rows in `dtype` on `device` takes the faster CPU
    kernel (the module's docstring); a no-op context elsewhere (a GPU, float32, many rows)."""
    if rows <= GEMV_ROWS and dtype in _REDUCED and torch.device(device).type == "cpu":
        return _OneDNNOff()
    return contextlib.nullcontext()
