"""Continuous batching for any transformers causal LM, through transformers' own `DynamicCache`:
rows that take tokens in segments (`forward`), so that a prompt is prefilled in chunks between
decode steps, several new prompts are prefilled together, and a row can start from a prompt
prefix's keys/values copied out of another row (`read_blocks`, `open_row(prefix=...)`).

A row lives in one of two places:

- the *batch*: one left-padded `DynamicCache` of every decoding row (batch dimension = the
  batch's rows, in the order they joined, not the scheduler's row order), with a (rows, columns)
  attention mask (1 = a real position) and explicit position ids per row. Rotary keys are stored
  already rotated, so where a key sits in the buffer does not matter: padding and holes are just
  masked columns. One forward advances every batch row that has a segment; the common step (each
  row one token) appends one column. A batch row with a longer segment gets its tokens
  right-aligned in the new columns after left padding, and a batch row without a segment this call
  gets a masked column (a hole): both are correct, the first is rare and the second costs a column.
  `keep` drops rows by index and cuts the columns that no remaining row uses.
- on its own (*solo*): a batch-1 `DynamicCache`, or nothing yet. A new row (no cache) whose first
  segment arrives together with other new rows' first segments is prefilled with them in ONE
  forward, padded on the right: every row starts at column 0, so causal attention alone is each
  row's own (no mask, no position ids, no fully masked query row), and the logits kept are those
  of each row's last token. The group's cache is then split into one batch-1 cache per row (views,
  no copy). Prompts of very different lengths are split into a few such groups, so that padding
  stays under about a third of the work. A solo row that already holds positions (a later
  prefill chunk, or a row opened from a prefix) runs alone, unpadded. A solo row's first 1-token
  segment moves it into the batch: all rows joining in one call are copied in together with the
  batch, into one new buffer per layer.

So one `forward` call is one model forward per prefill group and per continuing chunk, plus one
for the batch, and each projects onto the vocabulary only the segments' last columns
(`logits_to_keep`), never a whole prompt.

Blocks (`KVBlock`) are per-layer key/value copies of a span of one row's positions, each tensor
(1, kv_heads, block_size, head_dim), made outside inference mode so that the prefix cache may
hold them as ordinary tensors. A row opened from blocks gets a batch-1 cache of their
concatenation and continues at position len(prefix) * block_size.

Caches other than full attention (sliding windows, linear attention) are refused at construction
with `BadInput`: rows could not be merged, cut or copied position for position.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from gptforge.errors import BadInput
from gptforge.serve.backend import Backend

# Padding is accepted in a group prefill while the padded token count stays within this factor
# of the real token count; past it, the prompts are split into groups of similar length.
_PAD_SLACK = 1.5


class KVBlock:
    """Keys and values of `block_size` consecutive positions of one row: per layer, tensors of
    shape (1, kv_heads, block_size, head_dim), independent of the row they were copied from."""

    __slots__ = ("keys", "values", "nbytes")

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))

    @property
    def length(self) -> int:
        return self.keys[0].size(2)


class _Row:
    """One live row: the positions it holds, and where its keys/values are (`cache` when solo,
    `slot` in the batch when `merged`)."""

    __slots__ = ("length", "cache", "merged", "slot")

    def __init__(self, length: int = 0, cache=None):
        self.length, self.cache, self.merged, self.slot = length, cache, False, -1


class HFBackend(Backend):
    """Rows of a transformers causal LM: decoding rows in one left-padded `DynamicCache`,
    prefilling rows in their own (see the module docstring)."""

    def __init__(self, model, max_batch: int, context: int, weights: str = "native"):
        from transformers import DynamicCache

        model.eval()
        self.model, self.max_batch, self.context = model, max_batch, context
        self.config = model.config
        self.device = next(model.parameters()).device
        self._cache_class = DynamicCache
        self._n_layers = (
            len(_layers(DynamicCache(config=self.config)))  # refuses sliding windows now
            or self.config.get_text_config(decoder=True).num_hidden_layers
        )
        params = inspect.signature(model.forward).parameters
        # transformers 5 names the cache argument `cache` (`past_key_values` is a deprecated alias).
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # Llama-family models take the common decode step (every batch row, one token) through
        # gptforge's lean block (modeling/llama_decoding.py): the model's operations without its
        # module tree and per-step mask building, into the same cache tensors.
        # weights="int8" / "int4": that step's linears weight-only quantized.
        from gptforge.modeling.llama_decoding import LlamaLayers, round_weights, unsupported

        why = unsupported(model)
        if why is not None and weights != "native":
            raise BadInput(
                f"--quantize {weights} runs in gptforge's lean Llama-family decoder, which cannot run this model: {why}"
            )
        if weights != "native":  # prefill runs transformers' forward: over the same rounded weights
            round_weights(model, weights)
        self._lean = LlamaLayers(model, context, weights) if why is None else None
        self._rows: list[_Row] = []  # in the scheduler's row order
        self._members: list[_Row] = []  # the batch's rows, in its batch order
        self.cache = None  # DynamicCache of the batch
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # (batch rows, columns), 1 = real

    @property
    def rows(self) -> int:
        return len(self._rows)

    def _new_cache(self):
        """An empty DynamicCache with one layer per model layer (a config that names none gets
        them added, as transformers would on the first update)."""
        from transformers.cache_utils import DynamicLayer

        cache = self._cache_class(config=self.config)
        while len(cache.layers) < self._n_layers:
            cache.layers.append(DynamicLayer())
        return cache

    # -- rows ------------------------------------------------------------------------------

    @torch.inference_mode()
    def open_row(self, prefix: list | None = None) -> None:
        """Append a row, empty or holding the positions of `prefix` (blocks from `read_blocks`)."""
        if self.rows >= self.max_batch:
            raise RuntimeError("no free slot")  # the scheduler never asks for more than max_batch
        if not prefix:
            self._rows.append(_Row())
            return
        cache = self._new_cache()
        for i, layer in enumerate(_layers(cache)):
            keys = torch.cat([block.keys[i] for block in prefix], dim=2).to(self.device)
            values = torch.cat([block.values[i] for block in prefix], dim=2).to(self.device)
            _set(layer, keys, values)
        self._rows.append(_Row(sum(block.length for block in prefix), cache))

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (ascending), as rows 0..len(rows)-1."""
        kept = [self._rows[r] for r in rows]
        self._rows = kept
        live = {id(row) for row in kept}
        members = [row for row in self._members if id(row) in live]
        if len(members) == len(self._members):
            return
        if not members:
            self._members, self.cache = [], None
            self.mask = self.mask[:0, :0]
            return
        with torch.inference_mode():
            index = torch.tensor([row.slot for row in members], device=self.device)
            mask = self.mask[index]
            used = mask.any(0)
            columns = None  # all columns stay
            if not bool(used.all()):
                first = int(used.long().argmax())
                if bool(used[first:].all()):
                    columns = slice(first, None)  # only leading columns are unused: a view
                else:
                    columns = used.nonzero().view(-1)
            if columns is not None:
                mask = mask[:, columns]
            for layer in _layers(self.cache):
                keys, values = layer.keys[index], layer.values[index]
                if columns is not None:
                    keys, values = keys[:, :, columns], values[:, :, columns]
                layer.keys, layer.values = keys, values
            self.mask = mask
        self._members = members
        for slot, row in enumerate(members):
            row.slot = slot

    @torch.no_grad()
    def read_blocks(self, row: int, start: int, end: int, block_size: int) -> list[KVBlock]:
        """Copies of row `row`'s keys/values for positions [start*block_size, end*block_size),
        one `KVBlock` per block."""
        r = self._rows[row]
        lo, hi = start * block_size, end * block_size
        if not 0 <= lo <= hi <= r.length:
            raise ValueError(f"row {row} holds {r.length} positions, not [{lo}, {hi})")
        if hi == lo:
            return []
        if r.merged:
            source, b = self.cache, r.slot
            columns = self.mask[b].nonzero().view(-1)[lo:hi]
            first, last = int(columns[0]), int(columns[-1])
            span = slice(first, last + 1) if last - first + 1 == hi - lo else columns
        else:
            source, b, span = r.cache, 0, slice(lo, hi)
        spans = [(layer.keys[b : b + 1, :, span], layer.values[b : b + 1, :, span]) for layer in _layers(source)]
        return [
            KVBlock(
                [k[:, :, j : j + block_size].clone() for k, _ in spans],
                [v[:, :, j : j + block_size].clone() for _, v in spans],
            )
            for j in range(0, hi - lo, block_size)
        ]

    # -- forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, segments: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Append each segment's tokens to its row; (len(segments), vocab) float32 logits of the
        token after each segment's last one, in segment order."""
        if not segments:
            return torch.zeros(0, self.config.get_text_config(decoder=True).vocab_size, device=self.device)
        out: list[torch.Tensor | None] = [None] * len(segments)
        fresh, chunks, batch, joining = [], [], [], []
        seen = set()
        for k, (r, tokens) in enumerate(segments):
            row = self._rows[r]
            if r in seen or not tokens:
                raise ValueError(f"segment {k}: row {r} twice in one call, or no tokens")
            seen.add(r)
            if row.length + len(tokens) > self.context:
                raise ValueError(f"row {r}: {row.length} + {len(tokens)} positions exceed the context {self.context}")
            item = (k, row, list(tokens))
            if row.merged:
                batch.append(item)
            elif row.length == 0:
                fresh.append(item)
            elif len(tokens) == 1:
                joining.append(row)
                batch.append(item)
            else:
                chunks.append(item)
        for group in _groups(fresh):
            self._prefill(group, out)
        for k, row, tokens in chunks:
            out[k] = self._extend(row, tokens)
        if joining:
            self._join(joining)
        if batch:
            self._step(batch, out)
        return torch.stack(out)

    def _run(self, ids, cache, attention_mask=None, position_ids=None, keep=None) -> torch.Tensor:
        """The model over `ids` (B, T) into `cache`: (B, vocab) float32 logits of the last
        position, or (B, len(keep), vocab) those of the columns `keep` (a 1D tensor)."""
        out = self.model(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1 if keep is None else keep,
            **{self._cache_arg: cache},
        )
        return (out.logits[:, -1] if keep is None else out.logits).float()

    def _prefill(self, group: list, out: list) -> None:
        """New rows' first segments in one forward, then one batch-1 cache per row (a view of
        its part of the group's cache).

        The group is padded on the right: each row's tokens sit at columns 0..n-1, so plain
        causal attention is exactly each row's own (no real token sees a pad after it), no
        attention mask is needed (SDPA's causal path), and no query row is fully masked (which
        some attention kernels answer with NaN). The logits kept are those of each row's last
        token: the distinct last columns, for every row of the group."""
        cache = self._new_cache()
        if len(group) == 1:
            k, row, tokens = group[0]
            logits = self._run(torch.tensor([tokens], device=self.device), cache)
            row.cache, row.length = cache, len(tokens)
            out[k] = logits[0]
            return
        width = max(len(tokens) for _, _, tokens in group)
        ids = torch.tensor([tokens + [0] * (width - len(tokens)) for _, _, tokens in group], device=self.device)
        last = sorted({len(tokens) - 1 for _, _, tokens in group})
        logits = self._run(ids, cache, keep=torch.tensor(last, device=self.device))  # (rows, len(last), vocab)
        layers = _layers(cache)
        for i, (k, row, tokens) in enumerate(group):
            n = len(tokens)
            own = self._new_cache()
            for mine, theirs in zip(_layers(own), layers):
                _set(mine, theirs.keys[i : i + 1, :, :n], theirs.values[i : i + 1, :, :n])
            row.cache, row.length = own, n
            out[k] = logits[i, last.index(n - 1)]

    def _extend(self, row: _Row, tokens: list[int]) -> torch.Tensor:
        """A solo row that already holds positions: its next chunk, batch 1, unpadded."""
        n = len(tokens)
        position_ids = torch.arange(row.length, row.length + n, device=self.device).view(1, n)
        logits = self._run(torch.tensor([tokens], device=self.device), row.cache, position_ids=position_ids)
        row.length += n
        return logits[0]

    def _join(self, rows: list[_Row]) -> None:
        """Move solo rows into the batch: one new (rows, kv_heads, width, head_dim) buffer per
        layer, the batch's rows and the new ones each right-aligned in it."""
        old = len(self._members)
        old_width = self.mask.size(1)
        width = max([old_width] + [row.length for row in rows])
        total = old + len(rows)
        mask = torch.zeros(total, width, dtype=torch.long, device=self.device)
        mask[:old, width - old_width :] = self.mask
        for j, row in enumerate(rows):
            mask[old + j, width - row.length :] = 1
        target = self.cache if self.cache is not None else self._new_cache()
        theirs = [_layers(row.cache) for row in rows]
        for i, layer in enumerate(_layers(target)):
            sample = theirs[0][i].keys
            shape = (total, sample.size(1), width, sample.size(3))
            keys = sample.new_zeros(shape)
            values = theirs[0][i].values.new_zeros(shape)
            if old:
                keys[:old, :, width - old_width :] = layer.keys
                values[:old, :, width - old_width :] = layer.values
            for j, row in enumerate(rows):
                keys[old + j, :, width - row.length :] = theirs[j][i].keys[0]
                values[old + j, :, width - row.length :] = theirs[j][i].values[0]
            _set(layer, keys, values)
        self.cache, self.mask = target, mask
        for j, row in enumerate(rows):
            row.cache, row.merged, row.slot = None, True, old + j
            self._members.append(row)

    def _step(self, items: list, out: list) -> None:
        """One forward of the batch: each batch row's segment right-aligned in the new columns
        (usually one token each); a batch row without a segment gets masked columns."""
        members = self._members
        B = len(members)
        width = max(len(tokens) for _, _, tokens in items)
        lengths = torch.tensor([row.length for row in members], device=self.device).view(B, 1)
        if width == 1 and len(items) == B:  # the common step: every batch row, one token
            ids = [0] * B
            for k, row, tokens in items:
                ids[row.slot] = tokens[0]
            ids = torch.tensor(ids, device=self.device).view(B, 1)
            new_mask = torch.ones(B, 1, dtype=torch.long, device=self.device)
            position_ids = lengths
        else:
            by_slot = {row.slot: tokens for _, row, tokens in items}
            ids, new_mask, shift = [], [], []
            for slot in range(B):
                tokens = by_slot.get(slot, [])
                p = width - len(tokens)
                ids.append([0] * p + tokens)
                new_mask.append([0] * p + [1] * len(tokens))
                shift.append(p)
            ids = torch.tensor(ids, device=self.device)
            new_mask = torch.tensor(new_mask, dtype=torch.long, device=self.device)
            columns = torch.arange(width, device=self.device).view(1, width)
            shift = torch.tensor(shift, device=self.device).view(B, 1)
            position_ids = (lengths + columns - shift).clamp(min=0)
        mask = torch.cat([self.mask, new_mask], dim=1)
        if self._lean is not None and width == 1 and len(items) == B:
            logits = self._lean_step(ids, position_ids.view(B), mask)
        else:
            logits = self._run(ids, self.cache, attention_mask=mask, position_ids=position_ids)
        self.mask = mask
        for k, row, tokens in items:
            row.length += len(tokens)
            out[k] = logits[row.slot]

    def _lean_step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The common step through `LlamaLayers`: ids (B, 1) at `positions` (B,), `mask` (B,
        columns + 1) the batch's mask with the new column; each layer's new keys/values appended
        to the batch cache as the model's own forward appends them. (B, vocab) float32 logits."""
        from gptforge.modeling.llama_decoding import attend_one

        w, B = self._lean, ids.size(0)
        cos, sin = w.cos[positions].view(B, 1, 1, -1), w.sin[positions].view(B, 1, 1, -1)
        allowed = mask.bool().view(B, 1, 1, -1)
        layers = _layers(self.cache)

        def attend(i, q, k, v):
            layer = layers[i]
            layer.keys = keys = torch.cat([layer.keys, k], dim=2)
            layer.values = values = torch.cat([layer.values, v], dim=2)
            return attend_one(q, keys, values, allowed)

        return w.logits(w.forward(ids, cos, sin, attend)).float()

    @property
    def verifies_drafts(self) -> bool:
        """Whether `decode_greedy_draft` runs here: the lean Llama-family layers only."""
        return self._lean is not None

    @torch.inference_mode()
    def decode_greedy_draft(self, token: int, draft: list[int]) -> list[int]:
        """Speculative decoding's verify step for the lone row (`serve.scheduler`): `token` and
        the `draft` after it through the lean layers in one forward, causally over the row's
        keys; returns the drafted tokens greedy decoding keeps (`speculative.greedy_kept`) and
        then the model's own next token. The row keeps `token` and the kept drafts; the
        rejected drafts' keys and values are cut off again."""
        from gptforge.modeling.greedy_head import _argmax
        from gptforge.modeling.speculative import greedy_kept

        if self._lean is None or len(self._rows) != 1:
            raise ValueError("a draft is verified for one row of a lean-decoded model")
        row = self._rows[0]
        if not row.merged:
            self._join([row])
        w, T = self._lean, 1 + len(draft)
        positions = torch.arange(row.length, row.length + T, device=self.device)
        width = self.mask.size(1)
        allowed = torch.ones(T, width + T, dtype=torch.bool, device=self.device)
        allowed[:, :width] = self.mask.bool()
        allowed[:, width:] = allowed[:, width:].tril()
        layers = _layers(self.cache)

        def attend(i, q, k, v):
            layer = layers[i]
            layer.keys = keys = torch.cat([layer.keys, k], dim=2)
            layer.values = values = torch.cat([layer.values, v], dim=2)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=w.n_head != w.n_kv)

        ids = torch.tensor([[token] + draft], device=self.device)
        hidden = w.forward(ids, w.cos[positions], w.sin[positions], attend, all_positions=True)[0]
        greedy = _argmax(w.logits(hidden).float()).tolist()
        kept = greedy_kept(draft, greedy)
        held = 1 + kept  # columns the row keeps of the T written
        if held < T:
            for layer in layers:
                layer.keys, layer.values = layer.keys[:, :, : width + held], layer.values[:, :, : width + held]
        self.mask = torch.cat([self.mask, self.mask.new_ones(1, held)], dim=1)
        row.length += held
        return draft[:kept] + [greedy[kept]]


def _groups(items: list) -> list[list]:
    """New rows' first segments in groups to prefill together: by decreasing length, a group
    grows while its padded size stays within `_PAD_SLACK` of its real tokens."""
    groups: list[list] = []
    group, real = [], 0
    for item in sorted(items, key=lambda item: -len(item[2])):
        n = len(item[2])
        if group and len(group[0][2]) * (len(group) + 1) > _PAD_SLACK * (real + n):
            groups.append(group)
            group, real = [], 0
        group.append(item)
        real += n
    if group:
        groups.append(group)
    return groups


def _set(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Give a `DynamicLayer` these keys/values; one that never ran is first initialized by its
    own `update`, with no positions."""
    if not getattr(layer, "is_initialized", layer.keys is not None):
        layer.update(keys[:, :, :0], values[:, :, :0])
    layer.keys, layer.values = keys, values


def _layers(cache) -> list:
    """The per-layer key/value holders of a transformers DynamicCache (`.keys`, `.values` of
    shape (batch, kv_heads, length, head_dim)); a cache of another kind (sliding windows) is
    refused, since rows could not be merged position for position."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        raise BadInput(
            "serving this model needs full-attention cache layers (transformers DynamicLayer); "
            "sliding-window models are served one request at a time by `gptforge generate`"
        )
    return layers
