"""The API side of `gptforge serve`'s engine: requests in, text events out.

The scheduler and the model run elsewhere (`serve.scheduler`, run by `serve.engine_process` in
a process of its own, or by `serve.engine_core.ThreadCore` in a thread); this side hands them
token ids and gets back, after every model step, the token each running request drew. Requests
wait in a bounded queue (`submit` refuses one past `max_queue` requests that have no token yet:
the API answers 429).

On the event loop each request turns its new token into text (held back while it may be the
start of a stop string), checks its stop strings, and puts an event on its own asyncio queue,
which the HTTP handler streams out. A stop string is found here, one step behind the model:
the row computes one token more, which is dropped, and the request is cancelled on the engine
side. A client that goes away cancels its request the same way: its row is free at the next
step. When the engine is lost (its process died), every open request ends with an error and
`on_lost` is told (the server then stops with a non-zero exit).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Callable

from gptforge.serve.messages import Add, Cancel, Drawn, Failed, Stats
from gptforge.serve.sampling import Sampling

__all__ = ["Engine", "Event", "QueueFull", "Request", "Sampling"]


class QueueFull(Exception):
    """More requests waiting than the engine's queue holds."""


@dataclass
class Event:
    """What a request's stream receives: `text` (possibly empty) after each generated token, or
    the end (`finish_reason` "stop" / "length" / "cancelled" / "error")."""

    text: str = ""
    finish_reason: str | None = None


_ids = itertools.count()


class Request:
    """One generation: its prompt, settings and what it has produced so far."""

    def __init__(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        stop_ids: set[int],
        on_cancel: Callable[[int], None] | None = None,
    ):
        self.id = next(_ids)
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.generated: list[int] = []  # the tokens turned into text
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.finish_reason: str | None = None
        self.text = ""  # the answer decoded so far
        self.sent = ""  # the part of `text` already put on `events`
        self.prefix_offset = self.read_offset = 0  # the decoding window (`Engine._new_text`)
        self.submitted = time.perf_counter()
        self.token_times: list[float] = []
        self._on_cancel = on_cancel

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """The client went away: the row leaves the batch at the engine's next step."""
        if self.finish_reason is None:
            self.finish_reason = "cancelled"
            self.events.put_nowait(Event(finish_reason="cancelled"))
            if self._on_cancel is not None:
                self._on_cancel(self.id)


class Engine:
    """Requests of one served model over `core` (`ThreadCore` or `engine_process.ProcessCore`).

    `decode(ids) -> str` turns token ids into text; `observe(request, event)` is told of every
    token and end (metrics); `on_lost(message)` of the engine's end other than by `stop`.
    """

    def __init__(
        self,
        core,
        decode: Callable[[list[int]], str],
        *,
        max_queue: int = 64,
        observe: Callable[[Request, Event], None] | None = None,
        on_lost: Callable[[str], None] | None = None,
    ):
        self.core = core
        self.decode_text = decode
        self.max_batch, self.context = core.max_batch, core.context
        self.max_queue = max_queue
        self.observe = observe or (lambda request, event: None)
        self.on_lost = on_lost or (lambda message: None)
        self.open: dict[int, Request] = {}  # submitted and not ended
        self.stats = Stats()
        self.lost: str | None = None  # why the engine ended, when it did
        self._stopping = False

    # -- the API side (event loop) -------------------------------------------------------

    def submit(self, prompt_ids: list[int], sampling: Sampling, stop_ids: set[int]) -> Request:
        if self.lost is not None:
            raise RuntimeError(f"the engine stopped: {self.lost}")
        if self.waiting >= self.max_queue:
            raise QueueFull(f"{self.waiting} requests are waiting (the queue holds {self.max_queue}); retry later")
        request = Request(prompt_ids, sampling, stop_ids, on_cancel=self._cancel)
        self.open[request.id] = request
        self.core.send(Add(request.id, list(prompt_ids), sampling, frozenset(stop_ids)))
        return request

    def start(self) -> None:
        self.core.start(asyncio.get_running_loop(), self._receive, self._lose)

    async def stop(self) -> None:
        self._stopping = True
        await self.core.stop()

    @property
    def alive(self) -> bool:
        return self.lost is None and self.core.alive

    @property
    def busy_slots(self) -> int:
        return self.stats.running

    @property
    def waiting(self) -> int:
        """Requests submitted that have no token yet (queued or being prefilled)."""
        return sum(1 for r in self.open.values() if not r.generated)

    @property
    def steps(self) -> int:
        return self.stats.steps

    def _cancel(self, request_id: int) -> None:
        self.open.pop(request_id, None)
        if self.lost is None:
            self.core.send(Cancel(request_id))

    def _receive(self, message: Drawn | Failed) -> None:
        if isinstance(message, Drawn):
            self.stats = message.stats
            now = time.perf_counter()
            for request_id, token in message.tokens:
                request = self.open.get(request_id)
                if request is not None and not request.done:  # ended here at a stop string, or cancelled
                    self._advance(request, token, now)
        elif isinstance(message, Failed):
            print(f"gptforge serve: step failed: {message.reason}", flush=True)
            for request_id in message.job_ids:
                request = self.open.get(request_id)
                if request is not None:
                    self._end(request, "error")

    def _lose(self, message: str) -> None:
        """The engine ended without being asked: every open request ends with an error."""
        if self._stopping or self.lost is not None:
            return
        self.lost = message
        for request in list(self.open.values()):
            self._end(request, "error")
        self.on_lost(message)

    # -- per request, on the event loop ---------------------------------------------------

    def _advance(self, request: Request, token: int, now: float) -> None:
        request.generated.append(token)
        request.token_times.append(now)
        if token in request.stop_ids:
            request.text += self._new_text(request, request.generated[:-1], final=True)
            self._flush(request, final=True)
            return self._end(request, "stop")
        full = (
            len(request.generated) >= request.sampling.max_tokens
            or len(request.prompt_ids) + len(request.generated) >= self.context
        )
        request.text += self._new_text(request, request.generated, final=full)
        stop_at = _first_stop(request.text, request.sampling.stop, len(request.sent))
        if stop_at is not None:
            request.text = request.text[:stop_at]
            self._flush(request, final=True)
            self._end(request, "stop")
            return self._cancel(request.id)  # the engine would draw on to max_tokens
        self._flush(request, final=full)
        if full:
            self._end(request, "length")

    def _new_text(self, request: Request, ids: list[int], final: bool) -> str:
        """The text `ids` add after what `request.text` holds, decoding only a window of the
        last tokens (Hugging Face TGI's offsets: decoding a window that starts a few tokens back
        keeps word-start spaces that SentencePiece tokenizers drop from a lone first token). While
        the window ends inside a UTF-8 character (decoded as U+FFFD) nothing is added, unless
        `final`."""
        before = self.decode_text(ids[request.prefix_offset : request.read_offset])
        after = self.decode_text(ids[request.prefix_offset :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            request.prefix_offset, request.read_offset = request.read_offset, len(ids)
            return after[len(before) :]
        return ""

    def _flush(self, request: Request, final: bool) -> None:
        """Put the new part of the request's text on its stream: all of it at the end, otherwise
        less any tail that may be the beginning of a stop string."""
        text = request.text
        if not final:
            text = text[: len(text) - _held_back(text, request.sampling.stop)]
        event = Event(text[len(request.sent) :])
        request.sent = text if len(text) > len(request.sent) else request.sent
        request.events.put_nowait(event)
        self.observe(request, event)

    def _end(self, request: Request, reason: str) -> None:
        if request.done:
            return
        request.finish_reason = reason
        self.open.pop(request.id, None)
        event = Event(finish_reason=reason)
        request.events.put_nowait(event)
        self.observe(request, event)


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
