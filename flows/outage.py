"""A Prefect API that goes away mid-run never costs the run; what it could not record is said.

A GPT-2 run lasts hours to days; a restart of the Prefect server in that time must not fail a
stage whose work is done, nor flood its console. What Prefect does by itself, measured here
(Prefect 3.8, `prefect server start` SIGKILLed during a pretrain run and started again 30 s later
on the same port and database):

- task runs report their states as events over a websocket, off the training thread; an event
  that cannot be sent is kept as unconfirmed and sent again when the client reconnects, but
  Prefect logs each failed try as an ERROR line holding the whole event (kilobytes);
- flow-run state changes and artifacts are API calls that Prefect retries with backoff for
  about a minute (2 + 4 + 8 + 16 + 32 s) once it has reached the server: a 30 s restart is
  ridden out, a longer outage makes the call raise, and the stage failed on it.

Here, for the flows that run in Prefect's engine (deployments on a worker): the failed-event
lines and log batches are counted instead of printed (`UNRECORDED`), a stage (or the pipeline)
whose work finished returns its result even when its final state cannot be recorded, and
artifacts and the pipeline's subflow bookkeeping are best effort. Commands typed in a shell do
not meet any of this: their records go through journals (docs/records.md), which a server that
is away only delays.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

log = logging.getLogger("gptforge")

T = TypeVar("T")


class Unrecorded:
    """What could not be sent to the Prefect API in this process, by kind."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def __bool__(self) -> bool:
        return bool(self.counts)

    def summary(self) -> str:
        return ", ".join(f"{n} {what}" for what, n in self.counts.items())


UNRECORDED = Unrecorded()


class _FailedEvents(logging.Filter):
    """On Prefect's service logger: counts "Service 'EventsWorker' failed to process item ..."
    records (each holds a whole event) instead of showing them. On its events client's logger:
    the "Unable to connect" warning, repeated every few seconds of an outage, shown once."""

    def __init__(self) -> None:
        super().__init__()
        self.connect_warnings = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Unable to connect to"):
            self.connect_warnings += 1
            return self.connect_warnings == 1
        if not str(record.msg).startswith("Service %r failed to process item"):
            return True
        service = record.args[0] if isinstance(record.args, tuple) and record.args else "a Prefect service"
        UNRECORDED.add("events not confirmed when sent" if service == "EventsWorker" else f"{service} items")
        return False


def watch_prefect_records() -> None:
    """Install the counting filter and log-batch counter (once per process)."""
    counting = _FailedEvents()
    for name in ("prefect._internal.concurrency", "prefect.events.clients"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _FailedEvents) for f in logger.filters):
            logger.addFilter(counting)
    _count_unsent_logs()


def _count_unsent_logs() -> None:
    """Prefect's log worker writes "--- Error logging to API ---" and the reason straight to
    stderr for every batch of log lines it cannot send (every couple of seconds of an outage).
    Its send is wrapped here to count the lines instead; other failures go on as before."""
    from prefect.logging.handlers import APILogWorker

    send = APILogWorker._handle_batch
    if getattr(send, "gptforge_counted", False):
        return

    async def counted(self, items):
        try:
            await self._client.create_logs(items)
        except Exception as e:
            if not api_unreachable(e):
                return await send(self, items)
            UNRECORDED.add("log lines", len(items))

    counted.gptforge_counted = True
    APILogWorker._handle_batch = counted


def api_unreachable(error: BaseException) -> bool:
    """Whether `error` says the Prefect API could not be reached or answered with a server error
    (as opposed to a failure of the work itself)."""
    import httpx

    if isinstance(error, (httpx.TransportError, ConnectionError)):
        return True
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    return type(error).__name__ == "PrefectHTTPStatusError" and isinstance(status, int) and status >= 500


def best_effort(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """Call `fn`, a recording call (an artifact, a state); when the API cannot be reached, count
    `what` as unrecorded and go on."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        if not api_unreachable(e):
            raise
        UNRECORDED.add(what)
        return None


class Finished:
    """The result of a flow function, kept when it returns, so that a failure to record the
    flow run's final state afterwards cannot turn a finished stage into a failed one."""

    def __init__(self) -> None:
        self.done = False
        self.result: Any = None
        self.flow_run_id: str | None = None

    def keep(self, result: T) -> T:
        self.done, self.result = True, result
        return result


def run_recorded(call: Callable[[], T], finished: Finished, what: str) -> T:
    """`call()` (a flow run); when it raises because the API is unreachable after the flow
    function has returned (`finished`), return that result and count the final state of `what`
    as unrecorded."""
    try:
        return call()
    except Exception as e:
        if not (finished.done and api_unreachable(e)):
            raise
        UNRECORDED.add(f"final state of {what}")
        return finished.result
