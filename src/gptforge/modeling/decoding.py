"""KV-cached decoding of a `gptforge.modeling.gpt.GPT`: `generate` (greedy, temperature, top-k, stop at
end-of-text) and the lean batch-1 decode step (`Decoder`, whose block `gpt2_block` serve's ragged
and mixed batches run too, each with its own attention), greedy tokens through the exact int8
screen of the head (`greedy_head.GreedyHead`, re-exported here); and `generate_hf`, the same
decoding choices for a Hugging Face causal LM: Llama-family models through the lean decoder of
`llama_decoding`, others through transformers' own `generate`. It imports the model from
`gptforge.modeling.gpt` (and torch, `gptforge.errors`, `greedy_head`; `hf_causal` and
`llama_decoding` inside `generate_hf`); the model never imports it, and neither do the weights or
conversion modules.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptforge.errors import BadInput
from gptforge.modeling.cpu_gemv import gemv_kernels
from gptforge.modeling.gpt import GPT, CausalSelfAttention, KVCache, head_logits
from gptforge.modeling.greedy_head import GreedyHead, _argmax, to_bf16  # noqa: F401 - re-exported

# Decoding settings a Hugging Face model's generation_config.json may hold (Qwen2.5-Instruct: top_p
# 0.8, repetition_penalty 1.05) and `generate_hf` sets to transformers' neutral values: there, as
# for our GPT, temperature and top-k are the whole recipe.
_HF_NEUTRAL = dict(
    num_beams=1,
    top_p=1.0,
    typical_p=1.0,
    epsilon_cutoff=0.0,
    eta_cutoff=0.0,
    repetition_penalty=1.0,
    no_repeat_ngram_size=0,
)


def gpt2_block(x: torch.Tensor, w: tuple, attend, linear=F.linear) -> torch.Tensor:
    """One GPT-2 block as functional calls over its 14 weights `w` (a `Decoder.layers` entry), in
    `Block.forward`'s order: ln_1, the q/k/v projection, `attend(qkv)` -> the heads' output in x's
    shape, the output projection and residual, ln_2, the tanh-GELU MLP and residual. The one copy
    of the block that every lean caller runs (`Decoder`, serve's ragged and mixed batches), each
    with its own `attend`: where its keys and values go and how its rows are masked. `linear`:
    F.linear, or `Decoder.linear` (its weight-only int8 / int4 product)."""
    l1w, l1b, eps1, aw, ab, pw, pb, l2w, l2b, eps2, fw, fb, mw, mb = w
    shape = (x.size(-1),)
    qkv = linear(F.layer_norm(x, shape, l1w, l1b, eps1), aw, ab)
    x = x + linear(attend(qkv), pw, pb)
    return x + linear(F.gelu(linear(F.layer_norm(x, shape, l2w, l2b, eps2), fw, fb), approximate="tanh"), mw, mb)


class Decoder:
    """One decode step (a single new position per row, through the KV cache) of `model`, with
    the same tensor operations as `GPT.hidden_states` in the same order, so it gives the same
    hidden states (tests/test_generate.py checks it bitwise), minus the framework around them.

    At batch 1 a decode step of the tiny config is ~60 small operations of a few microseconds
    each plus the head's matrix-vector product; run through the nn.Module tree, the Python
    around those operations (module calls, hooks checks, shape bookkeeping, masks) costs about
    as much again. Here the weights are gathered once per `generate` call and each layer is a
    straight run of functional calls; K and V are stored with one copy (KVCache.kv). In bf16 on
    the CPU, one or two rows take ATen's matrix-vector kernels (`cpu_gemv`).
    """

    def __init__(self, model: GPT, cache: KVCache, weights: str = "native"):
        from gptforge.modeling.weight_only import packing

        cfg = model.config
        tr = model.transformer
        self.cache = cache
        self.n_embd, self.n_head, self.head_dim = cfg.n_embd, cfg.n_head, cfg.head_dim
        self.math = cfg.attention == "math"  # triton models decode with sdpa (see generate)
        self.head = model.lm_head.weight[: cfg.n_vocab]
        linears = [m.weight for b in tr.h for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]
        # what the block and `logits` multiply by
        pack, self.linear, self.packed_head, self.head_linear = packing(
            model, linears, self.head, weights, tr.wte.weight.dtype
        )

        self.layers = [
            (
                b.ln_1.weight,
                b.ln_1.bias,
                b.ln_1.eps,
                pack(b.attn.c_attn.weight),
                b.attn.c_attn.bias,
                pack(b.attn.c_proj.weight),
                b.attn.c_proj.bias,
                b.ln_2.weight,
                b.ln_2.bias,
                b.ln_2.eps,
                pack(b.mlp.c_fc.weight),
                b.mlp.c_fc.bias,
                pack(b.mlp.c_proj.weight),
                b.mlp.c_proj.bias,
            )
            for b in tr.h
        ]
        self.wte, self.wpe = tr.wte.weight, tr.wpe.weight
        self.ln_f = (tr.ln_f.weight, tr.ln_f.bias, tr.ln_f.eps)
        self.weights = weights

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, n_embd) final hidden states -> (B, n_vocab) logits: `head_logits`, or the head in
        `HEAD_WEIGHTS` when the layers are packed."""
        if self.weights == "native":
            return head_logits(x, self.head)
        with gemv_kernels(x.size(0), x.dtype, x.device):
            return self.head_linear(x, self.packed_head, None)

    @staticmethod
    def supports(model: GPT) -> bool:
        """Whether the functional step computes what the modules would: every layer it reads is
        a plain nn.Linear / nn.LayerNorm (not, say, a peft LoRA layer that adds its adapter in
        forward) and no module has hooks. Otherwise generate decodes through the modules."""
        tr = model.transformer
        if model.config.arch != "gpt2":  # llama decodes through the modules (rotary, grouped kv heads)
            return False
        linears = [m for b in tr.h for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]
        norms = [m for b in tr.h for m in (b.ln_1, b.ln_2)] + [tr.ln_f]
        if any(type(m) is not nn.Linear for m in linears) or any(type(m) is not nn.LayerNorm for m in norms):
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T), the first T positions, into the cache at once -> (B, n_embd) final hidden
        states of the last one: the prompt of a packed-weights decode (`generate(weights=...)`),
        whose every product must be the packed one."""
        B, T = ids.shape
        C, nh, hd = self.n_embd, self.n_head, self.head_dim
        if T > self.cache.max_len:
            raise BadInput(f"KV cache holds {self.cache.max_len} positions, {T} needed")

        def attend(qkv: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            qkv = qkv.view(B, T, 3, nh, hd).permute(0, 2, 3, 1, 4)  # (B, 3, nh, T, hd)
            kv[:, :, :, :T] = qkv[:, 1:]
            y = F.scaled_dot_product_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], is_causal=True)
            return y.transpose(1, 2).reshape(B, T, C)

        with gemv_kernels(B * T, self.wte.dtype, self.wte.device):
            x = self.wte[ids] + self.wpe[:T]
            for w, kv in zip(self.layers, self.cache.kv):
                x = gpt2_block(x, w, lambda qkv, kv=kv: attend(qkv, kv), self.linear)
        self.cache.pos = T
        return F.layer_norm(x[:, -1], (C,), *self.ln_f)

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        """tok (B,) int64, the token at position cache.pos -> (B, n_embd) final hidden states,
        whose product with the head gives the next token's logits."""
        cache = self.cache
        pos = cache.pos
        if pos + 1 > cache.max_len:
            raise BadInput(f"KV cache holds {cache.max_len} positions, {pos + 1} needed")
        B, C, nh, hd = tok.size(0), self.n_embd, self.n_head, self.head_dim

        def attend(qkv: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            qkv = qkv.view(B, 3, nh, 1, hd)
            kv[:, :, :, pos : pos + 1] = qkv[:, 1:]
            k, v = kv[:, 0, :, : pos + 1], kv[:, 1, :, : pos + 1]  # (B, nh, pos + 1, hd)
            q = qkv[:, 0]  # (B, nh, 1, hd)
            if self.math:
                y = F.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)), dim=-1) @ v
            else:
                y = F.scaled_dot_product_attention(q, k, v)
            return y.view(B, 1, C)

        with gemv_kernels(B, self.wte.dtype, self.wte.device):
            x = (self.wte[tok] + self.wpe[pos : pos + 1]).view(B, 1, C)
            for w, kv in zip(self.layers, cache.kv):
                x = gpt2_block(x, w, lambda qkv, kv=kv: attend(qkv, kv), self.linear)
        cache.pos = pos + 1
        return F.layer_norm(x.view(B, C), (C,), *self.ln_f)


@torch.inference_mode()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    eot_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    weights: str = "native",
) -> torch.Tensor:
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

    `weights="int8"` / `"int4"`: the prompt and every step through `Decoder`'s weight-only int8 /
    groupwise int4 linears and int8 head (`weight_only`), within the model's context (no crop),
    for a plain GPT-2 checkpoint; fewer bytes a token, no longer the model's own tokens.
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
        if weights != "native":
            if not Decoder.supports(model):
                raise BadInput(f"{weights} weights decode plain GPT-2 checkpoints (no adapters or hooks)")
            if T0 + max_new_tokens > block:
                raise BadInput(
                    f"{weights} weights decode within the model's context: {T0} prompt + {max_new_tokens} "
                    f"new tokens > block_size {block}"
                )
        cache = None
        if use_cache and T0 < block:
            dtype = model.transformer.wte.weight.dtype
            cache = KVCache(cfg, B, min(block, T0 + max_new_tokens), device=idx.device, dtype=dtype)
        done = torch.zeros(B, dtype=torch.bool, device=idx.device) if eot_id is not None else None
        if top_k is not None:
            top_k = min(top_k, cfg.n_vocab)
        head = model.lm_head.weight[: cfg.n_vocab]
        # Not under autocast: there the full head's logits are bfloat16, not float32. A new
        # int8 copy costs about what 10 tokens save: not made for fewer new tokens than that.
        screen = (
            GreedyHead.for_model(model, build=max_new_tokens >= 16)
            if temperature == 0 and B == 1 and weights == "native" and not torch.is_autocast_enabled(idx.device.type)
            else None
        )
        n = T0
        step = Decoder(model, cache, weights) if cache is not None and Decoder.supports(model) else None
        logits_of = step.logits if step is not None else (lambda h: head_logits(h, head))
        if weights != "native":
            x = step.prefill(out[:, :n])
        else:
            x = model.hidden_states(out[:, max(0, n - block) : n], cache)[:, -1, :]
        if step is None and cache is not None:

            def step(tok):
                return model.hidden_states(tok.view(-1, 1), cache)[:, -1, :]

        for _ in range(max_new_tokens):
            best = screen.argmax(x[0]) if screen is not None else None
            if best is not None:
                nxt = torch.tensor([best], device=idx.device)
            elif temperature == 0:
                nxt = _argmax(logits_of(x).float())
            else:
                logits = logits_of(x).float() / temperature
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
                x = model.hidden_states(out[:, max(0, n - block) : n])[:, -1, :]
        return out[:, :n]
    finally:
        for m in swapped:
            m.backend = "triton"
        model.train(was_training)


@torch.inference_mode()
def generate_hf(
    model,
    tokenizer,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[int] | None = None,
    lean: bool = True,
    quantize: str | None = None,
    speculate: int = 0,
    stats: dict | None = None,
) -> torch.Tensor:
    """`generate` for a transformers causal LM (`hf_causal.load_causal_lm`), through its own
    `model.generate`: continue `prompt_ids` (B, T) on the model's device by up to
    `max_new_tokens`; returns (B, T + n_new), the stop token kept as `generate` keeps eot.

    The same choices as `generate`: temperature 0 is greedy, otherwise sampling at `temperature`
    from the `top_k` most likely tokens (None: all). The model's generation_config.json may add
    top_p, a repetition penalty and the like: those are set to their neutral values, so what
    decodes is exactly what the arguments say. Generation stops at any of `stop` (default: the
    tokenizer's and the model's eos ids, `hf_causal.stop_ids`; an empty list leaves it to the
    model's generation_config); finished rows of a batch are
    padded with the tokenizer's pad id. transformers samples with torch's global generator:
    `seed` seeds it (it is left alone when None).

    Llama-family models (`llama_decoding.unsupported` is None) decode through gptforge's lean
    decoder with the same choices (`lean=False` forces transformers' own `generate`): the same
    greedy tokens, faster at batch 1 (benchmarks/bench_generate_hf.py). `quantize="int8"` /
    `"int4"` runs that decoder with weight-only int8 / groupwise int4 linears
    (`llama_decoding.Int8Weight`, `Int4Weight`): lighter weights
    for a memory-bound step, no longer the same tokens as the model's own dtype; a model the lean
    decoder cannot run is refused (BadInput) rather than silently left unquantized.
    `speculate=K` (one prompt, lean decoder): draft-free speculative decoding with prompt-lookup
    drafts of up to K tokens (`speculative`: greedy's tokens, sampling's distribution), counting
    drafted and accepted tokens into `stats`.
    """
    from gptforge.modeling.hf_causal import stop_ids
    from gptforge.modeling.llama_decoding import PACKED, generate_llama, unsupported

    if prompt_ids.dim() != 2 or prompt_ids.size(1) == 0:
        raise BadInput(
            f"generate needs a (batch, tokens) prompt of at least one token, got shape {tuple(prompt_ids.shape)}"
        )
    if temperature < 0:
        raise BadInput(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise BadInput(f"top_k must be a positive integer, got {top_k}")
    reason = unsupported(model) if lean else "lean=False"
    if quantize is not None:
        if quantize not in PACKED:
            raise BadInput(f"quantize: expected {', '.join(PACKED)} or none, got {quantize!r}")
        if reason is not None:
            raise BadInput(
                f"quantize {quantize} runs in gptforge's lean Llama-family decoder, which cannot run this "
                f"model: {reason}"
            )
    if speculate < 0:
        raise BadInput(f"speculate must be >= 0 (0 = off), got {speculate}")
    if speculate and (reason is not None or prompt_ids.size(0) != 1):
        why = reason if reason is not None else f"{prompt_ids.size(0)} prompts at once"
        raise BadInput(
            f"speculative decoding runs in gptforge's lean Llama-family decoder, one prompt at a time: {why}"
        )
    if max_new_tokens <= 0:
        return prompt_ids
    eos = stop if stop is not None else stop_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    if temperature == 0:  # sampling settings at transformers' defaults: no "unused flag" warnings
        sampling = dict(do_sample=False, temperature=1.0, top_k=50)
    else:
        sampling = dict(do_sample=True, temperature=temperature, top_k=top_k or 0)  # 0: no cut
    if seed is not None:
        torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        if reason is None:
            return generate_llama(
                model,
                prompt_ids,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                eos=eos,
                pad=pad,
                weights=quantize or "native",
                speculate=speculate,
                stats=stats,
            )
        return model.generate(
            input_ids=prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=pad,
            **sampling,
            **_HF_NEUTRAL,
        )
    finally:
        model.train(was_training)
