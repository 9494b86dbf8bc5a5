"""The outbox (gptforge.runtime.outbox) that carries a run's records to MLflow, against a fake sender.

Order kept, metrics batched, transient failures retried, rejected records dropped and counted,
the bound on what is kept; the flush and close deadlines and the backoff on a virtual clock, so
they are checked exactly whatever the machine's load. The outbox against a real `mlflow server`
that goes away: tests/test_outage_mlflow.py.
"""

from __future__ import annotations

import logging
import threading

from gptforge.runtime.outbox import Outbox


class Transient(Exception):
    pass


class Rejected(Exception):
    pass


def is_transient(e: BaseException) -> bool:
    return isinstance(e, Transient)


class FakeSender:
    """Records what it is sent; `fail` decides per call whether (and how) to fail first. With a
    `gate`, each call sets `entered` and waits for the gate."""

    def __init__(self, fail=None, gate: threading.Event | None = None):
        self.calls: list[tuple[str, list]] = []
        self.attempts = 0
        self.fail = fail or (lambda attempt, kind, payloads: None)
        self.gate = gate
        self.entered = threading.Event()

    def __call__(self, kind, payloads):
        if self.gate is not None:
            self.entered.set()
            self.gate.wait()
        self.attempts += 1
        error = self.fail(self.attempts, kind, payloads)
        if error is not None:
            raise error
        self.calls.append((kind, list(payloads)))

    def sent(self, kind=None):
        return [p for k, ps in self.calls for p in ps if kind in (None, k)]


# A bound against a hang only, for waits that end as soon as the outbox's thread has done its
# part (`flush(HANG)` returns once everything is sent); never a duration that is checked.
HANG = 60


def outbox(sender, **kw) -> Outbox:
    kw.setdefault("backoff", (0.01, 0.05))
    return Outbox(sender, retryable=is_transient, **kw)


class VirtualTime:
    """The outbox's `clock` and `wait` in virtual seconds, so that its deadlines and backoff are
    checked exactly, whatever the machine's load. Each mode lets one side move the clock:

    - skip="flush": the caller's deadline waits (flush and close, on the outbox's condition)
      return at once with the clock moved to their end; the sender's backoff waits (on its
      event) last until the outbox cuts them short (flush, close), as for a server that never
      answers: the sender never moves the clock.
    - skip="backoff": the sender's backoff waits pass at once, the clock moved on by their whole
      length (a poke from flush does not cut them short); the caller's waits last until the
      sender makes progress (a real wait).
    """

    def __init__(self, skip: str) -> None:
        assert skip in ("flush", "backoff")
        self.skip = skip
        self.now = 0.0
        self.deadlines: list[float] = []  # the caller's waits, in seconds
        self.backoffs: list[float] = []  # the sender's waits, in seconds

    def clock(self) -> float:
        return self.now

    def wait(self, waitable, timeout: float) -> bool:
        if isinstance(waitable, threading.Event):  # the sender's backoff
            self.backoffs.append(timeout)
            if self.skip == "flush":
                return waitable.wait(HANG)  # until poked
            self.now += timeout
            return False
        self.deadlines.append(timeout)  # flush's wait for progress, on the outbox's condition
        if self.skip == "backoff":
            return waitable.wait(HANG)  # until the sender makes progress
        waitable.wait(0)  # lets the sender take the lock between two checks, as a real wait does
        self.now += timeout
        return False


# ---------------------------------------------------------------------------------------------
# The outbox against a fake sender


def test_records_go_out_in_order_with_metrics_batched():
    gate = threading.Event()  # hold the sender until everything is queued: batching is then certain
    sender = FakeSender(gate=gate)
    box = outbox(sender, batch=5)
    box.put("params", {"a": "1"}, 1)
    for step in range(12):
        box.put("metric", f"m{step}")
    box.put("tags", {"t": "x"}, 1)
    box.put("metric", "last")
    box.put("end", "FINISHED")
    gate.set()
    assert box.flush(HANG)
    assert sender.sent() == [{"a": "1"}, *[f"m{s}" for s in range(12)], {"t": "x"}, "last", "FINISHED"]
    # Consecutive metrics go together, up to `batch` values; other kinds one at a time.
    assert [(k, len(p)) for k, p in sender.calls] == [
        ("params", 1),
        ("metric", 5),
        ("metric", 5),
        ("metric", 2),
        ("tags", 1),
        ("metric", 1),
        ("end", 1),
    ]
    assert box.close(1) == {} and box.dropped == 0
    assert box.sent == {"params": 1, "metric": 13, "tags": 1, "end": 1}


def test_transient_failures_are_retried_in_order_until_they_pass(caplog):
    down = {"until": 4}  # the first 3 attempts fail: the server is away

    def fail(attempt, kind, payloads):
        return Transient("connection refused") if attempt < down["until"] else None

    sender = FakeSender(fail)
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        box = outbox(sender, label="the fake server")
        for step in range(6):
            box.put("metric", step)
        box.put("artifact", "final")
        assert box.flush(HANG)
    assert sender.sent() == [0, 1, 2, 3, 4, 5, "final"]  # each once, in order
    assert sender.attempts >= 4 and box.dropped == 0 and box.failing_since is None
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "unreachable" in m] == [
        "the fake server is unreachable (Transient: connection refused); keeping what the run logs and retrying"
    ]
    assert sum("reachable again" in m for m in messages) == 1


def test_rejected_records_are_dropped_once_counted_and_the_rest_goes_on(caplog):
    def fail(attempt, kind, payloads):
        return Rejected("invalid value") if "bad" in payloads or {"x": "bad"} in payloads else None

    gate = threading.Event()
    sender = FakeSender(fail, gate=gate)
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        box = outbox(sender, label="the fake server")
        for p in ("m0", "bad", "m2"):  # one batch: only its bad record may be lost
            box.put("metric", p)
        box.put("params", {"x": "bad"}, 3)
        box.put("metric", "m3")
        gate.set()
        assert box.flush(HANG)
    assert sender.sent() == ["m0", "m2", "m3"]
    assert box.rejected == {"metric": 1, "params": 3} and box.dropped == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["the fake server rejected a metric record, dropped (Rejected: invalid value)"]


def test_a_failure_after_close_adds_no_warning_after_the_closing_line(caplog):
    """The request in flight at the close fails afterwards: the owner's closing line already said
    what was left, so the sender says nothing more (it was once seen after the closing line)."""
    gate = threading.Event()
    sender = FakeSender(lambda *a: Transient("refused"), gate=gate)
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        box = outbox(sender)
        box.put("metric", "m0")
        assert sender.entered.wait(HANG)  # the request is in flight, no failure seen yet
        assert box.close(0) == {"metric": 1}
        gate.set()  # now it fails
        box._thread.join(HANG)
    assert not box._thread.is_alive() and sender.attempts == 1
    assert [r.getMessage() for r in caplog.records] == []


def test_a_full_buffer_drops_the_oldest_metrics_and_keeps_the_rest():
    gate = threading.Event()
    sender = FakeSender(gate=gate)  # blocked: nothing leaves until the gate opens
    box = outbox(sender, capacity=10, batch=1)
    box.put("metric", "m0")
    assert sender.entered.wait(HANG)  # the thread holds m0 at the gate
    box.put("params", {"p": 1, "q": 2}, 2)
    for i in range(1, 20):
        box.put("metric", f"m{i}")
    box.put("tags", {"t": 1}, 1)
    assert box.pending() <= 11  # the bound (10 values) plus nothing but the in-flight record
    gate.set()
    assert box.flush(HANG)
    sent = sender.sent()
    # m0 was in flight, the params and tags are kept; the oldest queued metrics made room.
    assert sent[:2] == ["m0", {"p": 1, "q": 2}] and sent[-1] == {"t": 1}
    metrics = sent[2:-1]
    assert metrics == [f"m{i}" for i in range(20 - len(metrics), 20)] and len(metrics) == 6
    assert box.overflowed == {"metric": 13} and box.dropped == 13


def test_flush_and_close_honour_their_deadlines():
    sender = FakeSender(lambda *a: Transient("refused"))  # a server that never comes back
    virtual = VirtualTime(skip="flush")
    box = outbox(sender, backoff=(1.0, 10.0), clock=virtual.clock, wait=virtual.wait)
    for step in range(5):
        box.put("metric", step)
    box.put("artifact", "final", 1)
    assert box.flush(30) is False
    assert virtual.now == 30 and virtual.deadlines == [30]  # it waited its whole deadline, once
    box.put("end", "FINISHED")
    assert box.close(5) == {"metric": 5, "artifact": 1, "end": 1}
    assert virtual.now == 30 + 5 and virtual.deadlines == [30, 5]
    # Closed: the sender stops retrying. Its thread ends (HANG only bounds a regression's wait).
    box._thread.join(HANG)
    assert not box._thread.is_alive()
    attempts = sender.attempts
    box.put("metric", 9)  # after close: ignored
    assert box.pending() == 6 + 1 and sender.attempts == attempts


def test_backoff_doubles_up_to_its_cap_and_starts_over_after_a_success(caplog):
    failing = {1, 2, 3, 4, 5, 7, 8}  # 5 failed tries, a success, 2 failed tries, a success
    gate = threading.Event()  # both records queued before the first try: the counts below are certain
    sender = FakeSender(lambda attempt, kind, payloads: Transient("refused") if attempt in failing else None, gate)
    virtual = VirtualTime(skip="backoff")
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        box = outbox(sender, backoff=(1.0, 10.0), clock=virtual.clock, wait=virtual.wait, label="the fake server")
        box.put("metric", 0)
        box.put("params", {"a": "1"}, 1)  # another kind: sent on its own, after the metric
        gate.set()
        assert box.flush(HANG)  # a virtual deadline beyond the 28 s of backoff below
    assert sender.attempts == 9 and sender.sent() == [0, {"a": "1"}]
    assert virtual.backoffs == [1.0, 2.0, 4.0, 8.0, 10.0, 1.0, 2.0] and virtual.now == 28
    assert [r.getMessage() for r in caplog.records if "reachable" in r.getMessage()] == [
        "the fake server is unreachable (Transient: refused); keeping what the run logs and retrying",
        "the fake server is reachable again after 25 s; sending the 2 records kept meanwhile",
        "the fake server is unreachable (Transient: refused); keeping what the run logs and retrying",
        "the fake server is reachable again after 3 s; sending the 1 records kept meanwhile",
    ]
