"""An MLflow server that goes away under a run must not cost the run.

- The outbox (gptforge.runtime.outbox) against a fake sender: order kept, transient failures retried,
  rejected records dropped and counted, the bound; the flush deadline and the backoff on a
  virtual clock.
- Which MLflow failures are worth retrying (gptforge.runtime.tracking.retryable).
- A server down at the start is a one-line error; a server gone at the end costs a bounded
  wait, a warning, and leaves MLflow's fluent state clean (its atexit end_run does nothing).
- `gptforge pretrain` logging every step to a real `mlflow server` that is SIGKILLed while the
  run is held after a step (gptforge.runtime.pause), stays down while the run trains on to its end, then
  is restarted on the same port and store: the run exits 0, its final weights equal an untracked
  run's bit for bit, and the MLflow run is FINISHED with every step's train loss, those logged
  during the outage included. A server that never comes back: exit 0, and the
  last warning names what could not be recorded, within the flush bound.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import BIN, Paused, cli_env, free_port, records_delivered, run_cli, set_params, stage_params, wait_http
from gptforge.runtime import tracking
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
    assert [(k, len(p)) for k, p in sender.calls] == [("params", 1), ("metric", 5), ("metric", 5), ("metric", 2),
                                                      ("tags", 1), ("metric", 1), ("end", 1)]
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
        "the fake server is unreachable (Transient: connection refused); keeping what the run logs and retrying"]
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
        "the fake server is reachable again after 3 s; sending the 1 records kept meanwhile"]


# ---------------------------------------------------------------------------------------------
# What is worth retrying


def test_retryable_failures_of_mlflow_requests():
    import requests
    from mlflow.exceptions import MlflowException, RestException

    def wrapped(inner: BaseException) -> MlflowException:
        """As mlflow.utils.rest_utils.http_request raises it: inside `except`, so the requests
        error is the context."""
        try:
            try:
                raise inner
            except Exception as e:
                raise MlflowException(f"API request to http://x/api failed with exception {e}")
        except MlflowException as outer:
            return outer

    def response(status: int) -> requests.Response:
        r = requests.Response()
        r.status_code = status
        return r

    assert tracking.retryable(wrapped(requests.ConnectionError("[Errno 111] Connection refused")))
    assert tracking.retryable(wrapped(requests.exceptions.ReadTimeout("read timed out")))
    assert tracking.retryable(wrapped(requests.exceptions.RetryError("too many 503 error responses")))
    assert tracking.retryable(ConnectionResetError(104, "reset"))
    assert tracking.retryable(RestException({"error_code": "INTERNAL_ERROR", "message": "db locked"}))
    assert tracking.retryable(RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "x"}))
    assert tracking.retryable(RestException({"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "x"}))
    assert tracking.retryable(requests.HTTPError("bad gateway", response=response(502)))
    assert not tracking.retryable(RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "x"}))
    assert not tracking.retryable(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "x"}))
    assert not tracking.retryable(requests.HTTPError("not found", response=response(404)))
    assert not tracking.retryable(FileNotFoundError("final/model.safetensors"))
    assert not tracking.retryable(ValueError("x"))
    assert tracking.describe_failure(wrapped(requests.ConnectionError(
        "HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded (Caused by NewConnectionError("
        "\"...: Failed to establish a new connection: [Errno 111] Connection refused\"))"))) == \
        "[Errno 111] Connection refused (MlflowException)"


def test_flush_seconds(monkeypatch, caplog):
    monkeypatch.delenv(tracking.FLUSH_ENV, raising=False)
    assert tracking.flush_seconds() == 30
    monkeypatch.setenv(tracking.FLUSH_ENV, "2.5")
    assert tracking.flush_seconds() == 2.5
    monkeypatch.setenv(tracking.FLUSH_ENV, "soon")
    assert tracking.flush_seconds() == 30 and "is not a number of seconds" in caplog.text


class FakeClient:
    """MlflowClient's methods that MlflowRun._send calls; a param valued "bad" is refused as
    the server refuses a changed param (HTTP 400)."""

    def __init__(self, uri=None):
        self.calls = []

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        from mlflow.exceptions import RestException

        if any(p.value == "bad" for p in params):
            raise RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "Changing param values"})
        self.calls.append(("batch", [m.key for m in metrics], {p.key: p.value for p in params},
                           {t.key: t.value for t in tags}))

    def set_terminated(self, run_id, status):
        self.calls.append(("end", status))


def test_a_run_that_lost_records_says_so_and_gets_the_dropped_tag(caplog):
    client = FakeClient()

    class FakeMlflow:
        class tracking:
            MlflowClient = staticmethod(lambda uri: client)

    info = type("Run", (), {"info": type("Info", (), {"run_id": "r" * 32})})()
    run = tracking.MlflowRun(FakeMlflow, info, uri="http://127.0.0.1:1", buffered=True)
    run.log_params({"a": 1, "lr": "bad"})
    run.log_metrics({"train_loss": 1.0, "acc,none": 0.5}, step=1)
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        run.end("FINISHED", timeout=10)
    assert client.calls == [("batch", ["train_loss", "acc_none"], {}, {}),
                            ("batch", [], {}, {tracking.DROPPED_TAG: "2"}), ("end", "FINISHED")]
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings[0].startswith("MLflow server at http://127.0.0.1:1 rejected a params record, dropped (")
    assert warnings[-1] == (f"MLflow: run {'r' * 32} is recorded but 2 params rejected by the server "
                            f"(tag {tracking.DROPPED_TAG})")


def test_a_request_still_in_flight_at_the_end_is_said_so(caplog):
    """The server took the request and never answered (or MLflow's own retries still run): no
    failure was seen, so the line says the server did not answer, with what was not recorded."""
    gate = threading.Event()
    client = FakeClient()
    client.log_batch = lambda *a, **kw: gate.wait()  # held until the test ends

    class FakeMlflow:
        class tracking:
            MlflowClient = staticmethod(lambda uri: client)

    info = type("Run", (), {"info": type("Info", (), {"run_id": "r" * 32})})()
    run = tracking.MlflowRun(FakeMlflow, info, uri="http://127.0.0.1:1", buffered=True)
    run.log_metrics({"train_loss": 1.0}, step=1)
    try:
        with caplog.at_level(logging.WARNING, logger="gptforge"):
            run.end("FINISHED", timeout=1)
    finally:
        gate.set()
    assert caplog.records[-1].getMessage() == (
        f"MLflow: run {'r' * 32} could not record 1 metric and its status FINISHED: the server at "
        "http://127.0.0.1:1 did not answer (waited 1 s; a request was still in flight)")


# ---------------------------------------------------------------------------------------------
# A real server that is away at the start or at the end


class MlflowServer:
    """`mlflow server` on one loopback port, with one SQLite store and artifacts folder, that
    can be SIGKILLed (its whole process group: the uvicorn and job workers too) and started
    again on the same port and store, as a restarted tracking server would be."""

    def __init__(self, folder: Path, migrated_db: str):
        self.folder = folder
        folder.mkdir(parents=True)
        shutil.copy(migrated_db, folder / "mlflow.db")  # migrations cost ~7 s: copy a migrated one
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = open(folder / "server.log", "a")

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db",
             "--artifacts-destination", str(self.folder / "artifacts")],
            cwd=self.folder, env=cli_env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(f"{self.url}/health", timeout=120, proc=self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # Its workers are in the same group; wait until the port is free again.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                wait_http(f"{self.url}/health", timeout=0.1)
            except (TimeoutError, RuntimeError):
                return
            time.sleep(0.2)

    def close(self) -> None:
        self.kill()
        self.log.close()

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.url)


@pytest.fixture
def server(tmp_path, mlflow_uri):
    srv = MlflowServer(tmp_path / "mlflow-server", mlflow_uri[len("sqlite:///"):])
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def quick_http(monkeypatch):
    """MLflow's per-request retries off: each failed request gives up at once (the defaults
    tracking sets, 3 retries with backoff, would cost ~7 s per request to a dead server)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    for name in ("GPTFORGE_PARENT_RUN_ID", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)


def test_a_server_down_at_the_start_is_a_one_line_error(monkeypatch, quick_http):
    from gptforge.errors import StageFailed

    import mlflow.tracking  # noqa: F401 - imported before the clock starts: its import is not the point

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    t0 = time.monotonic()
    with pytest.raises(StageFailed) as info:
        with tracking.start_run(enabled=True, experiment="down", stage="pretrain"):
            pytest.fail("the body must not run")
    took = time.monotonic() - t0
    print(f"a start against a closed port failed in {took:.2f} s")
    # A bound against a hang only: a refused connection fails at once (well under a second
    # here, even on a loaded machine); a start that retried, as MLflow's own retries would, takes minutes.
    assert took < 30, took
    message = str(info.value)
    assert message.startswith(f"MLflow tracking server at {url} is unreachable; start it, or set "
                              "tracking.enabled=false (") and "\n" not in message


@pytest.mark.slow
def test_a_stopped_run_with_its_server_gone_waits_a_bounded_time_and_leaves_mlflow_clean(server, monkeypatch,
                                                                                         quick_http, caplog, tmp_path):
    """Ctrl-C (or SIGTERM, as a stop request) while the server is away: the run ends within its
    bound, says what it could not record, and MLflow's fluent state is clean. (A normal end with
    the server away is the CLI test below; the bounds for each status are checked above.)"""
    import mlflow
    from mlflow.tracking import fluent

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    monkeypatch.setenv(tracking.FLUSH_ENV, "3")
    (tmp_path / "report.md").write_text("# report\n")
    caplog.set_level(logging.WARNING, logger="gptforge")
    ended = {}
    with pytest.raises(KeyboardInterrupt):
        with tracking.start_run(enabled=True, experiment="gone", stage="pretrain", params={"a": 1},
                                system_metrics=True) as run:
            run.log_metrics({"train_loss": 2.0}, step=1)
            assert run.flush(30)  # the server is up: sent
            server.kill()
            run.log_metrics({"train_loss": 1.5, "lr": 0.1}, step=2)
            run.log_text("sample", "samples/final.txt")
            run.log_artifact(tmp_path / "report.md")
            run.set_tags({"t": "x"})
            ended["t0"] = time.monotonic()
            raise KeyboardInterrupt
    took = time.monotonic() - ended["t0"]
    print(f"the stopped run ended {took:.1f} s after its stop (bound 3 s)")
    # It waited its whole bound (3 s: flush's deadline is on the monotonic clock, so never
    # less), and not much more: what comes after the bound is the sampler's stop and one warning,
    # well under a second here; 10 s of room for a loaded machine. A run that ignored its bound
    # would wait 30 s (the default), one stuck in MLflow's retries minutes. (KILLED waits at most
    # 5 s even with a larger bound: test_a_killed_run_waits_at_most_five_seconds.)
    assert 2.99 <= took < 3 + 10, took
    [line] = [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()]
    assert line.startswith(f"MLflow: run {run.run_id} could not record 2 metrics, 1 tag, 2 artifacts and its status "
                           f"KILLED: the server at {server.url} was unreachable for the last "), line
    assert line.endswith("(waited 3 s; last error: [Errno 111] Connection refused (MlflowException))"), line
    # MLflow's fluent state is clean: no active run, and its atexit end_run has nothing to do
    # (with the run still on its stack it would ask the dead server to end it, and could
    # overwrite the status sent through the outbox).
    assert mlflow.active_run() is None and fluent._active_run_stack.get() == []
    terminated = []
    monkeypatch.setattr(fluent.MlflowClient, "set_terminated", lambda self, *a, **kw: terminated.append(a))
    fluent._safe_end_run()
    assert terminated == []


def test_a_killed_run_waits_at_most_five_seconds(monkeypatch):
    monkeypatch.setenv(tracking.FLUSH_ENV, "60")
    waits = []

    class Run(tracking.MlflowRun):
        def __init__(self):
            self.failed = False
            self.run_id = "r"

        def _submit(self, kind, payload, size=1):
            pass

        def end(self, status, timeout):
            waits.append((status, timeout))

    monkeypatch.setattr(tracking, "_import_mlflow", lambda: _FakeMlflow)
    monkeypatch.setattr(tracking, "MlflowRun", lambda *a, **kw: Run())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    with pytest.raises(KeyboardInterrupt), tracking.start_run(enabled=True, experiment="e", stage="s"):
        raise KeyboardInterrupt
    with pytest.raises(ValueError), tracking.start_run(enabled=True, experiment="e", stage="s"):
        raise ValueError
    with tracking.start_run(enabled=True, experiment="e", stage="s"):
        pass
    assert waits == [("KILLED", 5.0), ("FAILED", 60.0), ("FINISHED", 60.0)]


class _FakeMlflow:
    """What start_run reaches of mlflow, for the wait bounds alone."""

    @staticmethod
    def set_tracking_uri(uri):
        pass

    @staticmethod
    def get_experiment_by_name(name):
        return object()

    @staticmethod
    def set_experiment(name):
        pass

    @staticmethod
    def start_run(**kw):
        return None


# ---------------------------------------------------------------------------------------------
# `gptforge pretrain` through a server restart


def _prepared_repo(repo: Path, params: dict, env: dict) -> None:
    set_params(repo, **params)
    out = run_cli(["prepare", "pretrain", "-S", "tracking.enabled=false"], repo, env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def _pretrain(repo: Path, env: dict, log: Path, *extra: str) -> subprocess.Popen:
    """`gptforge pretrain` with its output in `log` (a file: read while it runs, never a full pipe)."""
    with open(log, "w") as f:
        return subprocess.Popen([str(BIN / "gptforge"), "pretrain", *extra], cwd=repo, env=env, stdout=f,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _the_run(client, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], "tags.`gptforge.stage` = 'pretrain'") if exp else []
    return runs[0] if runs else None


def _logged_steps(client, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "train_loss"))


def _until(condition, proc: subprocess.Popen, log: Path, what: str, timeout: float = 300):
    """Wait for `condition()` (a truthy value, returned) while `proc` runs. The timeout is a bound
    against a hang only: under load each step here may take many times its idle time."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert proc.poll() is None, f"pretrain ended (exit {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return found


def _paused_with_steps_sent(paused: Paused, proc: subprocess.Popen, log: Path, client) -> str:
    """Wait until the run is paused after step `paused.step` and the server has steps 1..step;
    returns the MLflow run id."""
    paused.wait(proc, output=log.read_text)
    run_id = _until(lambda: (r := _the_run(client, "outage")) and r.info.run_id, proc, log, "the MLflow run")
    _until(lambda: _logged_steps(client, run_id) == list(range(1, paused.step + 1)), proc, log,
           f"steps 1..{paused.step} on the server")
    return run_id


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


OUTAGE_PRETRAIN = {"pretrain.batch_tokens": 1024, "pretrain.log_interval": 1, "pretrain.eval_interval": 500,
                   "pretrain.ckpt_interval": 1000, "pretrain.keep_last": 1, "model.dropout": 0.1,
                   "tracking.enabled": True, "tracking.experiment": "outage"}


@pytest.mark.slow
def test_pretrain_survives_a_tracking_server_restart(tmp_path, repo_copy, small_tokenizer, sms_file, alpaca_file,
                                                      server):
    """The run is paused after step `cut` with steps 1..cut on the server (the recorder delivered
    them from the stage's journal); the server is killed, then the run goes on: steps cut+1..steps
    are journaled while the server is down, by construction, and the stage ends without waiting
    for it. The server is started again once the run trained; the recorder delivers the rest."""
    steps, cut, sampling = 200, 50, 1
    params = {**stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file), **OUTAGE_PRETRAIN,
              "pretrain.max_steps": steps}
    paused = Paused(tmp_path, cut)
    # The stage does not wait for its records (GPTFORGE_WAIT_FOR_RECORDS=0, a user's default).
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=server.url,
                  MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL=str(sampling), GPTFORGE_WAIT_FOR_RECORDS="0")
    _prepared_repo(repo_copy, params, env)
    reference = tmp_path / "reference"
    shutil.copytree(repo_copy, reference)

    client = server.client()
    log = tmp_path / "pretrain.log"
    started = time.monotonic()
    proc = _pretrain(repo_copy, {**env, **paused.env()}, log)
    straight = None
    try:
        run_id = _paused_with_steps_sent(paused, proc, log, client)
        server.kill()
        down = time.monotonic(), time.time()
        # The undisturbed run, while the disturbed one is paused (never two trainings at once).
        t0 = time.monotonic()
        straight = _pretrain(reference, cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1"), tmp_path / "reference.log",
                             "-S", "tracking.enabled=false")
        assert straight.wait(timeout=600) == 0, (tmp_path / "reference.log").read_text()[-3000:]
        untracked = time.monotonic() - t0
        # The system-metrics sampler publishes every `sampling` s on its own thread: the server
        # stays down, the run paused, for 3 of its periods at least, so some samples fall in the outage.
        time.sleep(max(0.0, 3 * sampling - (time.monotonic() - down[0])))
        paused.release()
        proc.wait(timeout=300)  # it trained and journaled its last records: it does not wait for the server
        assert list((repo_copy / ".gptforge" / "records").glob("*.jsonl")), "delivered with the server down?"
        server.start()
        up = time.time()
        records_delivered(repo_copy)  # the recorder retries within its backoff's cap (30 s)
    finally:
        for p in (proc, straight):
            if p is not None:
                _stop(p)
    ran = time.monotonic() - started
    err = log.read_text()
    assert proc.returncode == 0, err[-3000:]
    assert "MLflow" not in err and "Traceback" not in err, err[-3000:]  # the outage was the recorder's business
    recorder_log = (repo_copy / ".gptforge" / "recorder" / "recorder.log").read_text()
    assert "unreachable" in recorder_log and "skipped" not in recorder_log, recorder_log[-3000:]

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert tracking.DROPPED_TAG not in run.data.tags
    history = client.get_metric_history(run_id, "train_loss")
    # Every step, each once (and step 0: the stage's final metrics, logged without a step).
    assert sorted(m.step for m in history if m.step) == list(range(1, steps + 1))
    # Metrics keep the time they were logged at (whole milliseconds, rounded down): steps 1..cut
    # before the kill, every later one in the outage, so kept and sent once the server was back.
    down_ms, up_ms = down[1] * 1000, up * 1000
    assert sorted(m.step for m in history if m.step and m.timestamp < down_ms) == list(range(1, cut + 1))
    during = sorted(m.step for m in history if m.step and int(down_ms) <= m.timestamp <= up_ms)
    assert during == list(range(cut + 1, steps + 1))
    system = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert any(int(down_ms) <= m.timestamp <= up_ms for m in system)  # the sampler went on too
    assert {a.path for a in client.list_artifacts(run_id)} >= {"checkpoint", "pretrain.csv"}

    print(f"tracked run {ran:.1f} s (server down {up - down[1]:.1f} s from {down[0] - started:.1f} s), "
          f"{len(during)} train losses logged while down, untracked run {untracked:.1f} s")
    print("\n".join(x for x in recorder_log.splitlines() if "unreachable" in x)[:2000])
    # The outage changed nothing in training: the same weights as a run without tracking.
    from safetensors.torch import load_file

    a = load_file(reference / "checkpoints/pretrain/final/model.safetensors")
    b = load_file(repo_copy / "checkpoints/pretrain/final/model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() and a[k].dtype == b[k].dtype for k in a)
    assert (reference / "checkpoints/pretrain/final/model.safetensors").read_bytes() == \
           (repo_copy / "checkpoints/pretrain/final/model.safetensors").read_bytes()


@pytest.mark.slow
def test_pretrain_ends_on_time_when_the_server_never_comes_back(tmp_path, repo_copy, small_tokenizer, sms_file,
                                                                alpaca_file, server):
    """A stage asked to wait for its records (GPTFORGE_WAIT_FOR_RECORDS) waits that long and no
    longer when the tracking server is gone for good; its records stay in its journal, on disk,
    for the recorder to deliver whenever the server is back."""
    bound, cut = 5, 20
    params = {**stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file), **OUTAGE_PRETRAIN,
              "pretrain.max_steps": 100}
    paused = Paused(tmp_path, cut)
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=server.url,
                  GPTFORGE_WAIT_FOR_RECORDS=str(bound))
    _prepared_repo(repo_copy, params, env)
    client = server.client()
    log = tmp_path / "pretrain.log"
    proc = _pretrain(repo_copy, {**env, **paused.env()}, log)
    try:
        _paused_with_steps_sent(paused, proc, log, client)
        server.kill()
        paused.release()
        _until(lambda: "pretrain done" in log.read_text(), proc, log, "the end of training")
        trained = time.monotonic()  # the run's end begins: it waits `bound` s for its records' delivery
        proc.wait(timeout=120)
        took = time.monotonic() - trained
    finally:
        _stop(proc)
    err = log.read_text()
    assert proc.returncode == 0, err[-3000:]
    print(f"pretrain exited {took:.1f} s after its training ended (bound {bound} s)")
    assert took < bound + 15, took
    [line] = [x for x in err.splitlines() if "has not delivered" in x]
    assert f"within {bound:g} s; it goes on in the background" in line, line
    [journal] = (repo_copy / ".gptforge" / "records").glob("*.jsonl")  # kept, whole, for later
    from gptforge.runtime.journal import read_records

    records, _ = read_records(journal)
    assert records[-1]["kind"] == "close" and records[-1]["state"] == "COMPLETED"
    steps = [r["step"] for r in records if r["kind"] == "metrics" and "train_loss" in r["metrics"] and r["step"]]
    assert steps == list(range(1, 101))
    assert (repo_copy / "checkpoints/pretrain/final/model.safetensors").is_file()
