"""An in-order outbox: records are queued by the caller and sent by one daemon thread.

A GPT-2 run takes hours; the tracking server it logs to may restart in the middle. The caller
(the training loop) must never wait on that server, and what it logs while the server is away
must arrive once it is back. So `put` only appends to a queue, and a background thread sends
the records in the order they were put. A failure that retrying can fix (the server unreachable,
a timeout, HTTP 5xx/429: the `retryable` predicate decides) keeps the records at the head of the
queue and retries them with a capped exponential backoff; any other failure drops the records
that caused it (with one warning) and goes on. The queue is bounded: beyond `capacity` values
(one metric, param, tag or artifact each), the oldest queued metric records are dropped and
counted; params, tags and artifacts are few, and worth more than one old loss value.

This module knows nothing of MLflow: `send(kind, payloads)` does the work, and receives
consecutive records of one kind together (for kinds in `batched`, as many as hold at most
`batch` values in all: MLflow takes 1000 metrics a request), so a backlog of a training loop's
metrics goes out in few requests.

Time comes from `clock` and waits go through `wait` (`time.monotonic` and the waitable's own
`wait(timeout)` by default): a test passes virtual ones to check the deadlines and the backoff
exactly, whatever the machine's load.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

log = logging.getLogger("gptforge")


def _wait(waitable: threading.Condition | threading.Event, timeout: float) -> bool:
    return waitable.wait(timeout)


@dataclass
class Record:
    kind: str
    payload: Any
    size: int = 1  # how many values it carries (a params record holds many), for the counts


class Outbox:
    """Queue records with `put`; a daemon thread sends them in order. `flush(timeout)` waits
    (bounded) until everything queued is sent or dropped; `close(timeout)` flushes, then stops
    the thread and returns what is left unsent, by kind (counted in values, see Record.size)."""

    def __init__(
        self,
        send: Callable[[str, list], None],
        *,
        retryable: Callable[[BaseException], bool],
        capacity: int = 100_000,
        batch: int = 1000,  # values per send, for batched kinds
        batched: Iterable[str] = ("metric",),
        backoff: tuple[float, float] = (1.0, 10.0),
        label: str = "the server",  # names the receiver in warnings
        describe: Callable[[BaseException], str] | None = None,  # a failure in a few words
        name: str = "gptforge-outbox",
        clock: Callable[[], float] = time.monotonic,  # `failing_since` is on its scale
        wait: Callable[[threading.Condition | threading.Event, float], bool] = _wait,
    ) -> None:
        self._send = send
        self._retryable = retryable
        self.capacity = capacity
        self.batch = batch
        self._batched = frozenset(batched)
        self._backoff = backoff
        self.label = label
        self._clock, self._wait = clock, wait
        self._describe = describe or (lambda e: " ".join(f"{type(e).__name__}: {e}".split())[:300])
        self._queue: collections.deque[Record] = collections.deque()
        self._inflight: list[Record] = []  # taken from the queue's head; removed once sent or dropped
        self._split = False  # a batch was rejected: send its records one by one to drop only the bad one
        self._cond = threading.Condition()
        self._poke = threading.Event()  # cuts a backoff wait short (flush, close)
        self._closed = False
        self._values = 0  # values queued or in flight, held under `capacity`
        self.sent: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()  # non-retryable failures
        self.overflowed: collections.Counter[str] = collections.Counter()  # dropped when full
        self.failing_since: float | None = None  # `clock` time of the first failure of an outage
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------

    def put(self, kind: str, payload: Any, size: int = 1) -> None:
        """Queue one record; never blocks on the sender. Ignored after close."""
        with self._cond:
            if self._closed:
                return
            while self._values + size > self.capacity and self._drop_oldest_metric():
                pass
            self._queue.append(Record(kind, payload, size))
            self._values += size
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + len(self._inflight)

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until every record queued so far is sent or dropped.
        True when nothing is left. A sender in its backoff is woken to try again now."""
        deadline = self._clock() + max(0.0, timeout)
        self._poke.set()
        with self._cond:
            while self._queue or self._inflight:
                left = deadline - self._clock()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._wait(self._cond, left)
            return True

    def close(self, timeout: float) -> dict[str, int]:
        """Flush (bounded by `timeout`), then stop sending. Returns the values left unsent, by
        kind (empty when all went out). The thread is a daemon: one stuck in a request does
        not hold the process up."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            left: collections.Counter[str] = collections.Counter()
            for r in [*self._inflight, *self._queue]:
                left[r.kind] += r.size
            self._cond.notify_all()
        self._poke.set()
        return dict(left)

    @property
    def dropped(self) -> int:
        """Values dropped so far: rejected by the server, or pushed out of a full queue."""
        with self._cond:
            return sum(self.rejected.values()) + sum(self.overflowed.values())

    # -- the sending thread -----------------------------------------------------------------

    def _drop_oldest_metric(self) -> bool:
        for i, r in enumerate(self._queue):  # the head is a metric in any long backlog: O(1) there
            if r.kind in self._batched:
                del self._queue[i]
                if not sum(self.overflowed.values()):
                    log.warning(
                        "%d values wait for %s: dropping the oldest metrics from now on (counted)",
                        self.capacity,
                        self.label,
                    )
                self.overflowed[r.kind] += r.size
                self._values -= r.size
                return True
        # Only params/tags/artifacts queued: they are few by nature, keep them over the bound.
        return False

    def _take(self) -> list[Record]:
        """The records to send next (under the lock): the in-flight group, else a new one from
        the queue's head: consecutive records of a batched kind, or one record."""
        if not self._inflight:
            first = self._queue.popleft()
            group = [first]
            if first.kind in self._batched:
                total = first.size
                while self._queue and self._queue[0].kind == first.kind and total + self._queue[0].size <= self.batch:
                    total += self._queue[0].size
                    group.append(self._queue.popleft())
            self._inflight = group
        return self._inflight[:1] if self._split else list(self._inflight)

    def _done(self, group: list[Record]) -> None:
        del self._inflight[: len(group)]
        self._values -= sum(r.size for r in group)
        if not self._inflight:
            self._split = False
        self._cond.notify_all()

    def _run(self) -> None:
        delay = self._backoff[0]
        while True:
            with self._cond:
                while not (self._queue or self._inflight) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                group = self._take()
            kind = group[0].kind
            started = self._clock()
            try:
                self._send(kind, [r.payload for r in group])
            except Exception as e:  # noqa: BLE001 - every failure is either retried or dropped and counted
                reason = self._describe(e)
                if self._retryable(e):
                    with self._cond:
                        # Once closed, the owner's closing line has said what is left: no retry
                        # is coming, and a warning after it would not be the last word.
                        if self.failing_since is None and not self._closed:
                            self.failing_since = started
                            log.warning(
                                "%s is unreachable (%s); keeping what the run logs and retrying", self.label, reason
                            )
                        self.last_error = reason
                    self._wait(self._poke, delay)
                    self._poke.clear()
                    delay = min(delay * 2, self._backoff[1])
                    continue
                with self._cond:
                    if len(group) > 1:  # one bad record must not cost its whole batch: retry them singly
                        self._split = True
                        continue
                    if not sum(self.rejected.values()):
                        log.warning("%s rejected a %s record, dropped (%s)", self.label, kind, reason)
                    else:
                        log.debug("%s rejected a %s record, dropped (%s)", self.label, kind, reason)
                    self.rejected[kind] += group[0].size
                    self._done(group)
                continue
            with self._cond:
                if self.failing_since is not None:
                    log.warning(
                        "%s is reachable again after %.0f s; sending the %d records kept meanwhile",
                        self.label,
                        self._clock() - self.failing_since,
                        len(self._queue) + len(self._inflight),
                    )
                    self.failing_since = None
                self.sent[kind] += sum(r.size for r in group)
                self._done(group)
            delay = self._backoff[0]
