"""The recorder (`python -m flows.recorder`) as a process: killed mid-journal and started again
(nothing lost, nothing twice), a second recorder in the same folder (it exits at once), a Prefect
API that does not answer (its journal held until it does, the others delivered), its own Prefect
server when no API is configured (gone with it), and, in-process, the idle recorder's hand-back
of the folder and what counts as worth retrying.

The journals, the recorder's start and the readers of MLflow and Prefect are
tests/test_recorder.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
from process_support import free_port
from test_recorder import (
    MS,
    T0,
    copy_mlflow,
    delivered,
    mlflow_run,
    open_journal,
    prefect_client,
    recorder_env,
    recorder_log,
    start_recorder,
    stop,
    task_runs,
    wait_for,
    write_stage,
)

from gptforge.runtime.journal import RECORDER_DIR, RECORDS_DIR, Journal, process_start

# --------------------------------------------------------------------------------------------
# kills, a second recorder, an unreachable server


@pytest.mark.slow
def test_a_recorder_killed_mid_journal_and_started_again_loses_nothing(tmp_path, prefect_api, mlflow_uri):
    work = tmp_path / "work"
    uri = copy_mlflow(mlflow_uri, tmp_path / "db")
    j = open_journal(work, "20240101T000000-pretrain-dddd", prefect_url=prefect_api, mlflow_uri=uri, stage="pretrain")
    j.write("run_start", time=T0 + 1, run="main", name="pretrain", parent=None, tags={})
    for step in range(5):
        j.write(
            "metrics",
            time=T0 + 2 + step,
            run="main",
            metrics={"loss": 10.0 - step},
            step=step,
            timestamp=int((T0 + 2 + step) * MS),
        )
    state = work / RECORDS_DIR / f"{j.key}.state.json"
    log = tmp_path / "recorder.out"
    first = start_recorder(work, log, GPTFORGE_RECORDER_IDLE_SECONDS="60")
    try:
        wait_for(
            lambda: state.exists() and json.loads(state.read_text())["offset"] == j.path.stat().st_size,
            "through the first records",
            work,
            first,
        )
        lock_holder = json.loads((work / RECORDER_DIR / "state.json").read_text())["pid"]
        assert lock_holder == first.pid
        # a second recorder in the same folder: exits at once, quietly, the first one untouched
        began = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "flows.recorder"],
            cwd=work,
            env=recorder_env(work),
            capture_output=True,
            text=True,
            timeout=120,
        )
        print(f"\na second recorder exited after {time.monotonic() - began:.1f} s")
        assert (second.returncode, second.stdout, second.stderr) == (0, "", "")
        assert first.poll() is None
        assert json.loads((work / RECORDER_DIR / "state.json").read_text())["pid"] == first.pid
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        stop(first)
    for step in range(5, 10):
        j.write(
            "metrics",
            time=T0 + 2 + step,
            run="main",
            metrics={"loss": 10.0 - step},
            step=step,
            timestamp=int((T0 + 2 + step) * MS),
        )
    # the transformers flavor, through MlflowRun.log_hf_model with the run made active for it
    from hf_models import make_tiny_causal_lm

    j.write(
        "hf_model",
        time=T0 + 19,
        run="main",
        folder=str(make_tiny_causal_lm(tmp_path / "llama")),
        name="model",
        flavor_kwargs={},
    )
    j.write("run_end", time=T0 + 20, run="main", status="FINISHED")
    j.write("close", time=T0 + 21, state="COMPLETED", message=None, exit_code=0)
    j.close()
    again = start_recorder(work, log)
    try:
        wait_for(lambda: delivered(work, j.key), "delivered after the restart", work, again)
    finally:
        stop(again)
    client, run = mlflow_run(uri, j.key)  # one run, not two
    assert run.info.status == "FINISHED" and run.info.end_time == int((T0 + 20) * MS)
    [model] = run.outputs.model_outputs
    assert client.get_logged_model(model.model_id).name == "model"
    assert "not logged as a transformers model" not in recorder_log(work)
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")) == [
        (s, 10.0 - s) for s in range(10)
    ]
    with prefect_client(prefect_api) as pc:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        flow_run_id = uuid.UUID(run.data.tags["prefect.flow_run_id"])
        assert pc.read_flow_run(flow_run_id).state.type.value == "COMPLETED"
        assert len(pc.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))) == 1


class Forwarder:
    """A TCP port that refuses connections until `to(port)`, then forwards them there."""

    def __init__(self) -> None:
        self.port = free_port()
        self.target: int | None = None
        self.server: socket.socket | None = None

    def to(self, target: int) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.mark.slow
def test_an_unreachable_prefect_api_holds_its_journal_only_until_it_answers(tmp_path, prefect_api, mlflow_uri):
    work = tmp_path / "work"
    uri = copy_mlflow(mlflow_uri, tmp_path / "db")
    away = Forwarder()
    held = open_journal(
        work, "20240101T000000-prepare_classify-eeee", prefect_url=f"http://127.0.0.1:{away.port}/api", mlflow_uri=uri
    )
    write_stage(held, work)
    other = open_journal(
        work, "20240101T000001-prepare_instruct-ffff", prefect_url=False, mlflow_uri=uri, stage="prepare_instruct"
    )
    other.write("run_start", time=T0 + 1, run="main", name="prepare_instruct", parent=None, tags={})
    other.write("run_end", time=T0 + 2, run="main", status="FINISHED")
    other.write("close", time=T0 + 3, state="COMPLETED", message=None, exit_code=0)
    other.close()
    proc = start_recorder(work, tmp_path / "recorder.out")
    try:
        wait_for(lambda: delivered(work, other.key), "delivered the journal without Prefect", work, proc)
        wait_for(
            lambda: recorder_log(work).count(f"journal {held.key}: unreachable") >= 2,
            "retried the held journal",
            work,
            proc,
        )
        assert not delivered(work, held.key)
        state = json.loads((work / RECORDS_DIR / f"{held.key}.state.json").read_text())
        assert (state["offset"], state["done"], state.get("flow_run_id")) == (0, 0, None)
        away.to(int(prefect_api.rsplit(":", 1)[1].split("/")[0]))  # the server answers there now
        wait_for(lambda: delivered(work, held.key), "delivered once the server answers", work, proc, within=180)
    finally:
        stop(proc)
        away.close()
    assert mlflow_run(uri, other.key)[1].info.status == "FINISHED"
    _, run = mlflow_run(uri, held.key)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.001", "data.seed": "7"}
    with prefect_client(prefect_api) as client:
        flow_run = client.read_flow_run(uuid.UUID(run.data.tags["prefect.flow_run_id"]))
        assert flow_run.state.type.value == "COMPLETED"


@pytest.mark.slow
def test_its_own_prefect_server_on_demand_and_gone_with_it(tmp_path):
    work = tmp_path / "work"
    (work / RECORDER_DIR).mkdir(parents=True)
    (work / RECORDER_DIR / "want-prefect").write_text(
        json.dumps({"pid": os.getpid(), "pid_start": process_start(os.getpid())})
    )
    j = open_journal(work, "20240101T000000-prepare_classify-gggg", prefect_url=None, mlflow_uri=None)
    j.write("step_start", time=T0 + 1, step="1", name="download-source")
    j.write("step_end", time=T0 + 2, step="1", state="COMPLETED", message=None)
    j.write("close", time=T0 + 3, state="COMPLETED", message=None, exit_code=0)
    j.close()
    proc = start_recorder(work, tmp_path / "recorder.out", GPTFORGE_RECORDER_IDLE_SECONDS="1")
    state_file = work / RECORDER_DIR / "state.json"
    try:
        wait_for(
            lambda: state_file.exists() and json.loads(state_file.read_text())["prefect_api_url"],
            "the server's URL in state.json",
            work,
            proc,
            within=180,
        )
        url = json.loads(state_file.read_text())["prefect_api_url"]
        wait_for(lambda: delivered(work, j.key), "delivered to its own server", work, proc)
        with prefect_client(url) as client:
            [flow_run] = client.read_flow_runs()
            assert flow_run.state.type.value == "COMPLETED"
            assert [t.state.type.value for t in task_runs(client, flow_run.id).values()] == ["COMPLETED"]
        assert proc.poll() is None  # it stays while want-prefect names a live process (this one)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode == 0 and not state_file.exists()
    assert "recorder" in recorder_log(work).splitlines()[-1] and "exits" in recorder_log(work).splitlines()[-1]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0])), timeout=2).close()


# --------------------------------------------------------------------------------------------
# in-process: the exit hand-back and what counts as worth retrying


def test_an_idle_recorder_lets_go_of_the_folder_unless_a_journal_came_meanwhile(tmp_path):
    import fcntl

    from flows.recorder import Recorder

    r = Recorder(tmp_path)
    r.folder.mkdir(parents=True)
    lock = open(r.folder / "lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    r.holding = True
    r._write_state(None)
    other = open(r.folder / "lock", "a+")
    assert not r._hand_back(lock)  # nothing pending: the folder is free, state.json gone
    assert not (r.folder / "state.json").exists()
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(other, fcntl.LOCK_UN)

    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    r.holding = True
    Journal(tmp_path / RECORDS_DIR, "20240101T000000-late-hhhh").close()  # written while the lock was held
    assert r._hand_back(lock) and r.holding  # served here: the lock taken again
    assert json.loads((r.folder / "state.json").read_text())["pid"] == os.getpid()
    with pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.close()
    other.close()


def test_what_is_worth_retrying():
    import httpx
    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE

    from flows.recorder import Waiting, transient

    request = httpx.Request("POST", "http://127.0.0.1:1/api/flow_runs/")

    def status(code):
        return httpx.HTTPStatusError("x", request=request, response=httpx.Response(code, request=request))

    def wrapped(inner, outer):
        try:
            try:
                raise inner
            except Exception as e:
                raise outer from e
        except Exception as e:
            return e

    locked = sqlalchemy.exc.OperationalError("INSERT", {}, Exception("database is locked"))
    assert transient(httpx.ConnectError("[Errno 111] Connection refused", request=request))
    assert transient(httpx.ReadTimeout("timed out", request=request))
    assert transient(status(503)) and transient(status(429)) and not transient(status(404))
    assert not transient(status(422))
    assert transient(MlflowException("locked", error_code=TEMPORARILY_UNAVAILABLE))
    assert not transient(MlflowException("bad value", error_code=INVALID_PARAMETER_VALUE))
    assert transient(wrapped(locked, RuntimeError("the store failed")))
    assert transient(Waiting("starting")) and transient(ConnectionRefusedError())
    assert not transient(ValueError("bad")) and not transient(FileNotFoundError("gone"))
