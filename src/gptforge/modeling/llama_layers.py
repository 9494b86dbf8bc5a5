"""The parts that make `GPT` a Llama-style model (`model.arch: llama`): RMSNorm, rotary position
embeddings, the SwiGLU feed-forward and the key/value head repetition of grouped-query attention,
each computed as transformers' modeling_llama computes it (RMSNorm in float32 then cast back, the
rotation of the two halves of each head, `inv_freq` from `rope_theta`), so the same weights give
the same logits (tests/test_llama_arch.py checks it against LlamaForCausalLM). Only torch is imported.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def swiglu_width(n_embd: int, multiple: int = 64) -> int:
    """The SwiGLU width when the config names none: 8/3 n_embd (its three matrices then hold what
    GPT-2's two 4 n_embd ones do, as in the Llama paper), rounded up to a multiple of 64."""
    return -(-(8 * n_embd // 3) // multiple) * multiple


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 whatever x's dtype (LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); `c_fc` holds gate then up as one (2 hidden, n_embd) matrix
    (one matmul instead of two), `c_proj` is down: the names GPT-2's MLP has, so LoRA's targets
    and the residual-projection init apply unchanged."""

    def __init__(self, n_embd: int, hidden: int, bias: bool, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 2 * hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.dropout(self.c_proj(F.silu(gate) * up))


def rotary(pos: int, T: int, head_dim: int, theta: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (T, head_dim) in `like`'s dtype, for positions pos..pos+T-1: the angles
    position * theta^(-2i/head_dim), computed in float32, repeated for the two halves of a head."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=like.device).float() / head_dim))
    positions = torch.arange(pos, pos + T, device=like.device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, head_dim) by its positions' angles: x cos + rotate_half(x) sin, where
    rotate_half(x) = (-x2, x1) for x's halves (x1, x2)."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, n_kv, S, hd) -> (B, n_kv * n_rep, S, hd), each key/value head repeated n_rep times in a
    row (query head h reads key/value head h // n_rep), as sdpa's enable_gqa pairs them."""
    if n_rep == 1:
        return x
    B, n_kv, S, hd = x.shape
    return x[:, :, None].expand(B, n_kv, n_rep, S, hd).reshape(B, n_kv * n_rep, S, hd)
