"""Survive being killed and run twice: pipeline-level kill and resume, and one run at a time.

- `dvc repro` SIGKILLed (its whole process group, as an OOM killer or a lost node would) in
  the middle of `pretrain`, then run again, resumes from the newest checkpoint and ends with
  the same final weights as an uninterrupted `dvc repro` (CPU, fp32, dropout on: the RNG
  state is restored too).
- While one runs, a second `dvc repro` and a second `gptforge pipeline` are refused with a
  clear message and change nothing; so is a second run of the same stage.

Where a test acts on a running pretraining, the run is paused after a checkpointed step
(gptforge.runtime.pause, process_support.Paused) instead of raced: it is running, at a known step, however
fast or slow the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from cli_support import BIN, cli_env, error_lines, run_cli, set_params, snapshot, stage_params
from process_support import Paused, processes_in, records_delivered, started
from safetensors.torch import load_file

from gptforge.runtime import locks

LONG_PRETRAIN = {
    "pretrain.max_steps": 300,
    "pretrain.ckpt_interval": 100,
    "pretrain.log_interval": 100,
    "pretrain.eval_interval": 500,
    "pretrain.keep_last": 3,
    "model.dropout": 0.1,
    "tracking.enabled": False,
}
PAUSE_AT = 100  # a checkpointed step (pretrain.ckpt_interval), in the middle of training


def _hold_in_another_process(cwd: Path, code: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", code + "\nprint('held', flush=True)\nimport time; time.sleep(120)"],
        cwd=cwd,
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_is_refused_naming_its_holder(tmp_path):
    holder = _hold_in_another_process(
        tmp_path,
        "from gptforge.runtime import locks\nheld = locks.hold('pretrain', 'stage pretrain'); held.__enter__()",
    )
    try:
        with pytest.raises(
            locks.Busy,
            match=rf"stage pretrain is already running in {tmp_path} "
            rf"\(pid {holder.pid} on .*, since .*\); wait for it",
        ):
            with locks.hold("pretrain", "stage pretrain", root=tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    # The kernel released it with the process: a killed holder never blocks the next run.
    with locks.hold("pretrain", "stage pretrain", root=tmp_path):
        with locks.hold("pretrain", "stage pretrain", root=tmp_path):  # re-entrant in one process
            pass


def test_dvc_lock_is_detected(tmp_path):
    (tmp_path / ".dvc/tmp").mkdir(parents=True)
    locks.check_dvc_idle(tmp_path)  # no lock file: idle
    holder = _hold_in_another_process(tmp_path, "import zc.lockfile\nheld = zc.lockfile.LockFile('.dvc/tmp/lock')")
    try:
        with pytest.raises(locks.Busy, match=rf"a DVC command is running in {tmp_path} \(pid {holder.pid}\)"):
            locks.check_dvc_idle(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    locks.check_dvc_idle(tmp_path)


def test_second_pipeline_and_second_stage_are_refused_and_change_nothing(repo_copy):
    holder = _hold_in_another_process(
        repo_copy,
        "from gptforge.runtime import locks\n"
        "a = locks.hold('pipeline', 'a gptforge pipeline'); a.__enter__()\n"
        "b = locks.hold('prepare_classify', 'stage prepare_classify'); b.__enter__()",
    )
    try:
        before = snapshot(repo_copy)
        env = cli_env(GPTFORGE_PREFECT="0")
        out = run_cli(["pipeline", "-S", "data.classify.seed=9"], repo_copy, env, timeout=120)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        [line] = error_lines(out.stderr)
        assert line.startswith(
            f"gptforge: error: a gptforge pipeline is already running in {repo_copy} (pid {holder.pid} "
        )
        stage = run_cli(["prepare", "classify"], repo_copy, env, timeout=120)
        assert stage.returncode == 1
        assert error_lines(stage.stderr)[0].startswith("gptforge: error: stage prepare_classify is already running")
        after = snapshot(repo_copy)
        assert {k: v for k, v in after.items() if not k.startswith(".gptforge/")} == {
            k: v for k, v in before.items() if not k.startswith(".gptforge/")
        }
    finally:
        holder.kill()
        holder.wait()


def _weights(repo: Path) -> dict[str, torch.Tensor]:
    return load_file(repo / "checkpoints/pretrain/final/model.safetensors")


def _dvc(repo: Path, *args: str, log: Path | None = None, **env: str) -> subprocess.Popen:
    """`dvc ARGS` in its own process group; its output piped, or written to `log` (a paused run
    is not read from while it waits)."""
    out = open(log, "w") if log else subprocess.PIPE
    try:
        return subprocess.Popen(
            [str(BIN / "dvc"), *args],
            cwd=repo,
            env=cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    finally:
        if log:
            out.close()


@pytest.mark.slow
def test_dvc_repro_killed_mid_pretrain_resumes_to_the_same_weights(
    tmp_path, repo_copy, small_tokenizer, sms_file, alpaca_file
):
    params = {**stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file), **LONG_PRETRAIN}
    set_params(repo_copy, **params)
    reference = tmp_path / "reference"
    subprocess.run(["git", "clone", "-q", str(repo_copy), str(reference)], check=True)
    set_params(reference, **params)

    straight = _dvc(reference, "repro", "pretrain")
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out[-3000:]

    pause = Paused(tmp_path, PAUSE_AT)
    log = tmp_path / "first.log"
    first = _dvc(repo_copy, "repro", "pretrain", log=log, **pause.env())
    ckpts = repo_copy / "checkpoints/pretrain"
    try:
        pause.wait(first, output=log.read_text)

        # While it runs (paused after step 100): a second dvc repro and a second pipeline are
        # refused and change nothing.
        lock_before = (repo_copy / "dvc.lock").read_bytes()
        params_before = (repo_copy / "params.yaml").read_bytes()
        second = _dvc(repo_copy, "repro", "pretrain")
        second_out, _ = second.communicate(timeout=120)
        # DVC's own refusal: its repository lock, or (while a stage command runs) the stage's files.
        assert second.returncode != 0, second_out
        assert "Unable to acquire lock" in second_out or "is busy, it is being blocked by" in second_out, second_out
        pipe = run_cli(["pipeline", "-S", "pretrain.lr=0.5"], repo_copy, cli_env(GPTFORGE_PREFECT="0"), timeout=120)
        assert pipe.returncode == 1, pipe.stderr
        assert error_lines(pipe.stderr)[0].startswith(f"gptforge: error: a DVC command is running in {repo_copy}")
        assert (repo_copy / "params.yaml").read_bytes() == params_before
        assert first.poll() is None and pause.path.is_file(), "the first run must still be running, paused"
        assert sorted(p.name for p in ckpts.glob("step_*")) == [f"step_{PAUSE_AT:08d}"]
    finally:
        # Killed right after its checkpoint of step 100, in the middle of training (or, when a
        # check failed, not left behind): dvc, the stage command and all, nothing gets to clean up.
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert not (ckpts / "final").exists()
    assert (repo_copy / "dvc.lock").read_bytes() == lock_before  # pretrain not recorded as done

    again = _dvc(repo_copy, "repro", "pretrain")
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out[-3000:]
    assert "Running stage 'pretrain'" in out, out[-3000:]
    assert "resumed from" in out and f"step_{PAUSE_AT:08d} at step {PAUSE_AT}" in out, out[-3000:]
    a, b = _weights(reference), _weights(repo_copy)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lock = yaml.safe_load((repo_copy / "dvc.lock").read_text())
    assert "pretrain" in lock["stages"]


@pytest.mark.slow
def test_sigterm_to_the_pipeline_checkpoints_the_stage_and_marks_runs_killed(
    tmp_path, repo_copy, small_tokenizer, sms_file, alpaca_file, mlflow_uri
):
    """SIGTERM to `gptforge pipeline` (a worker cancelling it, `docker stop`) reaches dvc and the
    training stage: the stage checkpoints the step it is at, both MLflow runs end KILLED, no
    process is left behind, and the next run resumes from that checkpoint."""
    params = {
        **stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file),
        **LONG_PRETRAIN,
        "tracking.enabled": True,
        "tracking.experiment": "pipeline-sigterm",
    }
    set_params(repo_copy, **params)
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=mlflow_uri)
    pause = Paused(tmp_path, PAUSE_AT)
    log = tmp_path / "pipeline.log"
    ckpts = repo_copy / "checkpoints/pretrain"
    with started(
        [str(BIN / "gptforge"), "pipeline", "pretrain", "--no-pull", "--no-push"],
        repo_copy,
        {**env, **pause.env()},
        log,
    ) as proc:
        pause.wait(proc, output=log.read_text)
        proc.send_signal(signal.SIGTERM)
        # The stage takes it while paused (the pipeline passes it on through dvc), then stops
        # after the next step.
        pause.release_once_taken(proc, log)
        proc.wait(timeout=300)
    err = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("gptforge: pipeline stopped by SIGTERM")
    stopped = [line for line in err.splitlines() if "pretrain stopped by SIGTERM at step" in line]
    assert stopped, err[-3000:]
    step = int(stopped[0].split(" at step ")[1].split(";")[0])
    assert step == PAUSE_AT + 1, err[-3000:]
    assert (ckpts / f"step_{step:08d}" / "checksums.json").is_file() and not (ckpts / "final").exists()
    assert processes_in(repo_copy) == []  # dvc and the stage command are gone too
    records_delivered(repo_copy)  # a stopped stage leaves its records to the recorder

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name("pipeline-sigterm")
    runs = {
        r.data.tags["gptforge.stage"]: r
        for r in client.search_runs([exp.experiment_id])
        if r.data.tags.get("gptforge.stage") in ("pipeline", "pretrain")
    }
    assert runs["pipeline"].info.status == "KILLED" and runs["pretrain"].info.status == "KILLED"
    assert runs["pretrain"].data.tags["mlflow.parentRunId"] == runs["pipeline"].info.run_id

    again = run_cli(["pipeline", "pretrain", "--no-pull", "--no-push"], repo_copy, env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"step_{step:08d}" in again.stderr and f"at step {step}" in again.stderr
    assert (ckpts / "final/model.safetensors").is_file()
