"""Stop means stop above the stages: `gptforge pipeline` and `dvc repro`.

SIGTERM to `gptforge pipeline` while `benchmark` runs (the case that hung for minutes: its
temporary Prefect server stopped before the stage that still reported to it), Ctrl-C to `dvc
repro` (SIGINT to its whole process group, its stage's temporary Prefect server included), and
SIGTERM to `dvc repro` alone (dvc passes nothing on). Within 30 s no process is left in the
repository, the stage's MLflow run is KILLED and its Prefect flow run Crashed or Cancelled.
The bounds, the stages' tables and the readers of MLflow and Prefect are tests/test_stop.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from cli_support import BIN, set_params, stage_params
from process_support import Paused, logged, processes_in, records_delivered, started, wait_until
from test_stop import (
    BENCHMARK_FOREVER,
    PAUSE_AT,
    READY,
    STOP_WITHIN,
    _flow_run_state,
    _runs,
    _statuses,
    _tracked_env,
    stopped_step,
)


def _recorders_api(repo: Path) -> str:
    """The recorder's own Prefect server (no PREFECT_API_URL configured: stages and the pipeline use it)."""
    return json.loads((repo / ".gptforge" / "recorder" / "state.json").read_text())["prefect_api_url"]


def _wait_for_run(uri: str, experiment: str, stage: str, proc: subprocess.Popen, log: Path) -> None:
    wait_until(
        lambda: [
            r
            for r in _runs(uri, experiment)
            if r.data.tags.get("gptforge.stage") == stage and r.info.status == "RUNNING"
        ],
        proc,
        log,
        f"{stage}'s MLflow run started",
    )


def _gone_within(repo: Path, proc: subprocess.Popen, within: float, since: float) -> list[str]:
    """The processes still running in `repo` `within` seconds from `since` (a time.monotonic()),
    or none as soon as none is (the goal)."""
    deadline = since + within
    while time.monotonic() < deadline:
        left = processes_in(repo)
        if proc.poll() is not None and not left:
            return []
        time.sleep(0.2)
    return processes_in(repo) or ["(the command itself)"]


@pytest.mark.slow
def test_sigterm_to_the_pipeline_during_benchmark_leaves_no_process(
    tmp_path, repo_copy, small_tokenizer, sms_file, alpaca_file, mlflow_uri
):
    """The issue's "Why": SIGTERM to `gptforge pipeline` (no Prefect server configured: the
    recorder's own) while the benchmark stage runs."""
    experiment = "stop-pipeline"
    set_params(
        repo_copy,
        **{
            **stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file),
            **BENCHMARK_FOREVER,
            "tracking.enabled": True,
            "tracking.experiment": experiment,
        },
    )
    env, uri = _tracked_env(tmp_path, mlflow_uri)
    log = tmp_path / "pipeline.log"
    with started(
        [str(BIN / "gptforge"), "pipeline", "benchmark", "--no-pull", "--no-push"], repo_copy, env, log
    ) as proc:
        _wait_for_run(uri, experiment, "benchmark", proc, log)
        wait_until(logged(log, READY["benchmark"]), proc, log, "timing the benchmark")
        proc.send_signal(signal.SIGTERM)
        left = _gone_within(repo_copy, proc, STOP_WITHIN, since=time.monotonic())
    output = log.read_text()
    assert left == [], f"left {STOP_WITHIN:.0f} s after SIGTERM: {left}\n{output[-3000:]}"
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("gptforge: pipeline stopped by SIGTERM"), output[-3000:]
    assert "ConnectError" not in output and "Traceback" not in output, output[-5000:]
    records_delivered(repo_copy)  # the pipeline's and the stage's, through their journals, on the recorder's server
    statuses = _statuses(uri, experiment)
    assert statuses["pipeline"] == "KILLED" and statuses["benchmark"] == "KILLED", statuses
    [run] = [r for r in _runs(uri, experiment) if r.data.tags.get("gptforge.stage") == "benchmark"]
    api = _recorders_api(repo_copy)
    assert _flow_run_state(api, run.data.tags["prefect.flow_run_id"]) == "CRASHED"
    # The pipeline's flow run, the stage's parent, ended Crashed too.
    request = urllib.request.Request(
        f"{api}/flow_runs/filter",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"flows": {"name": {"any_": ["pipeline"]}}}).encode(),
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        [pipeline_run] = json.load(r)
    assert pipeline_run["state"]["type"] == "CRASHED"
    with urllib.request.urlopen(f"{api}/flow_runs/{run.data.tags['prefect.flow_run_id']}", timeout=10) as r:
        tracker = json.load(r)["parent_task_run_id"]
    with urllib.request.urlopen(f"{api}/task_runs/{tracker}", timeout=10) as r:
        assert json.load(r)["flow_run_id"] == pipeline_run["id"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "kill-dvc"])
def test_stopping_dvc_repro_stops_its_stage(
    how, tmp_path, repo_copy, small_tokenizer, sms_file, alpaca_file, mlflow_uri, prefect_api
):
    """Ctrl-C in the terminal of `dvc repro` (SIGINT to its process group: dvc, the stage and,
    were it in that group, the stage's temporary Prefect server), and `kill` of dvc alone, while
    the stage is paused in its training loop (the pause reaches it through dvc's environment)."""
    experiment = f"stop-dvc-{how}"
    set_params(
        repo_copy,
        **{
            **stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file),
            "pretrain.max_steps": 100_000,
            "pretrain.ckpt_interval": 50,
            "tracking.enabled": True,
            "tracking.experiment": experiment,
        },
    )
    # Ctrl-C: the stage's own temporary Prefect server; kill: the session's server, whose
    # records the test can read afterwards.
    pause = Paused(tmp_path, PAUSE_AT)
    env, uri = _tracked_env(
        tmp_path, mlflow_uri, **pause.env(), **({"PREFECT_API_URL": prefect_api} if how == "kill-dvc" else {})
    )
    log = tmp_path / "dvc.log"
    with started([str(BIN / "dvc"), "repro", "pretrain"], repo_copy, env, log) as proc:
        pause.wait(proc, output=log.read_text)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        # The stage takes it while paused (kill: once it sees dvc gone), then stops after one more step.
        pause.release_once_taken(proc, log, STOP_WITHIN, alive=lambda: bool(processes_in(repo_copy)))
        left = _gone_within(repo_copy, proc, STOP_WITHIN, since=start)
    output = log.read_text()
    assert left == [], f"left {STOP_WITHIN:.0f} s after the signal: {left}\n{output[-3000:]}"
    assert stopped_step(output, "SIGINT" if how == "ctrl-c" else "SIGTERM", repo_copy) == PAUSE_AT + 1
    assert "ConnectError" not in output and "Traceback" not in output, output[-5000:]
    records_delivered(repo_copy)
    assert _statuses(uri, experiment)["pretrain"] == "KILLED"
    [run] = [r for r in _runs(uri, experiment) if r.data.tags.get("gptforge.stage") == "pretrain"]
    if how == "ctrl-c":
        assert proc.returncode != 0, output[-3000:]
        assert _flow_run_state(_recorders_api(repo_copy), run.data.tags["prefect.flow_run_id"]) == "CRASHED"
    else:
        assert proc.returncode == 128 + signal.SIGTERM or proc.returncode == -signal.SIGTERM
        assert _flow_run_state(prefect_api, run.data.tags["prefect.flow_run_id"]) in ("CRASHED", "CANCELLED")
