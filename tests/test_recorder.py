"""The recorder (`python -m flows.recorder`): journals written with `gptforge.runtime.journal`
in a working folder become MLflow runs and Prefect flow and task runs, checked through MLflow's
and Prefect's clients against the session's servers (`prefect_api`, a copy of `mlflow_uri`).

Each recorder start costs seconds of imports, so one recorder delivers several journals where a
test allows (the module's `delivered` fixture: a stage's journal, a subflow's and an abandoned
one, then its idle exit). Waits are on conditions, each with a bound against a hang only.

The recorder as a process (killed and started again, a second one, an unreachable server, its
own Prefect server, the idle hand-back): tests/test_recorder_process.py, on the helpers here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from cli_support import REPO, cli_env
from process_support import prefect_home

from gptforge.runtime.journal import RECORDER_DIR, RECORDS_DIR, Journal, process_start

T0 = 1_700_000_000.0  # the records' times: fixed, so the runs' times can be checked exactly
MS = 1000


# --------------------------------------------------------------------------------------------
# helpers


def copy_mlflow(uri: str, folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(uri[len("sqlite:///") :], folder / "mlflow.db")
    return f"sqlite:///{(folder / 'mlflow.db').resolve()}"


def open_journal(
    work: Path,
    key: str,
    *,
    prefect_url: str | None,
    mlflow_uri: str | None,
    stage: str = "prepare_classify",
    parent_flow_run_id: str | None = None,
    pid: int | None = None,
    t: float = T0,
) -> Journal:
    j = Journal(work / RECORDS_DIR, key)
    pid = os.getpid() if pid is None else pid
    j.write(
        "open",
        time=t,
        stage=stage,
        flow_name=stage.replace("_", "-"),
        summary=f"stage {stage}",
        parameters={"params": "params.yaml", "overrides": ["a=1"]},
        pid=pid,
        pid_start=process_start(pid),
        cwd=str(work),
        prefect={
            "enabled": prefect_url is not False,
            "api_url": prefect_url or None,
            "parent_flow_run_id": parent_flow_run_id,
        },
        mlflow={
            "enabled": mlflow_uri is not None,
            "uri": mlflow_uri,
            "experiment": "gptforge",
            "artifact_location": None,
            "parent_run_id": None,
        },
    )
    return j


def write_stage(j: Journal, work: Path, t: float = T0, close: bool = True) -> None:
    """A stage's whole journal: its run with a nested child run, params, metrics at three steps,
    tags, an artifact, a text, two steps (one retried, one failed), logs, a markdown artifact."""
    report = work / "report.txt"
    report.write_text("the report, as logged\n")
    j.write("run_start", time=t + 1, run="main", name="prepare_classify", parent=None, tags={"gptforge.stage": "x"})
    j.write("params", time=t + 1.1, run="main", params={"lr": "0.001", "data.seed": "7"})
    j.write("step_start", time=t + 2, step="1", name="download-source")
    j.write("log", time=t + 2.5, step="1", level="INFO", logger="gptforge", message="downloading the source")
    j.write("step_retry", time=t + 3, step="1", attempt=1, delay=1.0, message="HTTP 503: try again")
    j.write("step_end", time=t + 5, step="1", state="COMPLETED", message=None)
    for step in (0, 1, 2):
        j.write(
            "metrics",
            time=t + 6 + step,
            run="main",
            metrics={"loss": 3.0 - step, "acc": 0.5 + step / 10},
            step=step,
            timestamp=int((t + 6 + step) * MS),
        )
    j.write("run_start", time=t + 9, run="child", name="eval", parent="main", tags={"kind": "child"})
    j.write("metrics", time=t + 9.5, run="child", metrics={"score": 0.75}, step=None, timestamp=int((t + 9.5) * MS))
    j.write("run_end", time=t + 10, run="child", status="FINISHED")
    j.write("tags", time=t + 10.5, run="main", tags={"result": "good"})
    j.write("artifact", time=t + 11, run="main", path=j.keep_file(report), artifact_path="reports")
    report.write_text("changed after it was logged\n")
    j.write("text", time=t + 11.5, run="main", name="notes/summary.md", text="# summary\n")
    j.write("step_start", time=t + 12, step="2", name="write-split")
    j.write("step_end", time=t + 13, step="2", state="FAILED", message="ValueError: bad split")
    j.write("log", time=t + 13.5, step=None, level="WARNING", logger="gptforge", message="flow-level line")
    j.write(
        "artifact_md",
        time=t + 14,
        key="prepare-classify-metrics",
        markdown="### metrics\n\n| a | 1 |",
        description="prepare_classify metrics",
    )
    if close:
        j.write("run_end", time=t + 15, run="main", status="FINISHED")
        j.write("close", time=t + 16, state="COMPLETED", message="done", exit_code=0)
        j.close()


def recorder_env(work: Path, **extra: str) -> dict[str, str]:
    home = prefect_home(work / ".prefect-home")
    env = cli_env(**{"GPTFORGE_RECORDER_IDLE_SECONDS": "3", "PREFECT_HOME": str(home), **extra})
    env.pop("PREFECT_API_URL", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def start_recorder(work: Path, log: Path, **env: str) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.recorder"],
            cwd=work,
            env=recorder_env(work, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def recorder_log(work: Path) -> str:
    path = work / RECORDER_DIR / "recorder.log"
    return path.read_text() if path.exists() else "(no recorder.log)"


def wait_for(condition, what: str, work: Path, proc: subprocess.Popen | None = None, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if proc is not None and proc.poll() is not None and not condition():
            pytest.fail(f"the recorder ended (exit {proc.returncode}) before {what}:\n{recorder_log(work)[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"not {what} within {within:.0f} s:\n{recorder_log(work)[-3000:]}")
        time.sleep(0.05)


def delivered(work: Path, key: str) -> bool:
    return not (work / RECORDS_DIR / f"{key}.jsonl").exists()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def prefect_client(url: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}):
        with get_client(sync_client=True) as client:
            yield client


def mlflow_run(uri: str, key: str, run: str = "main"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("gptforge")
    found = client.search_runs([experiment.experiment_id], f"tags.`gptforge.journal` = '{key}:{run}'")
    assert len(found) == 1, f"{len(found)} MLflow runs for {key}:{run}"
    return client, found[0]


def task_runs(client, flow_run_id) -> dict:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.dynamic_key: r for r in runs}


def dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(proc.stdout)


# --------------------------------------------------------------------------------------------
# one recorder, three journals: a stage's, a subflow's, an abandoned one; then its idle exit


@pytest.fixture(scope="module")
def delivered_folder(tmp_path_factory, prefect_api, mlflow_uri):
    work = tmp_path_factory.mktemp("recorder")
    uri = copy_mlflow(mlflow_uri, work / "mlruns-db")
    with prefect_client(prefect_api) as client:  # the pipeline's flow run, parent of the subflow
        from prefect import Flow
        from prefect.states import Running

        parent = client.create_flow_run(Flow(lambda: None, name="pipeline"), state=Running())
    stage = open_journal(work, "20240101T000000-prepare_classify-aaaa", prefect_url=prefect_api, mlflow_uri=uri)
    write_stage(stage, work)
    sub = open_journal(
        work,
        "20240101T000001-pretrain-bbbb",
        prefect_url=prefect_api,
        mlflow_uri=uri,
        stage="pretrain",
        parent_flow_run_id=str(parent.id),
    )
    sub.write("run_start", time=T0 + 1, run="main", name="pretrain", parent=None, tags={})
    sub.write("params", time=T0 + 1.1, run="main", params={"lr": "0.1", "seed": "1"})
    sub.write("params", time=T0 + 1.2, run="main", params={"lr": "0.2", "steps": "9"})  # lr again: refused
    sub.write("artifact_md", time=T0 + 1.3, key="Not A Key!", markdown="x", description="refused")
    sub.write("metrics", time=T0 + 1.4, run="nowhere", metrics={"x": 1.0}, step=0, timestamp=0)
    sub.write("run_end", time=T0 + 2, run="main", status="FINISHED")
    sub.write("close", time=T0 + 3, state="FAILED", message="StageFailed: no data", exit_code=1)
    sub.close()
    gone = open_journal(
        work, "20240101T000002-finetune-cccc", prefect_url=prefect_api, mlflow_uri=uri, stage="finetune", pid=dead_pid()
    )
    gone.write("run_start", time=T0 + 1, run="main", name="finetune", parent=None, tags={})
    gone.write("metrics", time=T0 + 2, run="main", metrics={"loss": 1.5}, step=4, timestamp=int((T0 + 2) * MS))
    gone.write("step_start", time=T0 + 3, step="train", name="train")
    gone.close()
    with open(gone.path, "ab") as f:
        f.write(b'{"kind": "metrics", "time": 1')  # a line cut by the kill: not a record
    os.utime(gone.path, (T0 + 4, T0 + 4))  # its last write: the end of its runs

    log = work / "recorder.out"
    began, began_at = time.monotonic(), time.time()
    proc = start_recorder(work, log)
    try:
        keys = (stage.key, sub.key, gone.key)
        wait_for(lambda: all(delivered(work, k) for k in keys), "delivered all three journals", work, proc)
        took = time.monotonic() - began
        proc.wait(timeout=60)  # idle after 3 s with nothing pending
    finally:
        stop(proc)
    yield {
        "work": work,
        "uri": uri,
        "api": prefect_api,
        "stage": stage.key,
        "sub": sub.key,
        "gone": gone.key,
        "parent": parent.id,
        "proc": proc,
        "took": took,
        "began": began_at,
    }


@pytest.mark.slow
def test_the_stage_run_is_in_mlflow_as_the_journal_says(delivered_folder):
    f = delivered_folder
    client, run = mlflow_run(f["uri"], f["stage"])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "prepare_classify"
    assert (run.info.start_time, run.info.end_time) == (int((T0 + 1) * MS), int((T0 + 15) * MS))
    assert run.data.params == {"lr": "0.001", "data.seed": "7"}
    assert run.data.tags["gptforge.stage"] == "x" and run.data.tags["result"] == "good"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value, m.timestamp) for m in history) == [
        (s, 3.0 - s, int((T0 + 6 + s) * MS)) for s in (0, 1, 2)
    ]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "acc")] == [0, 1, 2]
    # the artifact as it was when logged (the journal's copy), not as it is now
    folder = Path(client.download_artifacts(run.info.run_id, "reports", str(f["work"] / "download")))
    assert (folder / "report.txt").read_text() == "the report, as logged\n"
    text = Path(client.download_artifacts(run.info.run_id, "notes/summary.md", str(f["work"] / "download")))
    assert text.read_text() == "# summary\n"
    _, child = mlflow_run(f["uri"], f["stage"], "child")
    assert child.data.tags["mlflow.parentRunId"] == run.info.run_id
    assert child.info.status == "FINISHED" and child.data.metrics == {"score": 0.75}
    assert child.info.end_time == int((T0 + 10) * MS)


@pytest.mark.slow
def test_the_stage_flow_run_is_in_prefect_as_the_journal_says(delivered_folder):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    f = delivered_folder
    _, run = mlflow_run(f["uri"], f["stage"])
    flow_run_id = uuid.UUID(run.data.tags["prefect.flow_run_id"])
    with prefect_client(f["api"]) as client:
        flow_run = client.read_flow_run(flow_run_id)
        assert run.data.tags["prefect.flow_run_name"] == flow_run.name
        assert client.read_flow(flow_run.flow_id).name == "prepare-classify"
        assert flow_run.parameters == {"params": "params.yaml", "overrides": ["a=1"]}
        assert flow_run.state.type.value == "COMPLETED" and flow_run.state.message == "done"
        # Prefect's API takes no time with a state: the run's times are those of the delivery
        assert f["began"] <= flow_run.start_time.timestamp() <= flow_run.end_time.timestamp() <= time.time()
        assert flow_run.parent_task_run_id is None
        tasks = task_runs(client, flow_run_id)
        assert set(tasks) == {"1", "2"}
        assert tasks["1"].name == "download-source-1" and tasks["1"].state.type.value == "COMPLETED"
        assert flow_run.start_time <= tasks["1"].start_time <= tasks["1"].end_time <= flow_run.end_time
        names = [s.name for s in client.read_task_run_states(tasks["1"].id)]
        assert names == ["Running", "AwaitingRetry", "Retrying", "Completed"]
        assert tasks["2"].state.type.value == "FAILED" and tasks["2"].state.message == "ValueError: bad split"
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        lines = {(entry.message, entry.task_run_id, entry.level) for entry in logs}
        assert ("downloading the source", tasks["1"].id, 20) in lines and ("flow-level line", None, 30) in lines
        assert [entry.timestamp.timestamp() for entry in logs] == pytest.approx([T0 + 2.5, T0 + 13.5])
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        assert [(a.key, a.type, a.data, a.description) for a in artifacts] == [
            ("prepare-classify-metrics", "markdown", "### metrics\n\n| a | 1 |", "prepare_classify metrics")
        ]


@pytest.mark.slow
def test_a_stage_under_the_pipeline_is_a_subflow_of_its_flow_run(delivered_folder):
    f = delivered_folder
    _, run = mlflow_run(f["uri"], f["sub"])
    with prefect_client(f["api"]) as client:
        flow_run = client.read_flow_run(uuid.UUID(run.data.tags["prefect.flow_run_id"]))
        assert flow_run.state.type.value == "FAILED" and flow_run.state.message == "StageFailed: no data"
        tracker = client.read_task_run(flow_run.parent_task_run_id)
        assert tracker.flow_run_id == f["parent"]
        assert tracker.name.startswith("pretrain") and tracker.state.type.value == "FAILED"


@pytest.mark.slow
def test_records_refused_for_good_are_logged_and_skipped(delivered_folder):
    f = delivered_folder
    _, run = mlflow_run(f["uri"], f["sub"])
    assert run.data.params == {"lr": "0.1", "seed": "1", "steps": "9"}  # only the refused value is lost
    text = recorder_log(f["work"])
    assert f"MLflow run {run.info.run_id} refused 1 params: lr (" in text
    assert f"journal {f['sub']}: artifact_md record skipped (refused for good): ValidationError" in text
    assert f"journal {f['sub']}: metrics record skipped (refused for good): Skip: no MLflow run 'nowhere'" in text
    with prefect_client(f["api"]) as client:
        flow_run = client.read_flow_run(uuid.UUID(run.data.tags["prefect.flow_run_id"]))
        assert flow_run.state.type.value == "FAILED"  # the journal went on to its end


@pytest.mark.slow
def test_an_abandoned_journal_ends_killed_and_crashed(delivered_folder):
    f = delivered_folder
    client, run = mlflow_run(f["uri"], f["gone"])
    assert run.info.status == "KILLED" and run.info.end_time == int((T0 + 4) * MS)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(4, 1.5)]
    with prefect_client(f["api"]) as pc:
        flow_run = pc.read_flow_run(uuid.UUID(run.data.tags["prefect.flow_run_id"]))
        message = "the stage process ended without closing its records: killed"
        assert flow_run.state.type.value == "CRASHED" and flow_run.state.message == message
        [task] = task_runs(pc, flow_run.id).values()
        assert task.state.type.value == "CRASHED"


@pytest.mark.slow
def test_delivered_journals_leave_the_records_folder_and_the_recorder_exits_when_idle(delivered_folder):
    f = delivered_folder
    records = f["work"] / RECORDS_DIR
    assert sorted(p.name for p in records.iterdir()) == ["delivered"]  # no .files/, no .state.json
    assert sorted(p.name for p in (records / "delivered").iterdir()) == sorted(
        f"{k}.jsonl" for k in (f["stage"], f["sub"], f["gone"])
    )
    assert f["proc"].returncode == 0
    assert not (f["work"] / RECORDER_DIR / "state.json").exists()
    text = recorder_log(f["work"])
    assert "idle for 3 s with nothing pending: exiting" in text and "Traceback" not in text
    print(f"\nthree journals delivered {f['took']:.1f} s after the recorder's start")
