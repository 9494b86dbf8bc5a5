"""The kernels' math in plain PyTorch: what the Triton versions must agree with.

Written for clarity, not memory: attention materialises the T x T matrix and cross-entropy the
full softmax. The tests run them in float64 on the kernels' inputs.
"""

from __future__ import annotations

import math

import torch


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, sm_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T * scale [causal: keys j <= query i]) v, log-sum-exp of each score row)."""
    scale = 1.0 / math.sqrt(q.size(-1)) if sm_scale is None else sm_scale
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        T, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean over rows with target != ignore_index of logsumexp(row) - row[target] (NaN if none)."""
    keep = targets != ignore_index
    rows = logits[keep]
    losses = torch.logsumexp(rows, dim=-1) - rows.gather(1, targets[keep][:, None]).squeeze(1)
    return losses.sum() / keep.sum()
