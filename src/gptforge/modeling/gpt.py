"""GPT-2, the model only: config, KV cache, the modules and the FLOP count.

The architecture and parameter names follow nanoGPT (karpathy/nanoGPT), so its checkpoints and
its reading order carry over: token + position embeddings, pre-LayerNorm blocks
(ln_1 -> attn -> ln_2 -> mlp, tanh-GELU), final ln_f, and an lm_head tied to the token embedding.
`arch: llama` keeps that shape and those names with today's parts (`llama_layers`): no position
embedding but rotary queries and keys, RMSNorm, a SwiGLU MLP (c_fc holds gate and up), grouped-query
attention (c_attn holds q, then n_kv_head keys and values), no biases, an optionally untied head;
`hf_llama` converts it to and from transformers' LlamaForCausalLM.

Vocabulary: the embedding/head has `vocab_size` rows (50304 = GPT-2's 50257 padded to a multiple
of 64, which keeps the head matmul on fast kernel paths); only ids below `n_vocab` are real. The
padded logit columns are set to -inf, so the loss is exactly the cross-entropy over the real
vocabulary and the padded ids can never be sampled.

Around it, each importing this module and never imported by it: `gptforge.modeling.decoding` (KV-cached
generation), `gptforge.modeling.weights` (the checkpoint format: safetensors + config.json) and
`gptforge.modeling.hf_convert` (Hugging Face conversion, hub weights, `init_from`). Only torch is imported
here at module level (and `kernels` inside the Triton attention backend): training runs on a
bare GPU machine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptforge.errors import BadInput
from gptforge.modeling.cpu_gemv import gemv_kernels
from gptforge.modeling.llama_layers import RMSNorm, SwiGLU, repeat_kv, rotary, rotate, swiglu_width

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
    attention: str = (
        "sdpa"  # "math" (reference) | "sdpa" (fused kernels, FlashAttention-2 on CUDA) | "triton" (kernels/)
    )
    # "gpt2" or "llama" (rotary positions, RMSNorm, SwiGLU, grouped-query attention: `llama_layers`).
    # Checkpoints written before the llama keys existed read as gpt2 (`from_dict`).
    arch: str = "gpt2"
    n_kv_head: int | None = None  # key/value heads; None: n_head (resolved in __post_init__)
    rope_theta: float = 10000.0
    ffn_hidden: int | None = None  # the MLP's width; None: 4 n_embd (gpt2), llama_layers.swiglu_width (llama)
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.arch not in ("gpt2", "llama"):
            raise BadInput(f"model config: arch must be 'gpt2' or 'llama', got {self.arch!r}")
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.ffn_hidden is None:
            width = 4 * self.n_embd if self.arch == "gpt2" else swiglu_width(self.n_embd)
            object.__setattr__(self, "ffn_hidden", width)
        if self.arch == "gpt2" and (
            self.n_kv_head != self.n_head or self.ffn_hidden != 4 * self.n_embd or not self.tie_embeddings
        ):
            raise BadInput("model config: gpt2 has n_kv_head = n_head, a 4 n_embd MLP and a tied head")
        for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "n_vocab", "n_kv_head", "ffn_hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BadInput(f"model config: {key} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise BadInput(f"model config: n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise BadInput(f"model config: n_head ({self.n_head}) is not a multiple of n_kv_head ({self.n_kv_head})")
        if self.arch == "llama" and self.head_dim % 2:
            raise BadInput(f"model config: rotary embeddings need an even head size, got {self.head_dim}")
        if self.vocab_size < self.n_vocab:
            raise BadInput(
                f"model config: vocab_size ({self.vocab_size}) is smaller than the tokenizer's "
                f"vocabulary n_vocab ({self.n_vocab})"
            )
        if self.attention not in ("math", "sdpa", "triton"):
            raise BadInput(f"model config: attention must be 'math', 'sdpa' or 'triton', got {self.attention!r}")
        if self.attention == "triton" and self.dropout:
            raise BadInput(
                "model config: attention 'triton' has no attention dropout; set model.dropout to 0 "
                "or use attention 'sdpa'"
            )
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
        missing = [n for n in names if n not in d and n not in _ADDED_WITH_LLAMA]
        if unknown or missing:
            parts = ([f"unknown keys {', '.join(unknown)}"] if unknown else []) + (
                [f"missing keys {', '.join(missing)}"] if missing else []
            )
            raise BadInput(f"model config: {'; '.join(parts)}")
        return cls(**d)

    @classmethod
    def from_model_config(cls, m, n_vocab: int) -> "GPTConfig":
        """From params.yaml's `model` section (config.ModelConfig) and the tokenizer's size."""
        if m.vocab_size < n_vocab:
            raise BadInput(f"model.vocab_size ({m.vocab_size}) is smaller than the tokenizer's vocabulary ({n_vocab})")
        return cls(
            n_layer=m.n_layer,
            n_head=m.n_head,
            n_embd=m.n_embd,
            block_size=m.block_size,
            vocab_size=m.vocab_size,
            n_vocab=n_vocab,
            dropout=m.dropout,
            bias=m.bias if m.bias is not None else m.arch == "gpt2",
            attention=m.attention,
            arch=m.arch,
            n_kv_head=m.n_kv_head,
            rope_theta=m.rope_theta,
            ffn_hidden=m.ffn_hidden,
            norm_eps=m.norm_eps,
            tie_embeddings=m.tie_embeddings,
        )


# Keys a config.json written before the llama architecture lacks: they take their defaults (gpt2's).
_ADDED_WITH_LLAMA = ("arch", "n_kv_head", "rope_theta", "ffn_hidden", "norm_eps", "tie_embeddings")


# ---------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Keys and values of every layer, preallocated as (B, n_head, max_len, head_dim).

    `pos` counts the positions already written. A forward pass writes its T new positions at
    [pos, pos+T) in every layer, attends over [0, pos+T), and then advances `pos` once. Writing
    into a preallocated buffer (rather than torch.cat per step) keeps decoding free of
    allocations that grow with the sequence.
    """

    def __init__(
        self, config: GPTConfig, batch_size: int, max_len: int | None = None, *, device=None, dtype=torch.float32
    ):
        max_len = config.block_size if max_len is None else max_len
        if max_len > config.block_size:
            raise BadInput(f"KV cache of {max_len} positions is longer than model.block_size={config.block_size}")
        # Keys and values of a layer share one (B, 2, n_head, max_len, head_dim) buffer, so that
        # a decode step stores both with a single copy (decoding.Decoder); k and v are views of it.
        shape = (batch_size, 2, config.n_kv_head, max_len, config.head_dim)
        self.kv = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.k = [kv[:, 0] for kv in self.kv]
        self.v = [kv[:, 1] for kv in self.kv]
        self.batch_size = batch_size
        self.max_len = max_len
        self.pos = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's new keys/values at [pos, pos+T); return the views over [0, pos+T)."""
        end = self.pos + k.size(2)
        self.k[layer][:, :, self.pos : end].copy_(k)
        self.v[layer][:, :, self.pos : end].copy_(v)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def reset(self) -> None:
        self.pos = 0


# ---------------------------------------------------------------------------------------------
# Model


class CausalSelfAttention(nn.Module):
    """Causal self-attention over one projection to queries, keys and values. gpt2: as many key/value
    heads as query heads. llama: `n_kv_head` key/value heads each shared by n_head/n_kv_head query
    heads (grouped-query attention), queries and keys rotated by their positions (`rope`)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hd = config.head_dim
        self.c_attn = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * hd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.backend = config.attention

    def forward(self, x, mask=None, kv_cache: KVCache | None = None, layer: int = 0, rope=None):
        """`mask` (T, S) bool, True = may attend; None means plain causal (T == S) or, for a
        single query after a cache prefix, no mask at all (it may see every key). `rope`: the
        (cos, sin) of these T positions (llama), None for gpt2."""
        B, T, C = x.size()
        hd, nkv = C // self.n_head, self.n_kv_head
        q, k, v = self.c_attn(x).split([C, nkv * hd, nkv * hd], dim=2)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, nkv, hd).transpose(1, 2)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)  # (B, nkv, S, hd) with S = pos + T
        S = k.size(2)
        if nkv != self.n_head and self.backend != "sdpa":  # each key/value head serves n_head/nkv queries
            k, v = repeat_kv(k, self.n_head // nkv), repeat_kv(v, self.n_head // nkv)
        if self.backend == "triton":
            y = _triton_attention(q, k, v, mask, kv_cache)
        elif self.backend == "sdpa":
            # is_causal aligns its mask top-left, which is only right when T == S; a chunk after
            # a cache prefix brings its own right-aligned mask, a single query needs none.
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=self.dropout if self.training else 0.0,
                is_causal=mask is None and T == S and T > 1,
                enable_gqa=nkv != self.n_head,
            )
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


def norm(config: GPTConfig) -> nn.Module:
    """The block's and the final normalization: LayerNorm (gpt2) or RMSNorm (llama)."""
    if config.arch == "llama":
        return RMSNorm(config.n_embd, config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias)


class Block(nn.Module):
    """Pre-norm residual block, one for both architectures: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        self.mlp = (
            SwiGLU(config.n_embd, config.ffn_hidden, config.bias, config.dropout)
            if config.arch == "llama"
            else MLP(config)
        )

    def forward(self, x, mask=None, kv_cache=None, layer=0, rope=None):
        x = x + self.attn(self.ln_1(x), mask, kv_cache, layer, rope)
        x = x + self.mlp(self.ln_2(x))
        return x


def _triton_attention(q, k, v, mask, kv_cache) -> torch.Tensor:
    """Our FlashAttention-2 kernel (kernels/flash_attention.py), imported here so that the model
    needs triton only when this backend is chosen. It computes full causal self-attention (T == S);
    cached decoding brings masks and a cache, and `decoding.generate` runs it through sdpa instead."""
    if kv_cache is not None or mask is not None:  # (k, v arrive with as many heads as q: repeat_kv)
        raise BadInput(
            "attention 'triton' computes full causal sequences only (no KV cache, no explicit mask); "
            "generation switches such models to sdpa"
        )
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
    # The module kind to shard (FSDP) or place whole, named as transformers names it for its models.
    _no_split_modules = ["Block"]

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        layers = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))
        if config.arch == "gpt2":  # learned positions; llama rotates queries and keys instead
            layers["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        layers.update(
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=norm(config),
        )
        self.transformer = nn.ModuleDict(layers)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (GPT-2, SmolLM2): one matrix is both the input embedding and the output head.
        if config.tie_embeddings:
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
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    # -- sizes ------------------------------------------------------------------------------

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; `non_embedding` subtracts the position embeddings only (nanoGPT's
        convention): the token embedding stays in because, tied to lm_head, its weights do
        matmul work in every forward pass."""
        n = sum(p.numel() for p in self.parameters())  # the tied matrix is counted once
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        if non_embedding and not self.config.tie_embeddings:  # an untied wte is a lookup, no matmul
            n -= self.transformer.wte.weight.numel()
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
        if "wpe" not in self.transformer:  # rotary positions: nothing to cut
            return
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
            raise BadInput(
                f"sequence of {pos + T} tokens (cache {pos} + {T} new) is longer than "
                f"model.block_size={self.config.block_size}"
            )
        if kv_cache is not None and pos + T > kv_cache.max_len:
            raise BadInput(f"KV cache holds {kv_cache.max_len} positions, {pos + T} needed")
        # A chunk of several queries after a cache prefix needs an explicit right-aligned mask;
        # the math backend needs one for any T > 1. Made once here, shared by every layer.
        mask = None
        if T > 1 and (pos > 0 or self.config.attention == "math"):
            mask = _causal_mask(T, pos + T, idx.device)
        rope = None
        if "wpe" in self.transformer:
            # wpe rows by slicing, not an index tensor: a view, nothing allocated per decode step.
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe.weight[pos : pos + T])
        else:  # llama: the positions' rotations, made once here and shared by every layer
            x = self.transformer.drop(self.transformer.wte(idx))
            rope = rotary(pos, T, self.config.head_dim, self.config.rope_theta, x)
        # (activation checkpointing wraps each block from outside: gptforge.training.parallelize)
        for i, block in enumerate(self.transformer.h):
            x = block(x, mask, kv_cache, i, rope)
        if kv_cache is not None:
            kv_cache.pos = pos + T
        return self.transformer.ln_f(x)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        last_only: bool = False,
    ):
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
                logits[..., self.config.n_vocab :] = float("-inf")
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
        return head_logits(x, self.lm_head.weight[: self.config.n_vocab])


def head_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(B, C) hidden states -> (B, V) logits. At batch 1 a GEMV (`torch.mv`): for GPT-2's
    (50257, 768) head it is ~30% faster on the CPU than the GEMM F.linear picks for a (1, 768)
    input, and decoding reads the head once per token."""
    with gemv_kernels(x.size(0), weight.dtype, weight.device):
        if x.size(0) == 1:
            return torch.mv(weight, x[0]).unsqueeze(0)
        return F.linear(x, weight)
