"""An MLflow server that goes away under a run must not cost the run.

- The outbox (gptforge.outbox) against a fake sender: order kept, transient failures retried,
  rejected records dropped and counted, the bound, the flush deadline.
- Which MLflow failures are worth retrying (gptforge.tracking.retryable).
- A server down at the start is a one-line error; a server gone at the end costs a bounded
  wait, a warning, and leaves MLflow's fluent state clean (its atexit end_run does nothing).
- `gptforge pretrain` logging every step to a real `mlflow server` that is SIGKILLed and kept
  down 30 s, then restarted on the same port and store: the run exits 0, its final weights equal
  an untracked run's bit for bit, and the MLflow run is FINISHED with every step's train loss,
  those logged during the outage included. A server that never comes back: exit 0, and the
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

from conftest import BIN, cli_env, free_port, run_cli, set_params, stage_params, wait_http
from gptforge import tracking
from gptforge.outbox import Outbox


class Transient(Exception):
    pass


class Rejected(Exception):
    pass


def is_transient(e: BaseException) -> bool:
    return isinstance(e, Transient)


class FakeSender:
    """Records what it is sent; `fail` decides per call whether (and how) to fail first."""

    def __init__(self, fail=None, gate: threading.Event | None = None):
        self.calls: list[tuple[str, list]] = []
        self.attempts = 0
        self.fail = fail or (lambda attempt, kind, payloads: None)
        self.gate = gate

    def __call__(self, kind, payloads):
        if self.gate is not None:
            self.gate.wait()
        self.attempts += 1
        error = self.fail(self.attempts, kind, payloads)
        if error is not None:
            raise error
        self.calls.append((kind, list(payloads)))

    def sent(self, kind=None):
        return [p for k, ps in self.calls for p in ps if kind in (None, k)]


def outbox(sender, **kw) -> Outbox:
    kw.setdefault("backoff", (0.01, 0.05))
    return Outbox(sender, retryable=is_transient, **kw)


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
    assert box.flush(10)
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
        assert box.flush(10)
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
        assert box.flush(10)
    assert sender.sent() == ["m0", "m2", "m3"]
    assert box.rejected == {"metric": 1, "params": 3} and box.dropped == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["the fake server rejected a metric record, dropped (Rejected: invalid value)"]


def test_a_full_buffer_drops_the_oldest_metrics_and_keeps_the_rest():
    gate = threading.Event()
    sender = FakeSender(gate=gate)  # blocked: nothing leaves until the gate opens
    box = outbox(sender, capacity=10, batch=1)
    box.put("metric", "m0")
    while box._inflight == []:  # the thread holds m0 at the gate
        time.sleep(0.001)
    box.put("params", {"p": 1, "q": 2}, 2)
    for i in range(1, 20):
        box.put("metric", f"m{i}")
    box.put("tags", {"t": 1}, 1)
    assert box.pending() <= 11  # the bound (10 values) plus nothing but the in-flight record
    gate.set()
    assert box.flush(10)
    sent = sender.sent()
    # m0 was in flight, the params and tags are kept; the oldest queued metrics made room.
    assert sent[:2] == ["m0", {"p": 1, "q": 2}] and sent[-1] == {"t": 1}
    metrics = sent[2:-1]
    assert metrics == [f"m{i}" for i in range(20 - len(metrics), 20)] and len(metrics) == 6
    assert box.overflowed == {"metric": 13} and box.dropped == 13


def test_flush_and_close_honour_their_deadlines():
    sender = FakeSender(lambda *a: Transient("refused"))  # a server that never comes back
    box = outbox(sender, backoff=(0.05, 0.2))
    for step in range(5):
        box.put("metric", step)
    box.put("artifact", "final", 1)
    t0 = time.monotonic()
    assert box.flush(0.5) is False
    assert 0.45 <= time.monotonic() - t0 < 2.0
    box.put("end", "FINISHED")
    t0 = time.monotonic()
    assert box.close(0.3) == {"metric": 5, "artifact": 1, "end": 1}
    assert 0.25 <= time.monotonic() - t0 < 2.0
    attempts = sender.attempts
    time.sleep(0.5)
    assert sender.attempts <= attempts + 1  # closed: it stops retrying
    box.put("metric", 9)  # after close: ignored
    assert box.pending() == 6 + 1


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

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    t0 = time.monotonic()
    with pytest.raises(StageFailed) as info:
        with tracking.start_run(enabled=True, experiment="down", stage="pretrain"):
            pytest.fail("the body must not run")
    assert time.monotonic() - t0 < 20
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
    # KILLED waits at most 5 s even with a larger bound; here the bound (3 s) is smaller.
    assert 2.5 <= took < 3 + 5, took
    [line] = [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()]
    assert line.startswith(f"MLflow: run {run.run_id} could not record 2 metrics, 1 tag, 2 artifacts and its status "
                           f"KILLED: the server at {server.url} was unreachable for the last "), line
    assert line.endswith("(waited 3 s; last error: [Errno 111] Connection refused (MlflowException))"), line
    # MLflow's fluent state is clean: no active run, and its atexit end_run has nothing to do.
    assert mlflow.active_run() is None and fluent._active_run_stack.get() == []
    t0 = time.monotonic()
    fluent._safe_end_run()
    assert time.monotonic() - t0 < 0.5


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


def _pretrain(repo: Path, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "gptforge"), "pretrain", *extra], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _the_run(client, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], "tags.`gptforge.stage` = 'pretrain'") if exp else []
    return runs[0] if runs else None


def _logged_steps(client, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "train_loss"))


# About 65 steps/s here (1 thread): 700 steps, about 11 s, end during the 30 s outage; the run
# then waits at its end (up to GPTFORGE_TRACKING_FLUSH_SECONDS, raised for the test) for the
# server to come back, and sends what it kept.
OUTAGE_PRETRAIN = {"pretrain.batch_tokens": 1024, "pretrain.log_interval": 1, "pretrain.eval_interval": 500, "pretrain.ckpt_interval": 1000,
                   "pretrain.keep_last": 1, "model.dropout": 0.1, "tracking.enabled": True,
                   "tracking.experiment": "outage"}


@pytest.mark.slow
def test_pretrain_survives_a_tracking_server_restart(tmp_path, repo_copy, small_tokenizer, sms_file, alpaca_file,
                                                      server):
    steps = 700
    params = {**stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file), **OUTAGE_PRETRAIN,
              "pretrain.max_steps": steps}
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=server.url,
                  MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="2", GPTFORGE_TRACKING_FLUSH_SECONDS="180")
    _prepared_repo(repo_copy, params, env)
    reference = tmp_path / "reference"
    shutil.copytree(repo_copy, reference)

    client = server.client()
    started = time.monotonic()
    proc = _pretrain(repo_copy, env)
    try:
        deadline = time.monotonic() + 120
        run = None
        while time.monotonic() < deadline and proc.poll() is None:
            run = run or _the_run(client, "outage")
            if run and len(_logged_steps(client, run.info.run_id)) >= 20:
                break
            time.sleep(0.3)
        assert proc.poll() is None and run is not None, "pretrain ended before the server could be killed"
        server.kill()
        down = time.monotonic(), time.time()
        # The undisturbed run, once the disturbed one has trained (its final checkpoint is
        # written before it waits for the server; never two trainings at once): it fits in the outage.
        final = repo_copy / "checkpoints/pretrain/final/model.safetensors"
        while not final.is_file() and proc.poll() is None:
            time.sleep(0.1)
        t0 = time.monotonic()
        straight = _pretrain(reference, cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1"), "-S",
                             "tracking.enabled=false")
        _, ref_err = straight.communicate(timeout=300)
        assert straight.returncode == 0, ref_err[-3000:]
        untracked = time.monotonic() - t0
        time.sleep(max(0.0, 30 - (time.monotonic() - down[0])))
        assert proc.poll() is None, "pretrain did not wait for the server at its end"
        server.start()
        up = time.time()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ran = time.monotonic() - started
    assert proc.returncode == 0, err[-3000:]
    assert "is unreachable" in err and "is reachable again" in err, err[-3000:]
    assert "could not record" not in err and "rejected a" not in err and "dropping" not in err, err[-3000:]

    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED"
    assert tracking.DROPPED_TAG not in run.data.tags
    history = client.get_metric_history(run.info.run_id, "train_loss")
    # Every step, each once (and step 0: the stage's final metrics, logged without a step).
    assert sorted(m.step for m in history if m.step) == list(range(1, steps + 1))
    # Metrics keep the time they were logged at: some fall in the outage, so they were kept and sent later.
    during = [m for m in history if down[1] * 1000 < m.timestamp < up * 1000]
    assert len(during) > 10, len(during)
    system = client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")
    assert any(down[1] * 1000 < m.timestamp < up * 1000 for m in system)  # the sampler went on too
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"checkpoint", "pretrain.csv"}

    # The outage changed nothing in training: the same weights as a run without tracking.
    print(f"tracked run {ran:.1f} s (server down {up - down[1]:.1f} s from {down[0] - started:.1f} s), "
          f"{len(during)} train losses logged while down, untracked run {untracked:.1f} s")
    print("\n".join(x for x in err.splitlines() if "MLflow" in x))
    from safetensors.torch import load_file

    a = load_file(reference / "checkpoints/pretrain/final/model.safetensors")
    b = load_file(repo_copy / "checkpoints/pretrain/final/model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() and a[k].dtype == b[k].dtype for k in a)
    assert (reference / "checkpoints/pretrain/final/model.safetensors").read_bytes() == \
           (repo_copy / "checkpoints/pretrain/final/model.safetensors").read_bytes()


@pytest.mark.slow
def test_pretrain_ends_on_time_when_the_server_never_comes_back(tmp_path, repo_copy, small_tokenizer, sms_file,
                                                                alpaca_file, server):
    bound = 5
    params = {**stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file), **OUTAGE_PRETRAIN,
              "pretrain.max_steps": 300}
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=server.url,
                  GPTFORGE_TRACKING_FLUSH_SECONDS=str(bound))
    _prepared_repo(repo_copy, params, env)
    client = server.client()
    proc = _pretrain(repo_copy, env)
    final = repo_copy / "checkpoints/pretrain/final"
    try:
        deadline = time.monotonic() + 120
        run = None
        while time.monotonic() < deadline and proc.poll() is None:
            run = run or _the_run(client, "outage")
            if run and _logged_steps(client, run.info.run_id):
                break
            time.sleep(0.2)
        assert proc.poll() is None and run is not None, "pretrain ended before the server could be killed"
        server.kill()
        while proc.poll() is None and not final.is_dir():
            time.sleep(0.05)
        trained = time.monotonic()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    # The final checkpoint is written, then a sample, metrics and artifacts are logged: the
    # process ends within the flush bound after that, plus the interpreter's own exit.
    assert time.monotonic() - trained < bound + 10
    [line] = [x for x in err.splitlines() if "could not record" in x]
    assert f"MLflow: run {run.info.run_id} could not record " in line, line
    assert f" artifacts and its status FINISHED: the server at {server.url} was unreachable for the last " in line
    assert " metrics, " in line
    warnings = [x for x in err.splitlines() if "MLflow" in x]
    assert warnings[-1] == line, warnings[-3:]
    assert (final / "model.safetensors").is_file()
