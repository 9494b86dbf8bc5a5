"""GPT-2 in one file: config, model, KV-cached generation, weights I/O, Hugging Face conversion.

The architecture and parameter names follow nanoGPT (karpathy/nanoGPT), so its checkpoints and
its reading order carry over: token + position embeddings, pre-LayerNorm blocks
(ln_1 -> attn -> ln_2 -> mlp, tanh-GELU), final ln_f, and an lm_head tied to the token embedding.

Vocabulary: the embedding/head has `vocab_size` rows (50304 = GPT-2's 50257 padded to a multiple
of 64, which keeps the head matmul on fast kernel paths); only ids below `n_vocab` are real. The
padded logit columns are set to -inf, so the loss is exactly the cross-entropy over the real
vocabulary and the padded ids can never be sampled.

Only torch, numpy, safetensors and tiktoken are imported here at module level: training and
generation run on a bare GPU machine. `transformers` is imported inside the conversion functions.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file as _load_safetensors
from safetensors.torch import save as _safetensors_bytes

from gptforge.errors import BadInput, SourceUnreachable
from gptforge.io import atomic_file, read_json, write_json

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT = "gptforge-gpt2"
FORMAT_VERSION = 1
HF_PRETRAINED = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
EOT_ID = 50256  # GPT-2's <|endoftext|>; also its bos/eos in Hugging Face configs


def padded_vocab(n_vocab: int, multiple: int = 64) -> int:
    return -(-n_vocab // multiple) * multiple


# ---------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int = 50304  # rows of wte / lm_head (padded)
    n_vocab: int = 50257  # the tokenizer's real vocabulary: ids >= n_vocab never occur
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm (GPT-2 has them)
    attention: str = "sdpa"  # "math" (reference) | "sdpa" (fused kernels, FlashAttention-2 on CUDA) | "triton" (kernels/)

    def __post_init__(self):
        for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "n_vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BadInput(f"model config: {key} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise BadInput(f"model config: n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head})")
        if self.vocab_size < self.n_vocab:
            raise BadInput(f"model config: vocab_size ({self.vocab_size}) is smaller than the tokenizer's "
                           f"vocabulary n_vocab ({self.n_vocab})")
        if self.attention not in ("math", "sdpa", "triton"):
            raise BadInput(f"model config: attention must be 'math', 'sdpa' or 'triton', got {self.attention!r}")
        if self.attention == "triton" and self.dropout:
            raise BadInput("model config: attention 'triton' has no attention dropout; set model.dropout to 0 "
                           "or use attention 'sdpa'")
        if not 0 <= self.dropout < 1:
            raise BadInput(f"model config: dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPTConfig":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        missing = [n for n in names if n not in d]
        if unknown or missing:
            parts = ([f"unknown keys {', '.join(unknown)}"] if unknown else []) + (
                [f"missing keys {', '.join(missing)}"] if missing else [])
            raise BadInput(f"model config: {'; '.join(parts)}")
        return cls(**d)

    @classmethod
    def from_model_config(cls, m, n_vocab: int) -> "GPTConfig":
        """From params.yaml's `model` section (config.ModelConfig) and the tokenizer's size."""
        if m.vocab_size < n_vocab:
            raise BadInput(f"model.vocab_size ({m.vocab_size}) is smaller than the tokenizer's vocabulary ({n_vocab})")
        return cls(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, block_size=m.block_size,
                   vocab_size=m.vocab_size, n_vocab=n_vocab, dropout=m.dropout, bias=m.bias,
                   attention=m.attention)


# ---------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Keys and values of every layer, preallocated as (B, n_head, max_len, head_dim).

    `pos` counts the positions already written. A forward pass writes its T new positions at
    [pos, pos+T) in every layer, attends over [0, pos+T), and then advances `pos` once. Writing
    into a preallocated buffer (rather than torch.cat per step) keeps decoding free of
    allocations that grow with the sequence.
    """

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int | None = None, *,
                 device=None, dtype=torch.float32):
        max_len = config.block_size if max_len is None else max_len
        if max_len > config.block_size:
            raise BadInput(f"KV cache of {max_len} positions is longer than model.block_size={config.block_size}")
        # Keys and values of a layer share one (B, 2, n_head, max_len, head_dim) buffer, so that
        # a decode step stores both with a single copy (see _Decoder); k and v are views of it.
        shape = (batch_size, 2, config.n_head, max_len, config.head_dim)
        self.kv = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.k = [kv[:, 0] for kv in self.kv]
        self.v = [kv[:, 1] for kv in self.kv]
        self.batch_size = batch_size
        self.max_len = max_len
        self.pos = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's new keys/values at [pos, pos+T); return the views over [0, pos+T)."""
        end = self.pos + k.size(2)
        self.k[layer][:, :, self.pos:end].copy_(k)
        self.v[layer][:, :, self.pos:end].copy_(v)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def reset(self) -> None:
        self.pos = 0


# ---------------------------------------------------------------------------------------------
# Model


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.backend = config.attention

    def forward(self, x, mask=None, kv_cache: KVCache | None = None, layer: int = 0):
        """`mask` (T, S) bool, True = may attend; None means plain causal (T == S) or, for a
        single query after a cache prefix, no mask at all (it may see every key)."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)  # (B, nh, S, hd) with S = pos + T
        S = k.size(2)
        if self.backend == "triton":
            y = _triton_attention(q, k, v, mask, kv_cache)
        elif self.backend == "sdpa":
            # is_causal aligns its mask top-left, which is only right when T == S; a chunk after
            # a cache prefix brings its own right-aligned mask, a single query needs none.
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                is_causal=mask is None and T == S and T > 1)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            if mask is not None:
                att = att.masked_fill(~mask, float("-inf"))
            elif T == S and T > 1:
                att = att.masked_fill(~_causal_mask(T, S, x.device), float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, mask=None, kv_cache=None, layer=0):
        x = x + self.attn(self.ln_1(x), mask, kv_cache, layer)
        x = x + self.mlp(self.ln_2(x))
        return x


def _triton_attention(q, k, v, mask, kv_cache) -> torch.Tensor:
    """Our FlashAttention-2 kernel (kernels/flash_attention.py), imported here so that the model
    needs triton only when this backend is chosen. It computes full causal self-attention (T == S);
    cached decoding brings masks and a cache, and `generate` runs it through sdpa instead."""
    if kv_cache is not None or mask is not None:
        raise BadInput("attention 'triton' computes full causal sequences only (no KV cache, no explicit mask); "
                       "generation switches such models to sdpa")
    from kernels._runtime import KernelUnavailable
    from kernels.flash_attention import flash_attention

    try:
        return flash_attention(q, k, v, causal=True)
    except KernelUnavailable as e:
        raise BadInput(f"model.attention 'triton': {e}") from None


def _causal_mask(T: int, S: int, device) -> torch.Tensor:
    """(T, S) bool: query i (absolute position S-T+i) sees keys 0..S-T+i (right-aligned)."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (GPT-2): one matrix is both the input embedding and the output head.
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # The residual projections add into the stream once per block (twice per layer): scale
        # their init by 1/sqrt(2 * n_layer) so the stream's variance does not grow with depth
        # (GPT-2 paper, section 2.3).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    # -- sizes ------------------------------------------------------------------------------

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; `non_embedding` subtracts the position embeddings only (nanoGPT's
        convention): the token embedding stays in because, tied to lm_head, its weights do
        matmul work in every forward pass."""
        n = sum(p.numel() for p in self.parameters())  # the tied matrix is counted once
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token, from the PaLM paper's appendix B as in
        nanoGPT's estimate_mfu: 6N for the weight matmuls (N = num_params(non_embedding=True),
        lm_head included through the tied wte) plus 12·L·H·Q·T for attention scores and values."""
        cfg = self.config
        T = cfg.block_size if seq_len is None else seq_len
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T

    def crop_block_size(self, block_size: int) -> None:
        """Use fewer positions than the weights were trained with (nanoGPT's model surgery, e.g.
        GPT-2's 1024 down to a CPU-sized 64): keep the first rows of the position embedding."""
        if not 0 < block_size <= self.config.block_size:
            raise BadInput(f"cannot crop block_size {self.config.block_size} to {block_size}")
        self.config = dataclasses.replace(self.config, block_size=block_size)
        wpe = self.transformer.wpe
        wpe.weight = nn.Parameter(wpe.weight.detach()[:block_size].clone())
        wpe.num_embeddings = block_size

    # -- forward ----------------------------------------------------------------------------

    def hidden_states(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """The final-LayerNorm output (B, T, n_embd); advances `kv_cache` by T positions."""
        B, T = idx.size()
        pos = kv_cache.pos if kv_cache is not None else 0
        if pos + T > self.config.block_size:
            if kv_cache is None:
                raise BadInput(f"sequence of {T} tokens is longer than model.block_size={self.config.block_size}")
            raise BadInput(f"sequence of {pos + T} tokens (cache {pos} + {T} new) is longer than "
                           f"model.block_size={self.config.block_size}")
        if kv_cache is not None and pos + T > kv_cache.max_len:
            raise BadInput(f"KV cache holds {kv_cache.max_len} positions, {pos + T} needed")
        # A chunk of several queries after a cache prefix needs an explicit right-aligned mask;
        # the math backend needs one for any T > 1. Made once here, shared by every layer.
        mask = None
        if T > 1 and (pos > 0 or self.config.attention == "math"):
            mask = _causal_mask(T, pos + T, idx.device)
        # wpe rows by slicing, not an index tensor: a view, nothing allocated per decode step.
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe.weight[pos:pos + T])
        for i, block in enumerate(self.transformer.h):
            x = block(x, mask, kv_cache, i)
        if kv_cache is not None:
            kv_cache.pos = pos + T
        return self.transformer.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                kv_cache: KVCache | None = None, last_only: bool = False):
        """idx (B, T) int64 -> (logits (B, T or 1, vocab_size), loss or None).

        Columns >= n_vocab of the logits are -inf: softmax gives them 0, so cross-entropy over all
        columns equals cross-entropy over the real vocabulary, their gradient is 0 (the padded
        rows of wte never train), and sampling cannot pick them. `loss` is the mean cross-entropy
        over targets != -100.
        """
        x = self.hidden_states(idx, kv_cache)
        if last_only:
            x = x[:, -1:, :]
        logits = self.lm_head(x)
        if self.config.vocab_size > self.config.n_vocab:
            # In place on the matmul output, never a sliced copy of a (B, T, 50304) tensor. Under
            # no_grad so autograd does not record it: recorded, its backward clones the whole
            # logits gradient (CopySlices), ~15% of a tiny-config CPU step. Nothing is lost: the
            # gradient reaching these columns through softmax/cross-entropy is exactly 0 anyway
            # (probability exp(-inf) = 0), and the linear's backward does not read its output.
            with torch.no_grad():
                logits[..., self.config.n_vocab:] = float("-inf")
        loss = None
        if targets is not None:
            if last_only:
                raise BadInput("targets need logits at every position; do not combine them with last_only")
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return logits, loss

    def next_token_logits(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """(B, n_vocab) logits for the last position, for generation: the head is the first
        n_vocab rows of wte (a contiguous view), so nothing is computed for the padding."""
        x = self.hidden_states(idx, kv_cache)[:, -1, :]
        return _head(x, self.transformer.wte.weight[: self.config.n_vocab])

    # -- optimizer --------------------------------------------------------------------------

    def configure_optimizer(self, weight_decay: float, lr: float, betas, device_type: str) -> torch.optim.AdamW:
        """AdamW with decay on matrices and embeddings only, fused where supported (`gptforge.optim`)."""
        from gptforge.optim import adamw

        return adamw(self.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, device_type=device_type)


# ---------------------------------------------------------------------------------------------
# Generation


class _Decoder:
    """One decode step (a single new position per row, through the KV cache) of `model`, with
    the same tensor operations as `GPT.hidden_states` in the same order, so it gives the same
    hidden states (tests/test_generate.py checks it bitwise), minus the framework around them.

    At batch 1 a decode step of the tiny config is ~60 small operations of a few microseconds
    each plus the head's matrix-vector product; run through the nn.Module tree, the Python
    around those operations (module calls, hooks checks, shape bookkeeping, masks) costs about
    as much again. Here the weights are gathered once per `generate` call and each layer is a
    straight run of functional calls; K and V are stored with one copy (KVCache.kv).
    """

    def __init__(self, model: "GPT", cache: KVCache):
        cfg = model.config
        tr = model.transformer
        self.cache = cache
        self.n_embd, self.n_head, self.head_dim = cfg.n_embd, cfg.n_head, cfg.head_dim
        self.math = cfg.attention == "math"  # triton models decode with sdpa (see generate)
        self.layers = [(b.ln_1.weight, b.ln_1.bias, b.ln_1.eps, b.attn.c_attn.weight, b.attn.c_attn.bias,
                        b.attn.c_proj.weight, b.attn.c_proj.bias, b.ln_2.weight, b.ln_2.bias, b.ln_2.eps,
                        b.mlp.c_fc.weight, b.mlp.c_fc.bias, b.mlp.c_proj.weight, b.mlp.c_proj.bias)
                       for b in tr.h]
        self.wte, self.wpe = tr.wte.weight, tr.wpe.weight
        self.ln_f = (tr.ln_f.weight, tr.ln_f.bias, tr.ln_f.eps)

    @staticmethod
    def supports(model: "GPT") -> bool:
        """Whether the functional step computes what the modules would: every layer it reads is
        a plain nn.Linear / nn.LayerNorm (not, say, a peft LoRA layer that adds its adapter in
        forward) and no module has hooks. Otherwise generate decodes through the modules."""
        tr = model.transformer
        linears = [m for b in tr.h for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]
        norms = [m for b in tr.h for m in (b.ln_1, b.ln_2)] + [tr.ln_f]
        if any(type(m) is not nn.Linear for m in linears) or any(type(m) is not nn.LayerNorm for m in norms):
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        """tok (B,) int64, the token at position cache.pos -> (B, n_embd) final hidden states,
        whose product with the head gives the next token's logits."""
        cache = self.cache
        pos = cache.pos
        if pos + 1 > cache.max_len:
            raise BadInput(f"KV cache holds {cache.max_len} positions, {pos + 1} needed")
        B, C, nh, hd = tok.size(0), self.n_embd, self.n_head, self.head_dim
        shape = (C,)
        lin, ln = F.linear, F.layer_norm
        x = (self.wte[tok] + self.wpe[pos:pos + 1]).view(B, 1, C)
        for i, (l1w, l1b, eps1, aw, ab, pw, pb, l2w, l2b, eps2, fw, fb, mw, mb) in enumerate(self.layers):
            qkv = lin(ln(x, shape, l1w, l1b, eps1), aw, ab).view(B, 3, nh, 1, hd)
            kv = cache.kv[i]
            kv[:, :, :, pos:pos + 1] = qkv[:, 1:]
            k, v = kv[:, 0, :, :pos + 1], kv[:, 1, :, :pos + 1]  # (B, nh, pos + 1, hd)
            q = qkv[:, 0]  # (B, nh, 1, hd)
            if self.math:
                y = F.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)), dim=-1) @ v
            else:
                y = F.scaled_dot_product_attention(q, k, v)
            x = x + lin(y.view(B, 1, C), pw, pb)
            x = x + lin(F.gelu(lin(ln(x, shape, l2w, l2b, eps2), fw, fb), approximate="tanh"), mw, mb)
        cache.pos = pos + 1
        return ln(x.view(B, C), shape, *self.ln_f)


def _head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(B, C) hidden states -> (B, V) logits. At batch 1 a GEMV (`torch.mv`): for GPT-2's
    (50257, 768) head it is ~30% faster on the CPU than the GEMM F.linear picks for a (1, 768)
    input, and decoding reads the head once per token."""
    if x.size(0) == 1:
        return torch.mv(weight, x[0]).unsqueeze(0)
    return F.linear(x, weight)



@torch.inference_mode()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, eot_id: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True) -> torch.Tensor:
    """Continue `idx` (B, T) by up to `max_new_tokens` tokens; returns (B, T + n_new).

    temperature 0 is greedy (argmax); otherwise logits / temperature are sampled, from the
    `top_k` most likely tokens when given, with `generator` for reproducibility.
    With `eot_id`, a sequence stops at that token, which is kept in the output (as Hugging Face
    does); other rows of a batch go on, and finished rows are filled with `eot_id` until every
    row has ended or `max_new_tokens` is reached (so a batch of 1 returns right after its eot).

    With `use_cache`, the prompt is run once (prefill) and each new token costs one position
    through the KV cache. Once the sequence no longer fits in block_size, it falls back to
    nanoGPT's crop: recompute from the last block_size tokens without the cache (positions
    shift, so cached keys are no longer valid). Cached and uncached runs give the same tokens.
    """
    if idx.dim() != 2 or idx.size(1) == 0:
        raise BadInput(f"generate needs a (batch, tokens) prompt of at least one token, got shape {tuple(idx.shape)}")
    if temperature < 0:
        raise BadInput(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise BadInput(f"top_k must be a positive integer, got {top_k}")
    cfg = model.config
    was_training = model.training
    model.eval()
    # The Triton attention kernel has no KV cache: decode with sdpa, the same attention.
    swapped = [m for m in model.modules() if isinstance(m, CausalSelfAttention) and m.backend == "triton"]
    for m in swapped:
        m.backend = "sdpa"
    try:
        B, T0 = idx.shape
        out = torch.empty(B, T0 + max_new_tokens, dtype=torch.long, device=idx.device)
        out[:, :T0] = idx
        if max_new_tokens <= 0:
            return out[:, :T0]
        block = cfg.block_size
        cache = None
        if use_cache and T0 < block:
            dtype = model.transformer.wte.weight.dtype
            cache = KVCache(cfg, B, min(block, T0 + max_new_tokens), device=idx.device, dtype=dtype)
        done = torch.zeros(B, dtype=torch.bool, device=idx.device) if eot_id is not None else None
        if top_k is not None:
            top_k = min(top_k, cfg.n_vocab)
        head = model.transformer.wte.weight[: cfg.n_vocab]
        # Not under autocast: there the full head's logits are bfloat16, not float32. A new
        # int8 copy costs about what 10 tokens save: not made for fewer new tokens than that.
        screen = (_GreedyHead.for_model(model, build=max_new_tokens >= 16) if temperature == 0 and B == 1
                  and not torch.is_autocast_enabled(idx.device.type) else None)
        n = T0
        x = model.hidden_states(out[:, max(0, n - block):n], cache)[:, -1, :]
        step = _Decoder(model, cache) if cache is not None and _Decoder.supports(model) else None
        if step is None and cache is not None:
            def step(tok):
                return model.hidden_states(tok.view(-1, 1), cache)[:, -1, :]
        for _ in range(max_new_tokens):
            best = screen.argmax(x[0]) if screen is not None else None
            if best is not None:
                nxt = torch.tensor([best], device=idx.device)
            elif temperature == 0:
                nxt = _argmax(_head(x, head))
            else:
                logits = _head(x, head) / temperature
                if top_k is not None:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)
            if done is not None:
                nxt = torch.where(done, eot_id, nxt)
                done |= nxt == eot_id
            out[:, n] = nxt
            n += 1
            if n == T0 + max_new_tokens or (done is not None and bool(done.all())):
                break
            if step is not None and n <= cache.max_len:
                x = step(out[:, n - 1])
            else:
                x = model.hidden_states(out[:, max(0, n - block):n])[:, -1, :]
        return out[:, :n]
    finally:
        for m in swapped:
            m.backend = "triton"
        model.train(was_training)


class _GreedyHead:
    """The argmax of `weight @ x` (the next greedy token) for one float32 hidden state on the
    CPU, reading an int8 copy of the head instead of the float32 one, and still the exact
    argmax (ties to the lowest index).

    Decoding at batch 1 is memory-bound: each token reads every weight once, and GPT-2's
    (50257, 768) float32 head is 154 MB of the model's 500. Greedy decoding needs only the
    index of the largest logit, so:

    1. screen: approximate logits from a per-row int8 copy, w ~ s·q with s a bfloat16 scale
       (`torch._weight_int8pack_mm`, x rounded to bfloat16, bfloat16 out): a quarter of the
       bytes;
    2. bound: every approximate logit is within `err` of the exact x·w (below), so only rows
       whose approximation is within 2·err of the top one can hold the maximum;
    3. verify: the exact logits of those candidate rows, in float64, and their argmax (the
       lowest index on a tie, as torch.argmax).

    The error bound, for a row w = s·q + e (|e| <= E = max(s)·(1/2 + 127·2^-24): rounding to
    the nearest integer, plus float32's rounding of w/s) and x = x_b + r (x_b = bfloat16(x),
    r computed per call):
        |x·w - out| <= |r·w| + |x_b·e| + |x_b·(s·q) - out|
                    <= ||r||_1·max|w| + ||x_b||_1·E + 2^-7·max|out|/(1 - 2^-7) + acc
    where the third term is the kernel's own rounding (bfloat16 output, measured <= 2^-8
    relative, taken as 2^-7) and `acc` the float32 accumulation of C products,
    C·2^-24·127·max(s)·||x_b||_1. All terms are upper bounds, so the true maximum is always
    among the candidates. When there are none (non-finite values) or more than MAX_CANDIDATES,
    `argmax` returns None and the caller computes the full float32 logits. The kernel's
    rounding is an assumption about torch's implementation, so each new copy first checks it
    on a probe (`_kernel_within_bound`); where it does not hold, there is no screen.

    One copy per model, remade when the head changes (an optimizer step), made on first use:
    ~7 ms for the tiny config, ~40 ms for GPT-2 124M (2 CPU cores), against ~0.1 ms and ~3 ms
    saved per token. The screen applies only where it pays: the CPU, float32, batch 1, and
    torch providing the int8 kernel.
    """

    MAX_CANDIDATES = 1024

    def __init__(self, weight: torch.Tensor, chunk_rows: int = 1024):
        w = weight.detach()
        q = torch.empty(w.shape, dtype=torch.int8)
        scale = torch.empty(w.size(0), dtype=torch.bfloat16)
        amax = torch.empty(w.size(0))
        # Row blocks of ~3 MB (GPT-2): each is read from memory once and stays in cache for
        # its max, its scale and its quantization; whole-head passes would be 3x slower.
        for i in range(0, w.size(0), chunk_rows):
            rows = w[i:i + chunk_rows]
            a = amax[i:i + chunk_rows]
            torch.amax(rows.abs(), dim=1, out=a)
            # The scale rounded UP to bfloat16, so that |w / s| <= 127 and nothing is clamped:
            # then |w - s·q| <= s/2 plus the float32 rounding of w / s (<= 127·2^-24·s).
            b = _to_bf16((a / 127).clamp_min(torch.finfo(torch.float32).tiny), up=True)
            scale[i:i + chunk_rows] = b
            q[i:i + chunk_rows] = torch.round(rows / b.float()[:, None])
        smax = float(scale.float().max())
        self.err_w = smax * (0.5 + 127 * 2.0 ** -24)
        self.q = q
        self.scale = scale
        self.weight = w
        self.w_max = float(amax.max())
        self.acc = w.size(1) * 2.0 ** -24 * 127 * smax

    @staticmethod
    def usable(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.float32
                and hasattr(torch, "_weight_int8pack_mm"))

    @classmethod
    def for_model(cls, model: "GPT", build: bool = True) -> "_GreedyHead | None":
        """The screen of `model`'s head, kept on the model (so it lives as long as the model)
        until the head changes: another tensor, or an in-place update (its version counter).
        With build=False, only an up-to-date copy already made is returned."""
        weight = model.transformer.wte.weight[: model.config.n_vocab]
        if not cls.usable(weight):
            model.__dict__.pop("_greedy_head", None)
            return None
        key = (weight.data_ptr(), tuple(weight.shape), weight._version)
        cached = model.__dict__.get("_greedy_head")
        if cached is None or cached[0] != key:
            if not build:
                return None
            head = cls(weight)
            cached = model.__dict__["_greedy_head"] = (key, head if head._kernel_within_bound() else None)
        return cached[1]

    def _kernel_within_bound(self, rows: int = 4096) -> bool:
        """Whether torch's int8 kernel rounds as the bound assumes: on the first `rows` rows and
        two random inputs, |out - x_b·(s·q)| <= 2^-7·|x_b·(s·q)| + acc, the exact value in
        float64."""
        q, scale = self.q[:rows], self.scale[:rows]
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            xb = torch.randn(1, q.size(1), generator=g).to(torch.bfloat16)
            try:
                out = torch._weight_int8pack_mm(xb, q, scale)[0].double()
            except RuntimeError:
                return False
            exact = (q.double() @ xb[0].double()) * scale.double()
            tol = 2.0 ** -7 * exact.abs() + self.acc * float(xb.double().abs().sum())
            if not bool(((out - exact).abs() <= tol).all()):
                return False
        return True

    def argmax(self, x: torch.Tensor) -> int | None:
        """x (C,) float32 -> the index of the largest x·w over the rows, or None (see above).
        The bookkeeping is in NumPy, whose calls on a few hundred or thousand numbers cost
        ~1 us against torch's ~5-60 us (nonzero over 50257 flags: ~60 us): at the tiny config
        the int8 product itself is only ~300 us."""
        xn = x.numpy()
        if not np.isfinite(xn).all():
            return None
        xb = x.to(torch.bfloat16)
        out = torch._weight_int8pack_mm(xb.view(1, -1), self.q, self.scale)[0]  # the probe ran it
        lo, hi = torch.aminmax(out)
        top = float(hi)
        xb32 = xb.float().numpy()
        n_xb = float(np.abs(xb32).sum())
        err = (float(np.abs(xn - xb32).sum()) * self.w_max + n_xb * (self.err_w + self.acc)
               + 2.0 ** -7 * max(top, -float(lo)) / (1 - 2.0 ** -7))
        # Rows whose screened logit reaches top - 2·err; the threshold is rounded down to a
        # bfloat16 value so that comparing in bfloat16 loses no row. (An overflow to inf in the
        # product makes err inf or NaN: then there are no candidates, and the answer is None.)
        threshold = float(_to_bf16(torch.tensor(top - 2 * err), up=False))
        cand = np.flatnonzero((out >= threshold).numpy())
        if not 0 < cand.size <= self.MAX_CANDIDATES:
            return None
        rows = self.weight.numpy()[cand].astype(np.float64)
        return int(cand[int(np.argmax(rows @ xn.astype(np.float64)))])


def _to_bf16(values: torch.Tensor, *, up: bool) -> torch.Tensor:
    """float32 values rounded to bfloat16 toward +inf (up) or -inf, not to the nearest: the
    error bounds above need to know which side of a value its bfloat16 lies. NaN stays NaN."""
    b = values.to(torch.bfloat16)
    off = b.float() < values if up else b.float() > values
    return torch.where(off, torch.nextafter(b, torch.tensor(float("inf" if up else "-inf"), dtype=torch.bfloat16)), b)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum, as torch.argmax). On the CPU through NumPy: torch's CPU
    argmax over 50257 columns takes ~90 us, NumPy's vectorized one ~6 us, and a batch-1 decode
    step of the tiny model costs only ~1.2 ms in all."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return torch.argmax(logits, dim=-1)


# ---------------------------------------------------------------------------------------------
# Weights I/O (safetensors + config.json; never pickle)


def _empty_model(config: GPTConfig, device="cpu") -> GPT:
    """A GPT with uninitialized storage, for loading weights into: random init of a large model
    is seconds of CPU time that the loaded weights overwrite anyway."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.lm_head.weight = model.transformer.wte.weight  # re-tie: to_empty made new storage
    return model


def _own_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    # lm_head.weight is wte.weight: save it once, under the embedding's name.
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def save_model(model: GPT, folder: str | Path) -> Path:
    """Write `model.safetensors` and `config.json` into `folder`, each atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = _safetensors_bytes(_own_state_dict(model), metadata={"format": "pt"})
    with atomic_file(folder / WEIGHTS_FILE, "wb") as f:
        f.write(data)
    write_json(folder / CONFIG_FILE, {**model.config.to_dict(), "format": FORMAT, "version": FORMAT_VERSION})
    return folder


def load_config(folder: str | Path) -> GPTConfig:
    path = Path(folder) / CONFIG_FILE
    d = read_json(path, missing=f": not found (a model folder holds {WEIGHTS_FILE} and {CONFIG_FILE})")
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise BadInput(f"{path}: not a gptforge model config (expected \"format\": \"{FORMAT}\")")
    if d.get("version") != FORMAT_VERSION:
        raise BadInput(f"{path}: format version {d.get('version')!r} is not supported (expected {FORMAT_VERSION})")
    d = {k: v for k, v in d.items() if k not in ("format", "version")}
    try:
        return GPTConfig.from_dict(d)
    except BadInput as e:
        raise BadInput(f"{path}: {e}") from None
    except TypeError as e:
        raise BadInput(f"{path}: {e}") from None


def load_model(folder: str | Path, map_location="cpu") -> GPT:
    """Read a folder written by save_model. Any problem is a one-line BadInput naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"model folder not found: {folder}")
    config = load_config(folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise BadInput(f"{path}: not found")
    try:
        state = _load_safetensors(str(path), device=str(map_location))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise BadInput(f"{path}: not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None
    model = _empty_model(config, map_location)
    _load_checked(model, state, path)
    return model


def _load_checked(model: GPT, state: dict[str, torch.Tensor], origin) -> None:
    expected = {k: v.shape for k, v in model.state_dict().items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = ([f"missing tensors {_few(missing)}"] if missing else []) + (
            [f"unexpected tensors {_few(unexpected)}"] if unexpected else [])
        raise BadInput(f"{origin}: {'; '.join(parts)} for a model with config {model.config.to_dict()}")
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(s)})" for k, s in expected.items() if state[k].shape != s]
    if wrong:
        raise BadInput(f"{origin}: wrong tensor shapes: {_few(wrong)}")
    with torch.no_grad():
        model.load_state_dict({**state, "lm_head.weight": state["transformer.wte.weight"]}, strict=True)


def _few(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


# ---------------------------------------------------------------------------------------------
# Hugging Face conversion (transformers imported lazily)

# HF's GPT-2 uses Conv1D, whose weight is (in, out): the transpose of our nn.Linear's (out, in).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_config(config: GPTConfig):
    from transformers import GPT2Config

    eot = EOT_ID if config.n_vocab > EOT_ID else None
    return GPT2Config(
        vocab_size=config.n_vocab, n_positions=config.block_size, n_embd=config.n_embd,
        n_layer=config.n_layer, n_head=config.n_head, n_inner=None, activation_function="gelu_new",
        resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
        layer_norm_epsilon=1e-5, bos_token_id=eot, eos_token_id=eot, tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
    )


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights in the layout of transformers' GPT2LMHeadModel: Conv1D weights transposed,
    vocabulary trimmed to n_vocab rows, zero biases where the model has none (bias=False)."""
    cfg = model.config
    ours = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    wte = ours["transformer.wte.weight"][: cfg.n_vocab].detach().clone()
    out["transformer.wte.weight"] = wte
    out["transformer.wpe.weight"] = ours["transformer.wpe.weight"].detach().clone()
    dims = {"ln_1": cfg.n_embd, "attn.c_attn": 3 * cfg.n_embd, "attn.c_proj": cfg.n_embd, "ln_2": cfg.n_embd,
            "mlp.c_fc": 4 * cfg.n_embd, "mlp.c_proj": cfg.n_embd}
    layers = [f"transformer.h.{i}." for i in range(cfg.n_layer)]
    for prefix in layers:
        for part, dim in dims.items():
            w = ours[f"{prefix}{part}.weight"].detach()
            out[f"{prefix}{part}.weight"] = w.t().contiguous() if f"{part}.weight" in _CONV1D else w.clone()
            b = ours.get(f"{prefix}{part}.bias")
            out[f"{prefix}{part}.bias"] = b.detach().clone() if b is not None else w.new_zeros(dim)
    out["transformer.ln_f.weight"] = ours["transformer.ln_f.weight"].detach().clone()
    b = ours.get("transformer.ln_f.bias")
    out["transformer.ln_f.bias"] = b.detach().clone() if b is not None else wte.new_zeros(cfg.n_embd)
    out["lm_head.weight"] = wte  # tied: the same tensor
    return out


def to_hf(model: GPT):
    """A transformers GPT2LMHeadModel with our weights (eval mode, same device and dtype)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(hf_config(model.config))
    state = hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"transformers' GPT-2 layout changed: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    p = model.transformer.wte.weight
    return hf.to(device=p.device, dtype=p.dtype).eval()


def from_hf(hf_model, attention: str = "sdpa") -> GPT:
    """Our GPT from a transformers GPT2LMHeadModel (vocabulary padded with zero rows to a
    multiple of 64; the padding is masked out of the logits anyway)."""
    c = hf_model.config
    if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise BadInput(f"Hugging Face model uses activation {c.activation_function!r}; GPT-2's tanh GELU is needed")
    if abs(c.layer_norm_epsilon - 1e-5) > 1e-12:
        raise BadInput(f"Hugging Face model uses layer_norm_epsilon={c.layer_norm_epsilon}; 1e-5 is needed")
    if c.n_inner not in (None, 4 * c.n_embd) or getattr(c, "scale_attn_by_inverse_layer_idx", False):
        raise BadInput("Hugging Face model differs from GPT-2's architecture (n_inner or attention scaling)")
    config = GPTConfig(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=c.n_positions,
                       vocab_size=padded_vocab(c.vocab_size), n_vocab=c.vocab_size, dropout=0.0, bias=True,
                       attention=attention)
    hf_state = hf_model.state_dict()
    state = {}
    for k in _empty_model(config, "meta").state_dict():
        if k == "lm_head.weight":
            continue
        if k not in hf_state:
            raise BadInput(f"Hugging Face model has no tensor {k}")
        t = hf_state[k].detach().to(torch.float32) if hf_state[k].is_floating_point() else hf_state[k]
        state[k] = t.t().contiguous() if k.endswith(_CONV1D) else t.clone()
    wte = state["transformer.wte.weight"]
    pad = config.vocab_size - config.n_vocab
    if pad:
        state["transformer.wte.weight"] = torch.cat([wte, wte.new_zeros(pad, config.n_embd)])
    device = hf_model.transformer.wte.weight.device
    model = _empty_model(config, device)
    _load_checked(model, state, "Hugging Face model")
    return model


def from_pretrained(name: str, attention: str = "sdpa", *, param: str = "pretrain.init_from") -> GPT:
    """OpenAI's GPT-2 weights from the Hugging Face hub ("gpt2" ... "gpt2-xl"); `param` is the
    config key the offline message tells the user to change."""
    if name not in HF_PRETRAINED:
        raise BadInput(f"unknown pretrained model {name!r}; choose one of {', '.join(HF_PRETRAINED)}")
    try:
        from transformers import GPT2LMHeadModel

        hf = GPT2LMHeadModel.from_pretrained(name)
    except Exception as e:  # offline, hub errors, missing cache: all the same to the user
        raise SourceUnreachable(
            f"cannot load {name} from the Hugging Face hub ({_reason(e, 160)}); set {param} to a checkpoint folder"
        ) from None
    return from_hf(hf, attention=attention)


def _reason(e: Exception, limit: int) -> str:
    """An exception from transformers as one line of at most `limit` characters."""
    reason = " ".join(f"{type(e).__name__}: {e}".split())
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Where a run's weights start: pretrain.init_from, classify.init_from, instruct.init_from

# What save_pretrained writes (one file, or shards and their index), newest format first.
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")


def load_pretrained(init_from: str, *, param: str, attention: str = "sdpa", missing: str = "") -> tuple[GPT, str]:
    """The GPT that `init_from` names, and a few words saying what it is ("checkpoint DIR"), for
    messages and logs. `init_from` is, in this order:

    - a GPT-2 size on the Hugging Face hub: exactly one of HF_PRETRAINED (transformers' download
      cache). Membership, not a prefix: a folder named `gpt2-run` is a folder, and `./gpt2`
      names a folder called `gpt2`;
    - a folder whose config.json is a gptforge model config (`save_model` output): `load_model`;
    - a folder whose config.json is a Hugging Face one with `"model_type": "gpt2"`
      (`save_pretrained` output, a hub snapshot, `gptforge export` output): read with
      transformers' GPT2LMHeadModel and converted with `from_hf`, as the hub sizes are. Other
      Hugging Face architectures are refused with a one-line BadInput (GPT-2 only, for now).

    `param` is the config key (`pretrain.init_from`) that every error names; `missing` is advice
    put first in the message for a folder that does not exist ("run `gptforge pretrain` first,
    or "). `attention` is the backend of a converted hub / Hugging Face model; a gptforge
    checkpoint keeps the one it was saved with. Raises BadInput (SourceUnreachable when the
    hub cannot be reached).
    """
    if init_from in HF_PRETRAINED:
        return from_pretrained(init_from, attention=attention, param=param), f"hub weights {init_from}"
    folder = Path(init_from)
    if not folder.is_dir():
        raise BadInput(f"{param}: checkpoint folder {folder} not found; {missing}name a GPT-2 size "
                       f"({', '.join(HF_PRETRAINED)}), a gptforge checkpoint folder or a Hugging Face GPT-2 folder")
    hf_type = _hf_model_type(folder / CONFIG_FILE)
    if hf_type is None:
        try:
            return load_model(folder), f"checkpoint {folder}"
        except BadInput as e:
            raise BadInput(f"{param}: {e}") from None
    return _load_hf_gpt2(folder, hf_type, param=param, attention=attention), f"Hugging Face GPT-2 folder {folder}"


def _hf_model_type(path: Path) -> tuple[str, str] | None:
    """(model_type, what to call it) when `path` is a Hugging Face config.json; None for anything
    else (a gptforge config, no file, not JSON: load_model names the file and its problem)."""
    import json

    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(d, dict) or "format" in d or not isinstance(d.get("model_type"), str):
        return None
    archs = d.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    return d["model_type"], ", ".join(archs) or d["model_type"]


def _load_hf_gpt2(folder: Path, hf_type: tuple[str, str], *, param: str, attention: str) -> GPT:
    model_type, arch = hf_type
    config = folder / CONFIG_FILE
    if model_type != "gpt2":
        raise BadInput(f"{param}: {config} is a Hugging Face {arch} config (model_type {model_type!r}); only GPT-2 "
                       "folders (model_type 'gpt2') can be a starting point yet")
    if not any((folder / name).is_file() for name in HF_WEIGHT_FILES):
        raise BadInput(f"{param}: {config} is a Hugging Face {arch} config, but {folder} holds no weights "
                       f"({' or '.join(HF_WEIGHT_FILES[::2])})")
    try:
        from transformers import GPT2LMHeadModel

        # local_files_only: a folder never reaches for the hub, even for a missing file.
        hf, info = GPT2LMHeadModel.from_pretrained(str(folder), local_files_only=True, output_loading_info=True)
    except Exception as e:  # damaged weights, shapes that disagree with config.json, ...
        raise BadInput(f"{param}: cannot read the Hugging Face GPT-2 folder {folder} ({_reason(e, 200)})") from None
    # transformers fills tensors the files lack with random values and only logs it: refuse instead.
    absent = sorted(k for k in info.get("missing_keys", ()) if k != "lm_head.weight")  # the head is tied to wte
    if absent:
        raise BadInput(f"{param}: the Hugging Face GPT-2 folder {folder} lacks tensors {_few(absent)}")
    try:
        return from_hf(hf, attention=attention)
    except BadInput as e:
        raise BadInput(f"{param}: {folder}: {e}") from None
