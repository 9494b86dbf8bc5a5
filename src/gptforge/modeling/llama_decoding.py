"""Lean KV-cached decoding of a transformers Llama-family causal LM (Llama, SmolLM2, Mistral
without a sliding window, Qwen2 with its q/k/v biases): `LlamaDecoder` runs transformers'
modeling_llama operations in the same order (RMSNorm in float32, rotary embeddings from the
model's own `inv_freq`, grouped-query attention, SwiGLU), as straight functional calls over
weights gathered once, into a key/value cache allocated once; `generate_llama` decodes with it
as `decoding.generate_hf` would through transformers' `generate` (same arguments, same stop and
padding rules), and greedy batch-1 decoding on the CPU reads the head through
`greedy_head.GreedyHead`'s exact int8 screen.

Why our own: at batch 1 a 135M model (SmolLM2: 30 layers) is memory-bound, and around each
token's ~300 small operations transformers adds its module tree, a `DynamicCache` that grows by
concatenation, a causal mask built per step and the logits processors: work that is not the
model's. `decoding.Decoder` does the same for gptforge's own GPT. Models it cannot run exactly
(another architecture, a scaled rotary embedding, a sliding window, peft layers, hooks) are
left to transformers: `unsupported(model)` says why.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptforge.errors import BadInput
from gptforge.modeling.cpu_gemv import gemv_kernels
from gptforge.modeling.weight_only import (  # noqa: F401 - Int8Weight, Int4Weight and the linears re-exported
    HEAD_WEIGHTS,
    INT4_GROUP,
    PACKED,
    WEIGHT_FORMATS,
    Int4Weight,
    Int8Weight,
    int4_groups,
    int4_linear,
    int8_linear,
    packing,
    round_linears,
)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def unsupported(model) -> str | None:
    """None when `LlamaDecoder` computes exactly what `model`'s own forward does, else the reason."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model type {kind!r} (the lean decoder runs {', '.join(SUPPORTED_TYPES)})"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rotary scaling {rope.get('rope_type')!r}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", kind == "mistral"):
        return "a sliding-window attention"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        return "no model.layers / lm_head"
    linears = [model.lm_head] + decoder_linears(model)
    if any(type(m) is not nn.Linear for m in linears):
        return "layers that are not plain nn.Linear (peft adapters, quantized layers)"
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "forward hooks"
    return None


def decoder_linears(model) -> list[nn.Linear]:
    """The seven linears of each decoder layer, in order (q, k, v, o, gate, up, down)."""
    return [
        m
        for layer in model.model.layers
        for m in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        )
    ]


def round_weights(model, weights: str) -> None:
    """Each decoder linear's weight replaced, in place, by its int8 or int4 rounding and the head
    by its `HEAD_WEIGHTS` rounding (`weight_only.round_linears`): the model `weights=` decodes
    with, so that transformers' forward over it (serve's prefill) computes what the quantized
    step computes. A head tied to the token embedding gets a rounded copy of its own (the
    embedding's rows stay as they are, as `LlamaLayers` reads them)."""
    round_linears(decoder_linears(model), model, "lm_head", model.model.embed_tokens.weight, weights)


class LlamaLayers:
    """The model's weights, gathered once, and its rotary tables for `max_len` positions: the
    one copy of the block that every lean caller runs (`forward`), each with its own way of
    keeping keys and values (`attend`). `weights="int8"` / `"int4"` keep the seven linears of
    each layer as `Int8Weight`s / `Int4Weight`s and the head in `HEAD_WEIGHTS` (weight-only:
    activations, norms and the embedding stay in the model's dtype), for batch-1 decoding on the
    CPU, where each token reads every weight once (SmolLM2's head alone, 2 cores: 4.2 ms in bf16,
    2.5 in int8, 1.0 in int4). `logits(x)` applies the head."""

    def __init__(self, model, max_len: int, weights: str = "native"):
        cfg = model.config
        inner = model.model
        self.n_head, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.embed = inner.embed_tokens.weight
        self.head = model.lm_head.weight
        linears = [m.weight for m in decoder_linears(model)]
        # what `forward` and `logits` multiply by
        pack, self.linear, self.packed_head, self.head_linear = packing(
            model, linears, self.head, weights, self.embed.dtype
        )
        self.layers = [
            (
                layer.input_layernorm.weight,
                layer.input_layernorm.variance_epsilon,
                pack(a.q_proj.weight),
                a.q_proj.bias,
                pack(a.k_proj.weight),
                a.k_proj.bias,
                pack(a.v_proj.weight),
                a.v_proj.bias,
                pack(a.o_proj.weight),
                a.o_proj.bias,
                layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.variance_epsilon,
                pack(m.gate_proj.weight),
                m.gate_proj.bias,
                pack(m.up_proj.weight),
                m.up_proj.bias,
                pack(m.down_proj.weight),
                m.down_proj.bias,
            )
            for layer in inner.layers
            for a, m in [(layer.self_attn, layer.mlp)]
        ]
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.dtype, self.device = self.embed.dtype, self.embed.device
        # cos/sin of every position, as LlamaRotaryEmbedding computes them (float32, then the
        # model's dtype), once rather than per step.
        rotary = inner.rotary_emb
        positions = torch.arange(max_len, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.to(device=self.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * rotary.attention_scaling).to(self.dtype)
        self.sin = (emb.sin() * rotary.attention_scaling).to(self.dtype)
        self.max_len = max_len

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head over final hidden states x (..., hidden), in the model's dtype."""
        with gemv_kernels(x.numel() // x.size(-1), self.dtype, self.device):
            return self.head_linear(x, self.packed_head, None)

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.size(-1) // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def forward(
        self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, all_positions: bool = False
    ) -> torch.Tensor:
        """ids (B, T); cos/sin broadcastable to (B, heads, T, head_dim) (the positions' rows of
        `self.cos`/`self.sin`); `attend(i, q, k, v)` stores layer i's new keys/values (B,
        kv_heads, T, head_dim) and returns the attention of the queries q (B, heads, T,
        head_dim) over everything the row holds. Returns (B, hidden) final hidden states of the
        last position, or (B, T, hidden) of every position with `all_positions`. One or two
        positions in all take ATen's matrix-vector kernels (`cpu_gemv`)."""
        B, T = ids.shape
        with gemv_kernels(B * T, self.dtype, self.device):
            return self._forward(ids, cos, sin, attend, all_positions)

    def _forward(self, ids, cos, sin, attend, all_positions):
        B, T = ids.shape
        nh, nkv, hd = self.n_head, self.n_kv, self.head_dim
        lin, rms, rotate = self.linear, self._rms, self._rotate
        x = self.embed[ids]  # (B, T, C)
        for i, (n1, e1, qw, qb, kw, kb, vw, vb, ow, ob, n2, e2, gw, gb, uw, ub, dw, db) in enumerate(self.layers):
            h = rms(x, n1, e1)
            q = rotate(lin(h, qw, qb).view(B, T, nh, hd).transpose(1, 2), cos, sin)
            k = rotate(lin(h, kw, kb).view(B, T, nkv, hd).transpose(1, 2), cos, sin)
            y = attend(i, q, k, lin(h, vw, vb).view(B, T, nkv, hd).transpose(1, 2))
            x = x + lin(y.transpose(1, 2).reshape(B, T, nh * hd), ow, ob)
            h = rms(x, n2, e2)
            x = x + lin(F.silu(lin(h, gw, gb)) * lin(h, uw, ub), dw, db)
        return rms(x if all_positions else x[:, -1], *self.norm)


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None):
    """Attention of one query per head, q (B, heads, 1, hd), over keys/values (B, kv_heads, L,
    hd), `mask` None or (B, 1, 1, L) bool (True = attend): the heads that share a key/value
    head become that head's queries, so no key is repeated."""
    B, nh, _, hd = q.shape
    nkv = keys.size(1)
    y = F.scaled_dot_product_attention(q.reshape(B, nkv, nh // nkv, hd), keys, values, attn_mask=mask)
    return y.view(B, nh, 1, hd)


class LlamaDecoder:
    """Rows that share one position (no padding: a prompt batch of equal lengths, as
    `generate_hf` takes it), with keys and values in buffers allocated once: `__call__(ids)`
    takes (B, T) token ids at positions pos..pos+T-1 of each row and returns (B, hidden) final
    hidden states of the last position, (B, T, hidden) of every one with `all_positions` (the
    head is the caller's). `pos` may be moved back (speculative decoding drops rejected tokens):
    the next call overwrites what lay beyond it."""

    def __init__(self, model, batch: int, max_len: int, weights: str = "native"):
        self.weights = w = LlamaLayers(model, max_len, weights)
        self.head, self.logits = w.head, w.logits
        shape = (batch, w.n_kv, max_len, w.head_dim)
        self.keys = [torch.empty(shape, dtype=w.dtype, device=w.device) for _ in w.layers]
        self.values = [torch.empty(shape, dtype=w.dtype, device=w.device) for _ in w.layers]
        self.max_len, self.pos = max_len, 0

    def __call__(self, ids: torch.Tensor, all_positions: bool = False) -> torch.Tensor:
        T = ids.size(1)
        pos, end = self.pos, self.pos + T
        if end > self.max_len:
            raise BadInput(f"the decoder's cache holds {self.max_len} positions, {end} needed")
        group = self.weights.n_head // self.weights.n_kv

        def attend(i, q, k, v):
            self.keys[i][:, :, pos:end] = k
            self.values[i][:, :, pos:end] = v
            keys, values = self.keys[i][:, :, :end], self.values[i][:, :, :end]
            if T == 1:
                return attend_one(q, keys, values)
            mask = None if pos == 0 else torch.ones(T, end, dtype=torch.bool, device=q.device).tril(pos)
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=pos == 0, enable_gqa=group > 1
            )

        x = self.weights.forward(ids, self.weights.cos[pos:end], self.weights.sin[pos:end], attend, all_positions)
        self.pos = end
        return x


@torch.inference_mode()
def generate_llama(
    model,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    eos: list[int],
    pad: int | None,
    weights: str = "native",
    speculate: int = 0,
    stats: dict | None = None,
) -> torch.Tensor:
    """`generate_hf`'s decoding through `LlamaDecoder` (the caller checked `unsupported` and
    the arguments, and seeded torch's global generator): (B, T + n_new), each row stopping at
    any of `eos` (kept), finished rows filled with `pad`, until every row has ended.
    `weights="int8"` / `"int4"`: the layers' linears weight-only quantized (`LlamaLayers`).
    `speculate=K` (one row): prompt-lookup drafts of up to K tokens, each verified by one forward
    (`speculative.speculative_decode`, which counts into `stats`)."""
    from gptforge.modeling.greedy_head import GreedyHead, _argmax
    from gptforge.modeling.speculative import filtered_probs, speculative_decode

    B, T0 = prompt_ids.shape
    device = prompt_ids.device
    decoder = LlamaDecoder(model, B, T0 + max_new_tokens, weights)
    x = decoder(prompt_ids)
    if speculate > 0 and B == 1:
        new = speculative_decode(
            decoder,
            prompt_ids[0].tolist(),
            x,
            max_new_tokens,
            k=speculate,
            temperature=temperature,
            top_k=top_k,
            stop=set(eos),
            stats=stats,
        )
        return torch.cat([prompt_ids, torch.tensor([new], dtype=torch.long, device=device)], dim=1)
    head = decoder.head
    screen = None
    if weights == "native" and temperature == 0 and B == 1 and max_new_tokens >= 16 and GreedyHead.usable(head):
        screen = GreedyHead.for_weight(model, head)
    out = torch.empty(B, T0 + max_new_tokens, dtype=torch.long, device=device)
    out[:, :T0] = prompt_ids
    stop = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
    done = torch.zeros(B, dtype=torch.bool, device=device)
    fill = pad if pad is not None else (eos[0] if eos else 0)
    n = T0
    for _ in range(max_new_tokens):
        best = screen.argmax(x[0].float()) if screen is not None else None
        if best is not None:
            nxt = torch.tensor([best], device=device)
        else:
            logits = decoder.logits(x).float()
            if temperature == 0:
                nxt = _argmax(logits)
            else:
                nxt = torch.multinomial(filtered_probs(logits, temperature, top_k), 1).squeeze(1)
        nxt = torch.where(done, fill, nxt)
        out[:, n] = nxt
        n += 1
        if stop is not None:
            done |= torch.isin(nxt, stop)
            if bool(done.all()):
                break
        if n == T0 + max_new_tokens:
            break
        x = decoder(nxt.view(B, 1))
    return out[:, :n]
