"""Where the scheduler (`serve.scheduler`) runs: its loop, and the in-process runner of it.

The loop takes messages from the API side ("add" a job, "cancel" one, "stop"), runs one
scheduler step whenever there is work, and sends back what each step drew:

    ("tokens", [(job id, token), ...], stats)   after every step (stats: `Stats`)
    ("failed", [job ids], "Error: message")     a step raised: those jobs end with an error,
                                                the loop goes on with the next requests

Two runners carry these messages. `ThreadCore` (here) runs the loop in a thread of the API's
own process: tests of the scheduling rules on a scripted backend use it, and it is what
`gptforge serve --engine-process off` runs. `serve.engine_process.ProcessCore` runs the same
loop in a process of its own, which is the server's default: the model's steps and the HTTP
side then no longer take turns on one interpreter lock.

`gptforge.runtime.pause` holds the loop once, after its Nth step (GPTFORGE_PAUSE_AT_STEP, with
GPTFORGE_PAUSE_FILE), while the API side goes on answering.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from gptforge.runtime.pause import PausePoint
from gptforge.serve.scheduler import Job, Sampling, Scheduler

STOP_SECONDS = 20.0  # the stop bound gptforge's stages keep (runtime.signals): the engine gets as long


@dataclass
class Stats:
    """The scheduler's counters after a step, for /metrics and the tests."""

    running: int = 0
    steps: int = 0
    prefilled_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_cache_bytes: int = 0


def stats_of(scheduler: Scheduler) -> Stats:
    cache = scheduler.prefix_cache
    return Stats(
        scheduler.busy_rows,
        scheduler.steps,
        scheduler.prefilled_tokens,
        cache.query_tokens if cache else 0,
        cache.hit_tokens if cache else 0,
        cache.nbytes if cache else 0,
    )


def serve_loop(scheduler: Scheduler, receive: Callable[[bool], list], send: Callable[[tuple], None]) -> None:
    """Run `scheduler` until a "stop" message. `receive(block)` returns the messages waiting
    (blocking for at least one when `block`); `send(message)` hands one back."""
    pause = PausePoint.from_env()
    while True:
        for message in receive(not scheduler.has_work):
            kind = message[0]
            if kind == "add":
                _, job_id, prompt_ids, sampling, stop_ids = message
                scheduler.add(Job(job_id, prompt_ids, Sampling(**sampling), stop_ids))
            elif kind == "cancel":
                scheduler.cancel(message[1])
            elif kind == "stop":
                return
        if not scheduler.has_work:
            continue
        try:
            drawn = scheduler.step()
        except Exception as e:  # a model error ends these requests, not the server
            jobs = scheduler.drop_all()
            send(("failed", [j.id for j in jobs], f"{type(e).__name__}: {e}"))
            continue
        send(("tokens", [(job.id, token) for job, token in drawn], stats_of(scheduler)))
        pause.after(scheduler.steps)


class ThreadCore:
    """The loop in a thread of this process; messages go through a queue one way and the event
    loop's `call_soon_threadsafe` the other."""

    def __init__(self, scheduler: Scheduler, info: dict | None = None):
        self.scheduler, self.info = scheduler, info or {}
        self.max_batch, self.context = scheduler.max_batch, scheduler.context
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(
        self, loop: asyncio.AbstractEventLoop, on_message: Callable[[tuple], None], on_lost: Callable[[str], None]
    ) -> None:
        def receive(block: bool) -> list:
            messages = []
            if block:
                messages.append(self._inbox.get())
            while True:
                try:
                    messages.append(self._inbox.get_nowait())
                except queue.Empty:
                    return messages

        def run() -> None:
            try:
                serve_loop(self.scheduler, receive, lambda m: loop.call_soon_threadsafe(on_message, m))
            except BaseException as e:  # noqa: BLE001 - the thread's end is the engine's end
                loop.call_soon_threadsafe(on_lost, f"the engine thread stopped: {type(e).__name__}: {e}")

        self._thread = threading.Thread(target=run, name="gptforge-engine", daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        self._inbox.put(message)

    async def stop(self) -> None:
        self._inbox.put(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, STOP_SECONDS)

    def kill(self) -> None:
        """Nothing to stop before `start` (the API side's loading failed)."""

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
