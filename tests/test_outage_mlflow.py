"""An MLflow server that goes away under a run must not cost the run.

- A server down at the start is a one-line error; a server gone at the end costs a bounded
  wait, a warning, and leaves MLflow's fluent state clean (its atexit end_run does nothing).
- `gptforge pretrain` logging every step to a real `mlflow server` that is SIGKILLed while the
  run is held after a step (gptforge.runtime.pause), stays down while the run trains on to its end, then
  is restarted on the same port and store: the run exits 0, its final weights equal an untracked
  run's bit for bit, and the MLflow run is FINISHED with every step's train loss, those logged
  during the outage included. A server that never comes back: exit 0, and the
  last warning names what could not be recorded, within the flush bound.

Without a server: the outbox against a fake sender and a virtual clock, tests/test_outbox.py; which
failures are retried and what a run's end says and waits, tests/test_tracking_outage.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_support import BIN, cli_env, run_cli, set_params, stage_params
from process_support import Paused, free_port, records_delivered, wait_http

from gptforge.runtime import tracking

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
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{self.folder}/mlflow.db",
                "--artifacts-destination",
                str(self.folder / "artifacts"),
            ],
            cwd=self.folder,
            env=cli_env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
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
    srv = MlflowServer(tmp_path / "mlflow-server", mlflow_uri[len("sqlite:///") :])
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
    import mlflow.tracking  # noqa: F401 - imported before the clock starts: its import is not the point

    from gptforge.errors import StageFailed

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
    assert (
        message.startswith(f"MLflow tracking server at {url} is unreachable; start it, or set tracking.enabled=false (")
        and "\n" not in message
    )


@pytest.mark.slow
def test_a_stopped_run_with_its_server_gone_waits_a_bounded_time_and_leaves_mlflow_clean(
    server, monkeypatch, quick_http, caplog, tmp_path
):
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
        with tracking.start_run(
            enabled=True, experiment="gone", stage="pretrain", params={"a": 1}, system_metrics=True
        ) as run:
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
    assert line.startswith(
        f"MLflow: run {run.run_id} could not record 2 metrics, 1 tag, 2 artifacts and its status "
        f"KILLED: the server at {server.url} was unreachable for the last "
    ), line
    assert line.endswith("(waited 3 s; last error: [Errno 111] Connection refused (MlflowException))"), line
    # MLflow's fluent state is clean: no active run, and its atexit end_run has nothing to do
    # (with the run still on its stack it would ask the dead server to end it, and could
    # overwrite the status sent through the outbox).
    assert mlflow.active_run() is None and fluent._active_run_stack.get() == []
    terminated = []
    monkeypatch.setattr(fluent.MlflowClient, "set_terminated", lambda self, *a, **kw: terminated.append(a))
    fluent._safe_end_run()
    assert terminated == []


# ---------------------------------------------------------------------------------------------
# `gptforge pretrain` through a server restart


def _prepared_repo(repo: Path, params: dict, env: dict) -> None:
    set_params(repo, **params)
    out = run_cli(["prepare", "pretrain", "-S", "tracking.enabled=false"], repo, env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def _pretrain(repo: Path, env: dict, log: Path, *extra: str) -> subprocess.Popen:
    """`gptforge pretrain` with its output in `log` (a file: read while it runs, never a full pipe)."""
    with open(log, "w") as f:
        return subprocess.Popen(
            [str(BIN / "gptforge"), "pretrain", *extra],
            cwd=repo,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


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
    _until(
        lambda: _logged_steps(client, run_id) == list(range(1, paused.step + 1)),
        proc,
        log,
        f"steps 1..{paused.step} on the server",
    )
    return run_id


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


OUTAGE_PRETRAIN = {
    "pretrain.batch_tokens": 1024,
    "pretrain.log_interval": 1,
    "pretrain.eval_interval": 500,
    "pretrain.ckpt_interval": 1000,
    "pretrain.keep_last": 1,
    "model.dropout": 0.1,
    "tracking.enabled": True,
    "tracking.experiment": "outage",
}


@pytest.mark.slow
def test_pretrain_survives_a_tracking_server_restart(
    tmp_path, repo_copy, small_tokenizer, sms_file, alpaca_file, server
):
    """The run is paused after step `cut` with steps 1..cut on the server (the recorder delivered
    them from the stage's journal); the server is killed, then the run goes on: steps cut+1..steps
    are journaled while the server is down, by construction, and the stage ends without waiting
    for it. The server is started again once the run trained; the recorder delivers the rest."""
    steps, cut, sampling = 200, 50, 1
    params = {
        **stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file),
        **OUTAGE_PRETRAIN,
        "pretrain.max_steps": steps,
    }
    paused = Paused(tmp_path, cut)
    # The stage does not wait for its records (GPTFORGE_WAIT_FOR_RECORDS=0, a user's default).
    env = cli_env(
        GPTFORGE_PREFECT="0",
        OMP_NUM_THREADS="1",
        MLFLOW_TRACKING_URI=server.url,
        MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL=str(sampling),
        GPTFORGE_WAIT_FOR_RECORDS="0",
    )
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
        straight = _pretrain(
            reference,
            cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1"),
            tmp_path / "reference.log",
            "-S",
            "tracking.enabled=false",
        )
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

    print(
        f"tracked run {ran:.1f} s (server down {up - down[1]:.1f} s from {down[0] - started:.1f} s), "
        f"{len(during)} train losses logged while down, untracked run {untracked:.1f} s"
    )
    print("\n".join(x for x in recorder_log.splitlines() if "unreachable" in x)[:2000])
    # The outage changed nothing in training: the same weights as a run without tracking.
    from safetensors.torch import load_file

    a = load_file(reference / "checkpoints/pretrain/final/model.safetensors")
    b = load_file(repo_copy / "checkpoints/pretrain/final/model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() and a[k].dtype == b[k].dtype for k in a)
    assert (reference / "checkpoints/pretrain/final/model.safetensors").read_bytes() == (
        repo_copy / "checkpoints/pretrain/final/model.safetensors"
    ).read_bytes()


@pytest.mark.slow
def test_pretrain_ends_on_time_when_the_server_never_comes_back(
    tmp_path, repo_copy, small_tokenizer, sms_file, alpaca_file, server
):
    """A stage asked to wait for its records (GPTFORGE_WAIT_FOR_RECORDS) waits that long and no
    longer when the tracking server is gone for good; its records stay in its journal, on disk,
    for the recorder to deliver whenever the server is back."""
    bound, cut = 5, 20
    params = {
        **stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file),
        **OUTAGE_PRETRAIN,
        "pretrain.max_steps": 100,
    }
    paused = Paused(tmp_path, cut)
    env = cli_env(
        GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=server.url, GPTFORGE_WAIT_FOR_RECORDS=str(bound)
    )
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
