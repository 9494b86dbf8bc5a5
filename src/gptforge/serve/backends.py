"""The model side of continuous batching: a batch of rows, one per running request, that grows
by a prefilled prompt (`add`), advances every row by one token per step (`decode`) and drops
finished rows (`keep`), each returning next-token logits. The scheduler (`serve.engine`) owns
the requests and decides what runs; a backend only holds the key/value caches of the rows, in
the scheduler's row order.

- `GPTBackend` (gptforge's GPT): one preallocated KV buffer of `max_batch` slots, each row at
  its own position. A decode step is `decoding.Decoder`'s functional step with a position per
  row: the new key/value lands at each row's own position, and attention sees, per row, only
  the keys up to it (a boolean mask; rows of equal length need none). Dropping rows moves the
  kept ones down, in order, so the live rows are always slots 0..B-1.
- `HFBackend` (any transformers causal LM): transformers' `DynamicCache`, left-padded. A new
  request is prefilled alone, then its cache is padded on the left to the batch's length (or the
  batch's to its own) and concatenated along the batch; an attention mask marks the padding and
  explicit position ids keep each row's positions its own (rotary keys are stored already
  rotated, so where a key sits in the buffer does not matter). Columns that every row pads are
  cut off when rows leave. This is continuous batching through transformers' own cache class,
  not a padded batch that waits for its slowest row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gptforge.errors import BadInput
from gptforge.modeling.decoding import Decoder, GreedyHead
from gptforge.modeling.gpt import GPT, KVCache


class SlotCache(KVCache):
    """A `KVCache` over one slot (row) of `GPTBackend`'s shared buffer, so that the model's own
    `hidden_states` prefills a prompt straight into that slot."""

    def __init__(self, kv_rows: list[torch.Tensor], max_len: int):  # noqa: D107 (views, no allocation)
        self.kv = kv_rows
        self.k = [kv[:, 0] for kv in kv_rows]
        self.v = [kv[:, 1] for kv in kv_rows]
        self.batch_size = 1
        self.max_len = max_len
        self.pos = 0


class GPTBackend:
    """Rows of gptforge GPT decoding, each in its own slot of one KV buffer."""

    def __init__(self, model: GPT, max_batch: int):
        if not Decoder.supports(model):
            raise BadInput("the served model has adapter or hooked layers; serve a merged checkpoint "
                           "(checkpoints/instruct/final is one)")
        model.eval()
        cfg = model.config
        self.model, self.config = model, cfg
        self.context = cfg.block_size
        self.max_batch = max_batch
        device, dtype = model.transformer.wte.weight.device, model.transformer.wte.weight.dtype
        self.cache = KVCache(cfg, max_batch, cfg.block_size, device=device, dtype=dtype)
        self.step = Decoder(model, self.cache)  # its weights, gathered once
        self.head = model.transformer.wte.weight[: cfg.n_vocab]
        self.screen = GreedyHead.for_model(model)  # one greedy row: generate's exact int8 screen
        self.positions: list[int] = []  # per live row: positions written so far
        self.device = device

    @property
    def rows(self) -> int:
        return len(self.positions)

    @torch.inference_mode()
    def add(self, ids: list[int]) -> torch.Tensor:
        """Prefill `ids` into the next free slot; returns its next-token logits (n_vocab,)."""
        row = self.rows
        if row >= self.max_batch:
            raise RuntimeError("no free slot")  # the scheduler never asks for more than max_batch
        slot = SlotCache([kv[row:row + 1] for kv in self.cache.kv], self.context)
        idx = torch.tensor([ids], device=self.device)
        x = self.model.hidden_states(idx, slot)[:, -1, :]
        self.positions.append(len(ids))
        return self.logits(x)[0]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C) hidden states -> (B, n_vocab) logits (a transposed view), as head @ x.T.

        `model.head_logits` (F.linear, or torch.mv for one row) is the plain form of the same
        product. On this project's 2-core CPU (2026-11-23), against the tiny model's 50257 x 128
        head, MKL took 4.7 ms for one row through either, 9.3 ms for two rows and 7.5 ms for 16
        through F.linear, but 1.9 ms for two rows and 4.2 ms for 16 written head @ x.T, and
        2.1 ms for one row computed as two (benchmarks/bench_head.py, medians of 50). So one
        row is computed as two."""
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
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Each row's next token in -> (rows, n_vocab) logits of the token after it."""
        return self.logits(self._hidden(tokens))

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
        shape, lin, ln = (C,), F.linear, F.layer_norm
        x = (step.wte[tok] + step.wpe[pos]).view(B, 1, C)
        for i, (l1w, l1b, eps1, aw, ab, pw, pb, l2w, l2b, eps2, fw, fb, mw, mb) in enumerate(step.layers):
            qkv = lin(ln(x, shape, l1w, l1b, eps1), aw, ab).view(B, 3, nh, 1, hd)
            kv = self.cache.kv[i]
            kv[rows, :, :, pos] = qkv[:, 1:, :, 0]
            k, v = kv[:B, 0, :, :span], kv[:B, 1, :, :span]
            q = qkv[:, 0]
            if step.math:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
                y = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + lin(y.view(B, 1, C), pw, pb)
            x = x + lin(F.gelu(lin(ln(x, shape, l2w, l2b, eps2), fw, fb), approximate="tanh"), mw, mb)
        return ln(x.view(B, C), shape, *step.ln_f)


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


class HFBackend:
    """Rows of a transformers causal LM, in one left-padded `DynamicCache`."""

    def __init__(self, model, max_batch: int, context: int):
        model.eval()
        self.model, self.max_batch, self.context = model, max_batch, context
        self.device = next(model.parameters()).device
        self.cache = None  # DynamicCache of the live rows
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # (rows, columns) 1 = real
        self.next_pos: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.next_pos)

    @torch.inference_mode()
    def add(self, ids: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        idx = torch.tensor([ids], device=self.device)
        own = DynamicCache(config=self.model.config)
        out = self.model(input_ids=idx, attention_mask=torch.ones_like(idx), past_key_values=own, use_cache=True,
                         logits_to_keep=1)
        own_mask = torch.ones(1, len(ids), dtype=torch.long, device=self.device)
        if self.cache is None or self.rows == 0:
            self.cache, self.mask = own, own_mask
        else:
            width = max(self.mask.size(1), len(ids))
            self._pad_left(self.cache, width - self.mask.size(1))
            self._pad_left(own, width - len(ids))
            for mine, theirs in zip(_layers(self.cache), _layers(own)):
                mine.keys = torch.cat([mine.keys, theirs.keys])
                mine.values = torch.cat([mine.values, theirs.values])
            self.mask = torch.cat([F.pad(self.mask, (width - self.mask.size(1), 0)),
                                   F.pad(own_mask, (width - len(ids), 0))])
        self.next_pos.append(len(ids))
        return out.logits[0, -1].float()

    @staticmethod
    def _pad_left(cache, n: int) -> None:
        if n:
            for layer in _layers(cache):
                layer.keys = F.pad(layer.keys, (0, 0, n, 0))
                layer.values = F.pad(layer.values, (0, 0, n, 0))

    def keep(self, rows: list[int]) -> None:
        if len(rows) == self.rows:
            return
        self.next_pos = [self.next_pos[r] for r in rows]
        if not rows:
            self.cache, self.mask = None, self.mask[:0, :0]
            return
        index = torch.tensor(rows, device=self.device)
        self.mask = self.mask[index]
        cut = int((self.mask.sum(0) == 0).long().cumprod(0).sum())  # columns every row pads
        self.mask = self.mask[:, cut:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys[index, :, cut:]
            layer.values = layer.values[index, :, cut:]

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        B = self.rows
        self.mask = torch.cat([self.mask, torch.ones(B, 1, dtype=torch.long, device=self.device)], dim=1)
        out = self.model(input_ids=torch.tensor(tokens, device=self.device).view(B, 1), attention_mask=self.mask,
                         position_ids=torch.tensor(self.next_pos, device=self.device).view(B, 1),
                         past_key_values=self.cache, use_cache=True)
        self.next_pos = [p + 1 for p in self.next_pos]
        return out.logits[:, -1].float()


def _layers(cache) -> list:
    """The per-layer key/value holders of a transformers DynamicCache (`.keys`, `.values` of
    shape (batch, kv_heads, length, head_dim)); a cache of another kind (sliding windows) is
    refused, since rows could not be merged position for position."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        raise BadInput("serving this model needs full-attention cache layers (transformers DynamicLayer); "
                       "sliding-window models are served one request at a time by `gptforge generate`")
    return layers
