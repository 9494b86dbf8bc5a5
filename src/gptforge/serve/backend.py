"""What the scheduler and the engine core need of a model: the `Backend` protocol that
`serve.gpt_backend.GPTBackend` (gptforge's GPT) and `serve.hf_backend.HFBackend` (Hugging Face
causal LMs) declare. A backend holds up to `max_batch` rows, each a sequence's keys and values of
at most `context` positions; the scheduler opens, keeps and reads rows (`serve.scheduler`), the
engine core runs `forward` over a step's segments or, for a lone greedy row, `decode_greedy`
(`serve.engine_core.step`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Backend(Protocol):
    max_batch: int
    context: int

    def open_row(self, prefix: list | None = None) -> None:
        """A new row at the end, holding `prefix` (the prefix cache's blocks) when given."""
        ...

    def keep(self, rows: list[int]) -> None:
        """Keep these rows, in this order; the others are freed."""
        ...

    def forward(self, segments: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Append each (row, tokens) segment to its row; the logits (len(segments), vocab) of
        each segment's last position."""
        ...

    def read_blocks(self, row: int, start: int, end: int, block_size: int) -> list:
        """Copies of `row`'s keys and values over [start, end), in blocks of `block_size`."""
        ...

    def decode_greedy(self, token: int) -> int:
        """The lone running row's greedy next token after `token`. This default is `forward`'s
        argmax (the lowest index on ties, as `sampling.pick_tokens`); a backend with a faster
        path for it overrides it (GPTBackend: the head's exact int8 screen, no full logits)."""
        return int(self.forward([(0, [token])])[0].argmax())
