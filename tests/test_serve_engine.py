"""The engine of `gptforge serve` (serve.engine, serve.scheduler, serve.engine_core's thread
runner) on a scripted backend: no model, no HTTP.

The backend answers each row with logits that put all mass on a scripted next token (or on a
given distribution), so the tests see exactly what the engine does with tokens: text in
pieces, UTF-8 characters split across tokens, stop strings across token boundaries, stop ids,
max_tokens, the context, cancellation, queue bounds, and the sampling rules against their
formulas.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch

from gptforge.serve.backend import Backend
from gptforge.serve.engine import Engine, QueueFull, Request
from gptforge.serve.engine_core import ThreadCore
from gptforge.serve.sampling import Sampling, pick_tokens, pick_tokens_per_row
from gptforge.serve.scheduler import Job, Scheduler

VOCAB = 16


class Script(Backend):
    """Row i of the batch continues with `plan[request]` token by token."""

    def __init__(self, plans: dict[tuple, list[int]], context: int = 64, max_batch: int = 4):
        self.plans, self.context, self.max_batch = plans, context, max_batch
        self.rows: list[list[int]] = []  # per row: tokens so far (prompt + generated)
        self.batch_sizes = []

    def _logits(self, seq: list[int]) -> torch.Tensor:
        plan = self.plans[tuple(seq[:2])]
        nxt = plan[len(seq) - 2] if len(seq) - 2 < len(plan) else 0
        out = torch.full((VOCAB,), -30.0)
        out[nxt] = 30.0
        return out

    def open_row(self, prefix=None):
        assert prefix is None
        self.rows.append([])

    def keep(self, rows):
        self.rows = [self.rows[r] for r in rows]

    def forward(self, segments):
        self.batch_sizes.append(len(segments))
        for row, tokens in segments:
            self.rows[row].extend(tokens)
        return torch.stack([self._logits(self.rows[row]) for row, _ in segments])


def engine_over(backend, **kw) -> Engine:
    """The API side over the scheduler on `backend`, run in a thread."""
    return Engine(ThreadCore(Scheduler(backend)), decode, **kw)


# Token i decodes to PIECES[i] (bytes); 3 and 4 are the two halves of "é".
PIECES = {0: b"<eot>", 1: b"a", 2: b"b", 3: b"\xc3", 4: b"\xa9", 5: b" ST", 6: b"OP", 7: b"x", 8: b"\n"}


def decode(ids) -> str:
    return b"".join(PIECES.get(i, b"?") for i in ids).decode("utf-8", errors="replace")


async def answer(engine: Engine, prompt, sampling, stop_ids=frozenset({0})) -> tuple[list[str], str, Request]:
    request = engine.submit(list(prompt), sampling, set(stop_ids))
    pieces = []
    while True:
        event = await request.events.get()
        if event.finish_reason:
            return pieces, event.finish_reason, request
        pieces.append(event.text)


def run(plans, *jobs, **kw):
    async def main():
        engine = engine_over(Script(plans, **{k: v for k, v in kw.items() if k in ("context", "max_batch")}))
        engine.start()
        try:
            return await asyncio.gather(*(answer(engine, *job) for job in jobs)), engine
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_pieces_join_to_the_answer_and_a_split_character_waits_for_its_second_half():
    ((pieces, reason, req),) = run({(9, 9): [1, 3, 4, 2, 0]}, ((9, 9), Sampling(max_tokens=10, temperature=0)))[0]
    assert "".join(pieces) == "aéb" and reason == "stop"
    assert "\ufffd" not in "".join(pieces) and pieces[1] == ""  # the first half alone shows nothing
    assert req.generated == [1, 3, 4, 2, 0]  # the stop id is counted, not shown


def test_a_stop_string_across_tokens_ends_the_answer_before_it_and_is_never_sent():
    ((pieces, reason, _),) = run(
        {(9, 9): [1, 5, 6, 2, 2]}, ((9, 9), Sampling(max_tokens=10, temperature=0, stop=["STOP"]))
    )[0]
    assert "".join(pieces) == "a " and reason == "stop"
    assert all("ST" not in p for p in pieces)


def test_a_held_back_tail_that_is_not_a_stop_is_sent_later():
    ((pieces, reason, _),) = run({(9, 9): [5, 7, 2]}, ((9, 9), Sampling(max_tokens=3, temperature=0, stop=["STOP"])))[0]
    assert "".join(pieces) == " STxb" and reason == "length"


def test_max_tokens_and_the_context_end_with_length():
    plans = {(9, 9): [1] * 50}
    ((pieces, reason, req),) = run(plans, ((9, 9), Sampling(max_tokens=5, temperature=0)))[0]
    assert reason == "length" and len(req.generated) == 5
    ((pieces, reason, req),) = run(plans, ((9, 9), Sampling(max_tokens=50, temperature=0)), context=12)[0]
    assert reason == "length" and len(req.prompt_ids) + len(req.generated) == 12


class Gated(Script):
    """A Script whose steps with a decode segment wait for `gate` (`at_gate` is set while one
    waits): the test decides when the engine moves on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.at_gate = threading.Event(), threading.Event()

    def forward(self, segments):
        if any(len(tokens) == 1 for _, tokens in segments):
            self.at_gate.set()
            self.gate.wait(timeout=30)
        return super().forward(segments)


async def collect(request: Request) -> str:
    pieces = []
    while (event := await request.events.get()).finish_reason is None:
        pieces.append(event.text)
    return "".join(pieces)


def test_requests_share_steps_and_join_a_running_batch():
    async def main():
        backend = Gated({(9, 1): [1] * 20, (9, 2): [2] * 5, (9, 3): [1] * 8})
        engine = engine_over(backend)
        engine.start()
        try:
            first = engine.submit([9, 1], Sampling(max_tokens=20, temperature=0), {0})
            # The other two come while the first is decoding (held at its first decode step).
            assert await asyncio.to_thread(backend.at_gate.wait, 30)
            others = [engine.submit([9, n], Sampling(max_tokens=m, temperature=0), {0}) for n, m in ((2, 5), (3, 8))]
            backend.gate.set()
            return await asyncio.gather(*map(collect, [first, *others])), engine, backend
        finally:
            backend.gate.set()
            await engine.stop()

    texts, engine, backend = asyncio.run(main())
    assert texts == ["a" * 20, "b" * 5, "a" * 8]
    # Step 1 prefills the first, step 2 decodes it (held while the others come), step 3 decodes
    # it and prefills the others in the same forward, and they join its batch; each row leaves
    # after its last token: 5 and 8 tokens from step 3 on, 20 from step 1.
    assert backend.batch_sizes == [1, 1] + [3] * 5 + [2] * 3 + [1] * 10
    assert engine.steps == 20  # one request's steps: the others took none of their own


def test_a_cancelled_request_leaves_the_batch_at_the_next_step_and_a_full_queue_refuses():
    async def main():
        backend = Gated({(9, 9): [1] * 60}, max_batch=1)
        engine = engine_over(backend, max_queue=1)
        engine.start()
        try:
            first = engine.submit([9, 9], Sampling(max_tokens=60, temperature=0), {0})
            await first.events.get()  # the prefill's token
            assert await asyncio.to_thread(backend.at_gate.wait, 30)  # its first decode step is held
            second = engine.submit([9, 9], Sampling(max_tokens=3, temperature=0), {0})
            with pytest.raises(QueueFull):
                engine.submit([9, 9], Sampling(max_tokens=3, temperature=0), {0})
            first.cancel()
            backend.gate.set()
            await collect(second)
            return first, second, engine
        finally:
            backend.gate.set()
            await engine.stop()

    first, second, engine = asyncio.run(main())
    assert first.finish_reason == "cancelled" and len(first.generated) < 60
    assert second.finish_reason == "length"
    # The first's prefill, its decode step held at the gate, then the second's 3 steps: the
    # cancelled row left at once, it did not run on to its 60 tokens.
    assert engine.steps == 2 + 3


def test_the_pause_holds_the_engine_after_its_nth_step_until_its_file_is_removed(tmp_path, monkeypatch):
    """gptforge.runtime.pause in the engine: what the server's tests hold a batch with."""
    path = tmp_path / "paused"
    monkeypatch.setenv("GPTFORGE_PAUSE_AT_STEP", "3")
    monkeypatch.setenv("GPTFORGE_PAUSE_FILE", str(path))

    async def main():
        engine = engine_over(Script({(9, 9): [1] * 10}))
        engine.start()
        try:
            request = engine.submit([9, 9], Sampling(max_tokens=10, temperature=0), {0})
            for _ in range(3):  # the tokens of the steps before the hold reach the event loop
                await request.events.get()
            deadline = time.monotonic() + 60  # against a hang only
            while not path.is_file():
                assert time.monotonic() < deadline, "the engine never paused"
                await asyncio.sleep(0.01)
            held = engine.steps, request.events.qsize()
            path.unlink()
            return held, "a" * 3 + await collect(request), request
        finally:
            path.unlink(missing_ok=True)
            await engine.stop()

    held, text, request = asyncio.run(main())
    assert held == (3, 0)  # held after step 3: no fourth token while the file is there
    assert text == "a" * 10 and request.finish_reason == "length"


# -- sampling against its formula -------------------------------------------------------------


def request_with(**kw) -> Job:
    return Job(0, [1], Sampling(max_tokens=1, **kw), set())


SAMPLERS = pytest.mark.parametrize("pick", [pick_tokens, pick_tokens_per_row], ids=["batched", "per-row"])


@SAMPLERS
def test_greedy_takes_the_lowest_index_of_a_tie(pick):
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert pick(logits, [request_with(temperature=0)]) == [1]


@SAMPLERS
def test_top_k_top_p_and_temperature_draw_from_the_renormalized_distribution(pick):
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04], dtype=torch.float64)).float()
    n = 5000

    def frequencies(**kw):
        req = request_with(seed=0, **kw)
        counts = torch.zeros(5)
        for t in pick(logits.expand(n, 5).contiguous(), [req] * n):
            counts[t] += 1
        return counts / n

    def expected(p):
        p = torch.tensor(p, dtype=torch.float64)
        return (p / p.sum()).float()

    # top_k 3: the three most likely, renormalized
    assert torch.allclose(frequencies(temperature=1.0, top_k=3), expected([0.5, 0.25, 0.15, 0, 0]), atol=0.03)
    # top_p 0.7: the smallest set whose mass reaches 0.7 is {0.5, 0.25}
    assert torch.allclose(frequencies(temperature=1.0, top_p=0.7), expected([0.5, 0.25, 0, 0, 0]), atol=0.03)
    # temperature 2: softmax(log p / 2) = sqrt(p), renormalized
    sqrt = [math.sqrt(v) for v in (0.5, 0.25, 0.15, 0.06, 0.04)]
    assert torch.allclose(frequencies(temperature=2.0), expected(sqrt), atol=0.03)


@SAMPLERS
def test_a_seed_repeats_the_draws(pick):
    logits = torch.randn(1, 50)
    a = [pick(logits, [r])[0] for r in [request_with(temperature=1.0, seed=3)] for _ in range(20)]
    b = [pick(logits, [r])[0] for r in [request_with(temperature=1.0, seed=3)] for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_rows_of_one_batch_each_draw_under_their_own_settings():
    """The batched sampler with greedy, top-k, top-p and plain rows in one call: each row's
    frequencies are its own formula's (as in the test above, one setting per call)."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04], dtype=torch.float64)
    logits = torch.log(p).float().expand(4, 5).contiguous()
    rows = [
        request_with(temperature=0),
        request_with(temperature=1.0, top_k=2, seed=1),
        request_with(temperature=1.0, top_p=0.7, top_k=4, seed=2),
        request_with(temperature=1.0, seed=3),
    ]
    n = 4000
    counts = torch.zeros(4, 5)
    for _ in range(n):
        for row, t in enumerate(pick_tokens(logits, rows)):
            counts[row, t] += 1
    freq = counts / n
    norm = lambda q: (torch.tensor(q, dtype=torch.float64) / sum(q)).float()  # noqa: E731
    assert freq[0].tolist() == [1, 0, 0, 0, 0]
    assert torch.allclose(freq[1], norm([0.5, 0.25, 0, 0, 0]), atol=0.03)
    assert torch.allclose(freq[2], norm([0.5, 0.25, 0, 0, 0]), atol=0.03)
    assert torch.allclose(freq[3], p.float(), atol=0.03)
