"""The model side of `gptforge serve` for gptforge GPTs: rows of one batch, one per running
request, each with its keys/values in its own slot of one preallocated buffer of `max_batch`
slots. The scheduler (`serve.scheduler`) owns the jobs and decides what runs; a backend holds
the rows' keys/values in the scheduler's row order. `serve.hf_backend` is the same interface for
transformers models:

- `open_row(prefix)`: a new row, holding the prefix cache's blocks (`read_blocks` copies) when
  given;
- `forward(segments)`: each (row, tokens) segment appended to its row at the row's own
  position, all in one pass; next-token logits after each segment. A decode step is a segment
  of one token per row; a prompt (or a chunk of it) is a longer one, beside them;
- `keep(rows)`: rows that stay, moved down in order, so the live rows are slots 0..B-1;
- `decode_greedy(token)`: one greedy row through `GreedyHead`'s exact int8 screen.

A step where every row decodes one token is `decoding.Decoder`'s functional step with a
position per row (`_decode_ragged`: the new key/value lands at each row's own position, and
attention sees, per row, only the keys up to it; rows of equal length need no mask). A step
with prompt segments (`_mixed`) runs the same operations over the step's tokens laid end to end
(varlen): the linear layers and norms over all of them at once, attention per segment (the
one-token segments together, as in a decode step; each prompt chunk against its row's keys,
causally from its offset).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gptforge.errors import BadInput
from gptforge.modeling.decoding import Decoder, GreedyHead, gpt2_block
from gptforge.modeling.gpt import GPT, KVCache
from gptforge.serve.backend import Backend


class GPTBackend(Backend):
    """Rows of gptforge GPT decoding, each in its own slot of one KV buffer."""

    def __init__(self, model: GPT, max_batch: int, weights: str = "native"):
        if not Decoder.supports(model):
            raise BadInput(
                "the served model has adapter or hooked layers; serve a merged checkpoint "
                "(checkpoints/instruct/final is one)"
            )
        model.eval()
        cfg = model.config
        self.model, self.config = model, cfg
        self.context = cfg.block_size
        self.max_batch = max_batch
        device, dtype = model.transformer.wte.weight.device, model.transformer.wte.weight.dtype
        self.cache = KVCache(cfg, max_batch, cfg.block_size, device=device, dtype=dtype)
        self.step = Decoder(model, self.cache, weights)  # its weights, gathered once (int8/int4: packed)
        self.head = model.lm_head.weight[: cfg.n_vocab]
        self.weights = weights
        # one greedy row: generate's exact int8 screen of the float32 head (not of a packed one)
        self.screen = GreedyHead.for_model(model) if weights == "native" else None
        self.positions: list[int] = []  # per live row: positions written so far
        self.device = device

    @property
    def rows(self) -> int:
        return len(self.positions)

    def open_row(self, prefix: list[torch.Tensor] | None = None) -> None:
        """A new last row; with `prefix` (blocks from `read_blocks`), holding their keys/values."""
        row = self.rows
        if row >= self.max_batch:
            raise RuntimeError("no free slot")  # the scheduler never asks for more than max_batch
        n = 0
        for block in prefix or ():
            size = block.size(3)
            for layer, kv in enumerate(self.cache.kv):
                kv[row, :, :, n : n + size].copy_(block[layer])
            n += size
        self.positions.append(n)

    def read_blocks(self, row: int, start: int, end: int, block_size: int) -> list[torch.Tensor]:
        """Copies of `row`'s keys/values of blocks [start, end), each (n_layer, 2, n_head,
        block_size, head_dim)."""
        return [
            torch.stack([kv[row, :, :, b * block_size : (b + 1) * block_size] for kv in self.cache.kv])
            for b in range(start, end)
        ]

    @torch.inference_mode()
    def forward(self, segments: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Append each segment's tokens to its row; (segments, n_vocab) logits after each."""
        for row, tokens in segments:
            if self.positions[row] + len(tokens) > self.context:
                raise BadInput(
                    f"row {row}: {self.positions[row] + len(tokens)} positions, the model holds {self.context}"
                )
        if len(segments) == self.rows and all(len(t) == 1 and r == i for i, (r, t) in enumerate(segments)):
            return self.logits(self._hidden([t[0] for _, t in segments]))
        return self.logits(self._mixed(segments))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C) hidden states -> (B, n_vocab) logits (a transposed view), as head @ x.T.

        `model.head_logits` (F.linear, or torch.mv for one row) is the plain form of the same
        product. On this project's 2-core CPU (2026-11-23), against the tiny model's 50257 x 128
        head, MKL took 4.7 ms for one row through either, 9.3 ms for two rows and 7.5 ms for 16
        through F.linear, but 1.9 ms for two rows and 4.2 ms for 16 written head @ x.T, and
        2.1 ms for one row computed as two (benchmarks/bench_head.py, medians of 50). So one
        row is computed as two."""
        if self.weights != "native":  # the packed head
            return self.step.logits(x)
        rows = x.size(0)
        if rows == 1:
            x = torch.cat([x, x])
        return torch.mm(self.head, x.t()).t()[:rows]

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (ascending), in that order, as rows 0..len(rows)-1."""
        for new, old in enumerate(rows):
            if new != old:
                n = self.positions[old]
                for kv in self.cache.kv:
                    kv[new, :, :, :n].copy_(kv[old, :, :, :n])
        self.positions = [self.positions[r] for r in rows]

    @torch.inference_mode()
    def decode_greedy(self, token: int) -> int:
        """One row, greedy: its next token through `GreedyHead`'s int8 screen of the head (the
        exact argmax, as `decoding.generate` finds it at batch 1), or the full head when the
        screen cannot decide."""
        x = self._hidden([token])
        best = self.screen.argmax(x[0]) if self.screen is not None else None
        return best if best is not None else int(self.logits(x)[0].argmax())

    def _hidden(self, tokens: list[int]) -> torch.Tensor:
        B = self.rows
        if len(set(self.positions)) == 1:  # rows of one length: the batch-1 path, no mask
            self.cache.pos = self.positions[0]
            x = _decode_rows(self.step, torch.tensor(tokens, device=self.device), B)
        else:
            x = self._decode_ragged(torch.tensor(tokens, device=self.device))
        self.positions = [p + 1 for p in self.positions]
        return x

    def _decode_ragged(self, tok: torch.Tensor) -> torch.Tensor:
        """`Decoder.__call__` with a position per row: the same operations, in the same order,
        plus the per-row write of the new key/value and a key mask per row."""
        step, B = self.step, tok.size(0)
        C, nh, hd = step.n_embd, step.n_head, step.head_dim
        pos = torch.tensor(self.positions, device=self.device)
        span = int(pos.max()) + 1
        rows = torch.arange(B, device=self.device)
        mask = (torch.arange(span, device=self.device)[None, :] <= pos[:, None]).view(B, 1, 1, span)

        def attend(qkv: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            qkv = qkv.view(B, 3, nh, 1, hd)
            kv[rows, :, :, pos] = qkv[:, 1:, :, 0]
            k, v = kv[:B, 0, :, :span], kv[:B, 1, :, :span]
            return _attend(step, qkv[:, 0], k, v, mask).view(B, 1, C)

        x = (step.wte[tok] + step.wpe[pos]).view(B, 1, C)
        for w, kv in zip(step.layers, self.cache.kv):
            x = gpt2_block(x, w, lambda qkv, kv=kv: attend(qkv, kv), step.linear)
        return F.layer_norm(x.view(B, C), (C,), *step.ln_f)

    def _mixed(self, segments: list[tuple[int, list[int]]]) -> torch.Tensor:
        """The segments' tokens end to end through every layer (the module's docstring); the
        final hidden state of each segment's last token, (segments, C)."""
        step, dev = self.step, self.device
        C, nh, hd = step.n_embd, step.n_head, step.head_dim
        rows_t, pos_t, toks, ends = [], [], [], []
        singles, chunks = [], []  # one-token segments (index in the token list, row, position); prompt chunks
        for row, tokens in segments:
            p0, n, at = self.positions[row], len(tokens), len(toks)
            rows_t += [row] * n
            pos_t += range(p0, p0 + n)
            toks += tokens
            ends.append(at + n - 1)
            if n == 1:
                singles.append((at, row, p0))
            else:
                mask = torch.arange(p0 + n, device=dev)[None, :] <= torch.arange(p0, p0 + n, device=dev)[:, None]
                chunks.append((at, n, row, p0 + n, mask))
            self.positions[row] = p0 + n
        T = len(toks)
        rows_i, pos_i = torch.tensor(rows_t, device=dev), torch.tensor(pos_t, device=dev)
        if singles:
            s_at = torch.tensor([a for a, _, _ in singles], device=dev)
            s_rows = [r for _, r, _ in singles]
            s_pos = torch.tensor([p for _, _, p in singles], device=dev)
            s_span = int(s_pos.max()) + 1
            s_mask = (torch.arange(s_span, device=dev)[None, :] <= s_pos[:, None]).view(len(singles), 1, 1, s_span)
            s_index = torch.tensor(s_rows, device=dev)
            s_slice = s_rows == list(range(len(s_rows)))  # rows 0..k-1: a view instead of a gather

        def attend(qkv: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            qkv = qkv.view(T, 3, nh, hd)
            kv[rows_i, :, :, pos_i] = qkv[:, 1:]
            y = torch.empty(T, nh, hd, device=dev, dtype=qkv.dtype)
            if singles:
                kvs = kv[: len(s_rows), :, :, :s_span] if s_slice else kv[s_index, :, :, :s_span]
                q = qkv[s_at, 0].unsqueeze(2)  # (S, nh, 1, hd)
                y[s_at] = _attend(step, q, kvs[:, 0], kvs[:, 1], s_mask).squeeze(2)
            for at, n, row, end, mask in chunks:
                q = qkv[at : at + n, 0].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
                k, v = kv[row : row + 1, 0, :, :end], kv[row : row + 1, 1, :, :end]
                y[at : at + n] = _attend(step, q, k, v, mask).squeeze(0).transpose(0, 1)
            return y.view(T, C)

        x = step.wte[torch.tensor(toks, device=dev)] + step.wpe[pos_i]  # (T, C)
        for w, kv in zip(step.layers, self.cache.kv):
            x = gpt2_block(x, w, lambda qkv, kv=kv: attend(qkv, kv), step.linear)
        return F.layer_norm(x[ends], (C,), *step.ln_f)


def _attend(step: Decoder, q, k, v, mask) -> torch.Tensor:
    """Attention of `q` over `k`/`v` where `mask` is True, as the Decoder computes it (its math
    form for models configured `attention: math`, else SDPA)."""
    if step.math:
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(step.head_dim))
        return F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _decode_rows(step: Decoder, tok: torch.Tensor, B: int) -> torch.Tensor:
    """The Decoder step over the first B slots of its cache (it reads `cache.kv[i][:B]` by
    running on a (B,) token vector: the buffer's extra slots are sliced off here)."""
    cache = step.cache
    full = cache.kv
    cache.kv = [kv[:B] for kv in full]
    try:
        return step(tok)
    finally:
        cache.kv = full
