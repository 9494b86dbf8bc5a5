"""The scheduler of `gptforge serve`: continuous batching of generation requests over one
backend (`serve.backends`).

Requests wait in a bounded queue (`submit` refuses one past `max_queue`: the API answers 429).
The scheduling loop runs in a thread of its own, step after step, without waiting for the
event loop (which keeps answering HTTP):

1. rows whose request ended (its last token was a stop id, or it reached max_tokens or the
   context, or the event loop ended it at a stop string, or its client went away) leave the
   batch;
2. every running row decodes its next token (one batched forward);
3. waiting requests take the free slots: each prompt is prefilled (its own forward) and joins
   the batch, so a new request starts at the next step, not when the batch drains;
4. each row's next token is drawn with its own settings (greedy, temperature, top-k, top-p,
   its own seeded generator), and the step's tokens go to the event loop in one callback.

On the event loop each request turns its new token into text (held back while it may be the
start of a stop string), checks its stop strings, and puts an event on its own asyncio queue,
which the HTTP handler streams out. A stop string is found there, one step behind the model:
the row computes one token more, which is dropped. Before, the loop ran on the event loop and
handed each step to a worker thread: the two waited for each other every step (16 clients
got 969 tokens/s then, 1010-1134 since, in bench_serve.py runs on this CPU).

`gptforge.runtime.pause` holds the loop once, after its Nth step (GPTFORGE_PAUSE_AT_STEP, with
GPTFORGE_PAUSE_FILE; each served model's engine at its own Nth step), while the event loop goes
on answering: tests act on a batch in a known state (full, mid-answer) instead of racing the
model's speed. Unset, a step costs one comparison.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from gptforge.runtime.pause import PausePoint


class QueueFull(Exception):
    """More requests waiting than the engine's queue holds."""


@dataclass
class Sampling:
    """One request's decoding settings (OpenAI's names). temperature 0 is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Event:
    """What a request's stream receives: `text` (possibly empty) after each generated token, or
    the end (`finish_reason` "stop" / "length" / "cancelled" / "error")."""

    text: str = ""
    finish_reason: str | None = None


_ids = itertools.count()


class Request:
    """One generation: its prompt, settings and what it has produced so far."""

    def __init__(self, prompt_ids: list[int], sampling: Sampling, stop_ids: set[int]):
        self.id = next(_ids)
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.generated: list[int] = []  # event loop: the tokens it has turned into text
        self.fed: list[int] = []  # engine thread: the tokens it has drawn
        self.ended = False  # engine thread: the last token drawn ends the answer
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.finish_reason: str | None = None
        self.text = ""  # the answer decoded so far
        self.sent = ""  # the part of `text` already put on `events`
        self.prefix_offset = self.read_offset = 0  # the decoding window (`Engine._new_text`)
        self.submitted = time.perf_counter()
        self.token_times: list[float] = []
        self.generator = None
        if sampling.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(sampling.seed) if sampling.seed is not None else self.generator.seed()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """The client went away (event loop): the row leaves the batch at the next step."""
        if self.finish_reason is None:
            self.finish_reason = "cancelled"
            self.events.put_nowait(Event(finish_reason="cancelled"))


class Engine:
    """Continuous batching over `backend` (see the module's docstring).

    `decode(ids) -> str` turns token ids into text; `context` is the model's length limit
    (prompt + generated); `observe(request, event)` is told of every token and end (metrics).
    """

    def __init__(self, backend, decode: Callable[[list[int]], str], *, max_queue: int = 64,
                 observe: Callable[[Request, Event], None] | None = None):
        self.backend = backend
        self.decode_text = decode
        self.max_batch = backend.max_batch
        self.context = backend.context
        self.max_queue = max_queue
        self.observe = observe or (lambda request, event: None)
        self.waiting: list[Request] = []  # shared: appended by the event loop, taken by the engine thread
        self.running: list[Request] = []  # engine thread: in the backend's row order
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pause = PausePoint.from_env()
        self.steps = 0

    # -- the API side (event loop) -------------------------------------------------------

    def submit(self, prompt_ids: list[int], sampling: Sampling, stop_ids: set[int]) -> Request:
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the queue holds {self.max_queue}); "
                                "retry later")
            request = Request(prompt_ids, sampling, stop_ids)
            self.waiting.append(request)
            self._work.set()
        return request

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="gptforge-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._work.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def busy_slots(self) -> int:
        return len(self.running)

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            keep = [i for i, r in enumerate(self.running) if not (r.ended or r.done)]
            decoding = [self.running[i] for i in keep]
            with self._lock:
                self.waiting = [r for r in self.waiting if not r.done]
                admitted = self.waiting[: self.max_batch - len(decoding)]
                del self.waiting[:len(admitted)]
                if not decoding and not admitted:
                    self._work.clear()
            if not decoding and not admitted:
                self.backend.keep([])
                self.running = []
                self._work.wait(timeout=1.0)
                continue
            try:
                tokens = self._step(keep, decoding, admitted)
            except Exception as e:  # a model error ends these requests, not the server
                self.running = []
                self.backend.keep([])
                self._loop.call_soon_threadsafe(self._fail, decoding + admitted, e)
                continue
            self.steps += 1
            self.running = decoding + admitted
            for request, token in zip(self.running, tokens):
                request.fed.append(token)
                request.ended = (token in request.stop_ids or len(request.fed) >= request.sampling.max_tokens
                                 or len(request.prompt_ids) + len(request.fed) >= self.context)
            self._loop.call_soon_threadsafe(self._deliver, list(zip(self.running, tokens)), time.perf_counter())
            self._pause.after(self.steps)

    def _step(self, keep: list[int], decoding: list[Request], admitted: list[Request]) -> list[int]:
        """Drop the finished rows, decode the running ones, prefill the new ones, and pick every
        row's next token."""
        backend = self.backend
        backend.keep(keep)
        if (len(decoding) == 1 and not admitted and decoding[0].sampling.temperature == 0
                and hasattr(backend, "decode_greedy")):  # one greedy row: no logits needed
            return [backend.decode_greedy(decoding[0].fed[-1])]
        logits = []
        if decoding:
            logits.append(backend.decode([r.fed[-1] for r in decoding]))
        for request in admitted:
            logits.append(backend.add(request.prompt_ids).unsqueeze(0))
        return pick_tokens(logits[0] if len(logits) == 1 else torch.cat(logits), decoding + admitted)

    def _deliver(self, rows: list[tuple[Request, int]], now: float) -> None:
        for request, token in rows:
            if not request.done:  # ended here at a stop string, or cancelled: the token is dropped
                self._advance(request, token, now)

    def _fail(self, requests: list[Request], error: Exception) -> None:
        print(f"gptforge serve: step failed: {type(error).__name__}: {error}", flush=True)
        for request in requests:
            self._end(request, "error")

    # -- per request, on the event loop ---------------------------------------------------

    def _advance(self, request: Request, token: int, now: float) -> None:
        request.generated.append(token)
        request.token_times.append(now)
        if token in request.stop_ids:
            request.text += self._new_text(request, request.generated[:-1], final=True)
            self._flush(request, final=True)
            return self._end(request, "stop")
        full = (len(request.generated) >= request.sampling.max_tokens
                or len(request.prompt_ids) + len(request.generated) >= self.context)
        request.text += self._new_text(request, request.generated, final=full)
        stop_at = _first_stop(request.text, request.sampling.stop, len(request.sent))
        if stop_at is not None:
            request.text = request.text[:stop_at]
            self._flush(request, final=True)
            return self._end(request, "stop")
        self._flush(request, final=full)
        if full:
            self._end(request, "length")

    def _new_text(self, request: Request, ids: list[int], final: bool) -> str:
        """The text `ids` add after what `request.text` holds, decoding only a window of the
        last tokens (Hugging Face TGI's offsets: decoding a window that starts a few tokens back
        keeps word-start spaces that SentencePiece tokenizers drop from a lone first token). While
        the window ends inside a UTF-8 character (decoded as U+FFFD) nothing is added, unless
        `final`."""
        before = self.decode_text(ids[request.prefix_offset:request.read_offset])
        after = self.decode_text(ids[request.prefix_offset:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            request.prefix_offset, request.read_offset = request.read_offset, len(ids)
            return after[len(before):]
        return ""

    def _flush(self, request: Request, final: bool) -> None:
        """Put the new part of the request's text on its stream: all of it at the end, otherwise
        less any tail that may be the beginning of a stop string."""
        text = request.text
        if not final:
            text = text[: len(text) - _held_back(text, request.sampling.stop)]
        event = Event(text[len(request.sent):])
        request.sent = text if len(text) > len(request.sent) else request.sent
        request.events.put_nowait(event)
        self.observe(request, event)

    def _end(self, request: Request, reason: str) -> None:
        if request.done:
            return
        request.finish_reason = reason
        event = Event(finish_reason=reason)
        request.events.put_nowait(event)
        self.observe(request, event)


def pick_tokens(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Each row's next token under its request's settings: argmax for temperature 0 (the lowest
    index on ties, as `decoding.generate`), else a draw from softmax(logits / temperature) cut
    to the top_k most likely and to the smallest set whose probability reaches top_p."""
    greedy = logits.argmax(dim=-1).tolist()
    if all(r.sampling.temperature == 0 for r in requests):
        return greedy
    out = []
    for row, request in enumerate(requests):
        s = request.sampling
        if s.temperature == 0:
            out.append(greedy[row])
            continue
        scores = logits[row].float() / s.temperature
        if s.top_k is not None and s.top_k < scores.numel():
            kth = torch.topk(scores, s.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if s.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass of the more likely tokens
            sorted_probs[before >= s.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=request.generator)))
    return out


def _first_stop(text: str, stops: list[str], sent: int) -> int | None:
    """Where the first stop string starts in `text`, looking only where one may newly appear
    (text before `sent` was checked already)."""
    found = [i for i in (text.find(s, max(0, sent - len(s) + 1)) for s in stops if s) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters may be the start of a stop string (held back until the
    next token says whether it is one)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if stop.startswith(text[-n:]):
                hold = n
                break
    return hold
