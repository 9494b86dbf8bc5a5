"""The stage side of the records: what a recorded stage writes to its journal.

The recorder that delivers journals to MLflow and Prefect has its own tests (test_recorder.py);
here the journal itself is the reference: the records a recipe's calls produce, in order, what
ends them on success, failure and stop, artifacts as they were when logged, and a killed writer
losing nothing it wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gptforge.errors import BadInput
from gptforge.runtime import mlflow_values, recording, tracking
from gptforge.runtime.journal import Journal, read_records
from gptforge.runtime.signals import Terminated
from gptforge.runtime.steps import Retry


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(recording, "ensure_recorder", lambda root=".": None)  # no recorder: the journal is the subject
    monkeypatch.delenv(recording.WAIT_ENV, raising=False)
    monkeypatch.delenv(mlflow_values.PARENT_ENV, raising=False)
    monkeypatch.delenv(recording.PIPELINE_FLOW_ENV, raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def records_of(folder: Path) -> list[dict]:
    [path] = (folder / ".gptforge" / "records").glob("*.jsonl")
    records, end = read_records(path)
    assert end == path.stat().st_size  # every line complete
    return records


def kinds(records):
    return [r["kind"] for r in records]


def recorded(**overrides):
    options = dict(
        stage="prepare_classify",
        flow_name="prepare-classify",
        summary="a stage",
        parameters={"params": "params.yaml", "overrides": ["a.b=1"]},
        prefect=True,
        mlflow=True,
        experiment="gptforge",
    )
    return recording.recorded(**{**options, **overrides})


def test_a_stage_run_is_journaled_in_order(folder):
    artifact = folder / "report.md"
    artifact.write_text("first version")
    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("reset")
        return 7

    with recorded() as steps:
        with tracking.start_run(
            enabled=True, experiment="gptforge", stage="prepare_classify", params={"data.x": 1, "hf_token": "secret"}
        ) as run:
            assert isinstance(run, recording.JournalRun) and run.run_id is None
            assert steps(flaky, retry=Retry(2, 0.01)) == 7
            run.log_metrics({"loss": 1.5, "skip": float("nan"), "flag": True}, step=3)
            run.log_artifact(artifact)
            with tracking.start_run(
                enabled=True, experiment="gptforge", stage="evaluate:m", params=None, tags={"gptforge.model": "m"}
            ) as child:
                child.log_metrics({"acc": 0.5})
            recording.log.warning("a line for the flow run's logs")
    artifact.write_text("changed after it was logged")

    records = records_of(folder)
    assert kinds(records) == [
        "open",
        "run_start",
        "params",
        "step_start",
        "log",
        "step_retry",
        "step_end",
        "metrics",
        "artifact",
        "run_start",
        "metrics",
        "run_end",
        "log",
        "run_end",
        "close",
    ]
    opened = records[0]
    assert opened["stage"] == "prepare_classify" and opened["pid"] == os.getpid()
    assert opened["parameters"] == {"params": "params.yaml", "overrides": ["a.b=1"]}
    assert opened["prefect"] == {"enabled": True, "api_url": None, "parent_flow_run_id": None, "parent_journal": None}
    assert (
        opened["mlflow"]["uri"] == f"sqlite:///{folder.resolve()}/mlflow.db"
    )  # absolute: the recorder's cwd may differ
    assert opened["mlflow"]["artifact_location"] == (folder.resolve() / "mlartifacts").as_uri()
    main_start, params = records[1], records[2]
    assert main_start["run"] == "main" and main_start["parent"] is None
    assert main_start["tags"]["gptforge.stage"] == "prepare_classify"
    assert params["params"] == {"data.x": "1", "hf_token": "***"}
    step_start, retry, step_end = records[3], records[5], records[6]
    assert step_start["name"] == "flaky" and retry["step"] == step_start["step"] and retry["attempt"] == 1
    assert "ConnectionError: reset" in retry["message"] and step_end["state"] == "COMPLETED"
    assert (
        records[4]["step"] == step_start["step"] and "retry 1/2" in records[4]["message"]
    )  # the warning, inside its task run
    assert records[7]["metrics"] == {"loss": 1.5} and records[7]["step"] == 3
    files = next((folder / ".gptforge" / "records").glob("*.files"))
    assert (files / records[8]["path"]).read_text() == "first version"  # as it was when logged
    assert records[9]["parent"] == "main" and records[9]["tags"]["gptforge.model"] == "m"
    assert records[11] == {**records[11], "run": records[9]["run"], "status": "FINISHED"}
    assert records[12]["step"] is None and records[12]["message"] == "a line for the flow run's logs"
    assert records[13]["run"] == "main" and records[13]["status"] == "FINISHED"
    assert records[14]["state"] == "COMPLETED" and records[14]["exit_code"] == 0
    assert recording.runs_journal() is None and recording.JOURNAL_ENV not in os.environ


@pytest.mark.parametrize(
    "error, state, status, code",
    [
        (BadInput("no such file"), "FAILED", "FAILED", 2),
        (RuntimeError("boom"), "FAILED", "FAILED", 1),
        (Terminated(signal.SIGTERM), "CRASHED", "KILLED", 128 + signal.SIGTERM),
    ],
)
def test_how_a_run_ends_is_in_its_last_records(folder, error, state, status, code):
    def step():
        raise error

    with pytest.raises(type(error)):
        with recorded() as steps:
            with tracking.start_run(enabled=True, experiment="gptforge", stage="s"):
                steps(step)
    records = records_of(folder)
    assert kinds(records)[-3:] == ["step_end", "run_end", "close"]
    assert records[-3]["state"] == ("CRASHED" if state == "CRASHED" else "FAILED")
    assert records[-2]["status"] == status
    assert records[-1]["state"] == state and records[-1]["exit_code"] == code
    assert type(error).__name__ in records[-1]["message"]


def test_without_prefect_there_are_no_task_runs_and_without_mlflow_no_runs(folder):
    with recorded(prefect=False) as steps:
        assert steps is None
        with tracking.start_run(enabled=True, experiment="gptforge", stage="s") as run:
            run.log_metrics({"a": 1})
    assert kinds(records_of(folder)) == ["open", "run_start", "metrics", "run_end", "close"]


def test_a_stage_that_needs_its_mlflow_run_in_process_gets_a_real_one(folder, monkeypatch):
    seen = []
    monkeypatch.setattr(tracking, "_import_mlflow", lambda: seen.append(1) or (_ for _ in ()).throw(ImportError()))
    with recorded(mlflow=False):
        with tracking.start_run(enabled=True, experiment="gptforge", stage="register") as run:
            assert not isinstance(run, recording.JournalRun)
    assert seen == [1]  # it went to MLflow itself (here: not installed, so a NullRun)
    assert kinds(records_of(folder)) == ["open", "log", "close"]  # the warning that it is not tracked


def test_records_carry_the_pipelines_runs_to_nest_under(folder, monkeypatch):
    monkeypatch.setenv(mlflow_values.PARENT_ENV, "abc123")
    monkeypatch.setenv(recording.PIPELINE_FLOW_ENV, "flow-run-1")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    with recorded():
        pass
    opened = records_of(folder)[0]
    assert opened["mlflow"]["parent_run_id"] == "abc123"
    assert opened["prefect"] == {
        "enabled": True,
        "api_url": "http://127.0.0.1:1/api",
        "parent_flow_run_id": "flow-run-1",
        "parent_journal": None,
    }


def test_a_cut_last_line_is_not_a_record(tmp_path):
    journal = Journal(tmp_path, "k")
    journal.write("open", stage="s")
    journal.close()
    with open(journal.path, "ab") as f:
        f.write(b'{"kind": "metrics", "ru')
    records, end = read_records(journal.path)
    assert kinds(records) == ["open"] and end < journal.path.stat().st_size
    with open(journal.path, "ab") as f:
        f.write(b'n": "main"}\n')
    more, end2 = read_records(journal.path, end)
    assert more == [{"kind": "metrics", "run": "main"}] and end2 == journal.path.stat().st_size


def test_a_writer_killed_mid_run_loses_nothing_it_wrote(tmp_path):
    # The records are in the file when `write` returns: SIGKILL right after the 500th loses none.
    code = (
        "import os, signal; from gptforge.runtime.journal import Journal\n"
        f"j = Journal({str(tmp_path)!r}, 'k')\n"
        "for i in range(500): j.write('metrics', run='main', metrics={'i': i}, step=i)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert done.returncode == -signal.SIGKILL
    records, _ = read_records(tmp_path / "k.jsonl")
    assert [r["step"] for r in records] == list(range(500))


def test_torchrun_rank0_records_into_its_launchers_journal(folder, monkeypatch):
    with recorded(prefect=False):
        path = os.environ[recording.JOURNAL_ENV]
    # What the worker sees: the launcher's journal in its environment, RANK 0.
    monkeypatch.setenv(recording.JOURNAL_ENV, path)
    monkeypatch.setenv("RANK", "0")
    with recording.attached():
        with tracking.start_run(enabled=True, experiment="gptforge", stage="pretrain") as run:
            run.log_metrics({"loss": 2.0}, step=1)
    assert kinds(records_of(folder)) == ["open", "close", "run_start", "metrics", "run_end"]
    monkeypatch.setenv("RANK", "1")
    with recording.attached():
        assert recording.runs_journal() is None


def test_waits_for_delivery_only_when_asked_and_never_after_a_stop(folder, monkeypatch):
    waited = []
    monkeypatch.setattr(recording, "wait_delivered", lambda paths, timeout: waited.append(timeout) or True)
    with recorded():
        pass
    monkeypatch.setenv(recording.WAIT_ENV, "30")
    with recorded():
        pass
    with pytest.raises(Terminated), recorded():
        raise Terminated(signal.SIGTERM)
    assert waited == [30.0]


def test_the_journal_format_is_json_lines(folder):
    with recorded():
        pass
    [path] = (folder / ".gptforge" / "records").glob("*.jsonl")
    lines = path.read_text().splitlines()
    assert all(json.loads(line)["kind"] for line in lines) and path.name.split("-")[1] == "prepare_classify"
