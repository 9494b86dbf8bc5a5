"""Automatic prefix caching for `gptforge serve`: the keys and values of prompt blocks an
earlier request computed, reused by later requests whose prompts start the same way (a system
prompt, a few-shot template, a retrieved context).

As vLLM's automatic prefix caching: a prompt is cut into blocks of `block_size` tokens, and a
block is known by its tokens together with every block before it (a chain: the same 16 tokens
after another beginning are another block). Here the chain is exact rather than hashed: a
block's key is (its parent block's number, its tokens), so two prompts share a cached block only
when they agree token for token up to its end; no hash collision can hand one request another's
keys. Only full blocks are cached, and a lookup leaves at least one prompt token to compute,
since the model's logits for the next token come from computing the last prompt position.

What a block holds is the backend's (`read_blocks`): gptforge GPT's and transformers' keys and
values for those positions, copied out of the running batch, so that a block outlives the request
that made it. The cache is bounded in bytes (`--prefix-cache-mb`), least recently used first
out. A chain's blocks are touched from its last to its first, so a parent is always more recent
than its children and eviction takes leaves first (no unreachable child is left holding memory).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

BLOCK_SIZE = 16  # tokens per block (vLLM's default)


@dataclass
class _Block:
    number: int
    kv: Any  # what the backend's read_blocks returned for this block
    nbytes: int


class PrefixCache:
    """Blocks of prompt keys/values by their exact token chain, LRU-bounded by `capacity_bytes`."""

    def __init__(self, capacity_bytes: int, block_size: int = BLOCK_SIZE):
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.capacity, self.block_size = int(capacity_bytes), block_size
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()
        self._numbers = 0
        self.nbytes = 0
        self.query_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, found cached
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def _chain(self, ids: list[int], blocks: int):
        """The keys of the first `blocks` blocks of `ids` that are cached, in order."""
        parent, found = 0, []
        bs = self.block_size
        for b in range(blocks):
            key = (parent, tuple(ids[b * bs : (b + 1) * bs]))
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(key)
            parent = block.number
        return found

    def _touch(self, keys: list) -> None:
        for key in reversed(keys):  # parents end up more recent than their children
            self._blocks.move_to_end(key)

    def lookup(self, ids: list[int]) -> list:
        """The cached blocks' contents for the longest cached beginning of prompt `ids` (at most
        all but its last token), in order; counted in the hit rate."""
        usable = (len(ids) - 1) // self.block_size
        keys = self._chain(ids, usable)
        self._touch(keys)
        self.query_tokens += len(ids)
        self.hit_tokens += len(keys) * self.block_size
        return [self._blocks[k].kv for k in keys]

    def store(self, ids: list[int], computed: int, read: Callable[[int, int], list]) -> None:
        """Cache the full blocks of `ids[:computed]` (keys/values a row now holds) that are not
        cached yet; `read(start_block, end_block)` copies them out of the row."""
        if self.capacity <= 0:
            return
        blocks = computed // self.block_size
        keys = self._chain(ids, blocks)
        if len(keys) < blocks:
            start = len(keys)
            new = read(start, blocks)
            parent = self._blocks[keys[-1]].number if keys else 0
            bs = self.block_size
            for b, kv in zip(range(start, blocks), new):
                nbytes = int(kv.nbytes)
                if nbytes > self.capacity:
                    break
                self._numbers += 1
                key = (parent, tuple(ids[b * bs : (b + 1) * bs]))
                self._blocks[key] = _Block(self._numbers, kv, nbytes)
                self.nbytes += nbytes
                keys.append(key)
                parent = self._numbers
        self._touch(keys)
        self._evict()

    def _evict(self) -> None:
        while self.nbytes > self.capacity and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.nbytes -= block.nbytes
            self.evicted_blocks += 1

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
