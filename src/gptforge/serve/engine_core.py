"""Where the scheduler (`serve.scheduler`) runs: one engine step, its loop, and the in-process
runner of the loop.

`step` is vLLM V1's EngineCore.step: the scheduler's plan, the backend's forward over it (or its
greedy decode of a lone row), the sampler on the logits of the rows that draw
(`serve.sampling.pick_tokens`), and the tokens back to the scheduler. The loop takes the API
side's messages (`serve.messages`: `Add` a job, `Cancel` one, `Stop`), runs a step whenever there
is work, and sends back `Drawn` (each job's token and the `Stats`) after every step, or `Failed`
when a step raised (those jobs end with an error; the loop goes on with the next requests).

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
from typing import Callable

from gptforge.runtime.pause import PausePoint
from gptforge.serve.messages import Add, Cancel, Drawn, Failed, Ready, Stats, Stop
from gptforge.serve.sampling import pick_tokens
from gptforge.serve.scheduler import Job, Plan, Scheduler

STOP_SECONDS = 20.0  # the stop bound gptforge's stages keep (runtime.signals): the engine gets as long


def step(scheduler: Scheduler) -> list[tuple[Job, int]]:
    """One engine step: schedule, run the model, sample, update. The tokens drawn, by job."""
    plan = scheduler.schedule()
    if not plan.segments:
        return []
    return scheduler.update(plan, execute(scheduler.backend, plan))


def execute(backend, plan: Plan) -> list[int]:
    """The plan run on `backend`: the next token of each drawing job, in `plan.drawing`'s order
    (a plan with a draft: its one job's verified tokens)."""
    if plan.lone_greedy_decode:  # one greedy row: no logits needed
        if plan.draft:  # its drafted tokens verified in the same forward: one token or several
            return backend.decode_greedy_draft(plan.segments[0][1][0], plan.draft)
        return [backend.decode_greedy(plan.segments[0][1][0])]
    logits = backend.forward(plan.segments)
    if not plan.drawing:
        return []
    picked = logits if len(plan.drawing_segments) == len(plan.segments) else logits[plan.drawing_segments]
    return pick_tokens(picked, plan.drawing)


def stats_of(scheduler: Scheduler) -> Stats:
    cache = scheduler.prefix_cache
    return Stats(
        scheduler.busy_rows,
        scheduler.steps,
        scheduler.prefilled_tokens,
        cache.query_tokens if cache else 0,
        cache.hit_tokens if cache else 0,
        cache.nbytes if cache else 0,
        scheduler.drafted_tokens,
        scheduler.accepted_tokens,
    )


def serve_loop(scheduler: Scheduler, receive: Callable[[bool], list], send: Callable[[object], None]) -> None:
    """Run `scheduler` until a `Stop` message. `receive(block)` returns the messages waiting
    (blocking for at least one when `block`); `send(message)` hands one back."""
    pause = PausePoint.from_env()
    while True:
        for message in receive(not scheduler.has_work):
            if isinstance(message, Add):
                scheduler.add(Job(message.job_id, message.prompt_ids, message.sampling, message.stop_ids))
            elif isinstance(message, Cancel):
                scheduler.cancel(message.job_id)
            elif isinstance(message, Stop):
                return
        if not scheduler.has_work:
            continue
        try:
            drawn = step(scheduler)
        except Exception as e:  # a model error ends these requests, not the server
            jobs = scheduler.drop_all()
            send(Failed([j.id for j in jobs], f"{type(e).__name__}: {e}"))
            continue
        send(Drawn([(job.id, token) for job, token in drawn], stats_of(scheduler)))
        pause.after(scheduler.steps)


class ThreadCore:
    """The loop in a thread of this process; messages go through a queue one way and the event
    loop's `call_soon_threadsafe` the other."""

    def __init__(self, scheduler: Scheduler, info: Ready | None = None):
        self.scheduler, self.info = scheduler, info
        self.max_batch, self.context = scheduler.max_batch, scheduler.context
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(
        self, loop: asyncio.AbstractEventLoop, on_message: Callable[[object], None], on_lost: Callable[[str], None]
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

    def send(self, message) -> None:
        self._inbox.put(message)

    async def stop(self) -> None:
        self._inbox.put(Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, STOP_SECONDS)

    def kill(self) -> None:
        """Nothing to stop before `start` (the API side's loading failed)."""

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
