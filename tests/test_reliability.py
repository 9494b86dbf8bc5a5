"""Survive being killed and run twice: pipeline-level kill and resume, and one run at a time.

- `dvc repro` SIGKILLed (its whole process group, as an OOM killer or a lost node would) in
  the middle of `pretrain`, then run again, resumes from the newest checkpoint and ends with
  the same final weights as an uninterrupted `dvc repro` (CPU, fp32, dropout on: the RNG
  state is restored too).
- While one runs, a second `dvc repro` and a second `gptforge pipeline` are refused with a
  clear message and change nothing; so is a second run of the same stage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import BIN, cli_env, error_lines, processes_in, run_cli, set_params, snapshot, stage_params
from gptforge import locks

LONG_PRETRAIN = {"pretrain.max_steps": 2000, "pretrain.ckpt_interval": 100, "pretrain.log_interval": 100,
                 "pretrain.eval_interval": 500, "pretrain.keep_last": 3, "model.dropout": 0.1, "tracking.enabled": False}


def _hold_in_another_process(cwd: Path, code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code + "\nprint('held', flush=True)\nimport time; time.sleep(120)"],
                            cwd=cwd, stdout=subprocess.PIPE, text=True, env=cli_env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_is_refused_naming_its_holder(tmp_path):
    holder = _hold_in_another_process(tmp_path, "from gptforge import locks\n"
                                      "held = locks.hold('pretrain', 'stage pretrain'); held.__enter__()")
    try:
        with pytest.raises(locks.Busy, match=rf"stage pretrain is already running in {tmp_path} "
                                             rf"\(pid {holder.pid} on .*, since .*\); wait for it"):
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
    holder = _hold_in_another_process(repo_copy, "from gptforge import locks\n"
                                      "a = locks.hold('pipeline', 'a gptforge pipeline'); a.__enter__()\n"
                                      "b = locks.hold('prepare_classify', 'stage prepare_classify'); b.__enter__()")
    try:
        before = snapshot(repo_copy)
        env = cli_env(GPTFORGE_PREFECT="0")
        out = run_cli(["pipeline", "-S", "data.classify.seed=9"], repo_copy, env, timeout=120)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        [line] = error_lines(out.stderr)
        assert line.startswith(f"gptforge: error: a gptforge pipeline is already running in {repo_copy} "
                               f"(pid {holder.pid} ")
        stage = run_cli(["prepare", "classify"], repo_copy, env, timeout=120)
        assert stage.returncode == 1
        assert error_lines(stage.stderr)[0].startswith("gptforge: error: stage prepare_classify is already running")
        after = snapshot(repo_copy)
        assert {k: v for k, v in after.items() if not k.startswith(".gptforge/")} == \
               {k: v for k, v in before.items() if not k.startswith(".gptforge/")}
    finally:
        holder.kill()
        holder.wait()


def _weights(repo: Path) -> dict[str, torch.Tensor]:
    return load_file(repo / "checkpoints/pretrain/final/model.safetensors")


def _dvc(repo: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "dvc"), *args], cwd=repo, env=cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            **popen)


@pytest.mark.slow
def test_dvc_repro_killed_mid_pretrain_resumes_to_the_same_weights(tmp_path, repo_copy, small_tokenizer, sms_file,
                                                                    alpaca_file):
    params = {**stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file), **LONG_PRETRAIN}
    set_params(repo_copy, **params)
    reference = tmp_path / "reference"
    subprocess.run(["git", "clone", "-q", str(repo_copy), str(reference)], check=True)
    set_params(reference, **params)

    straight = _dvc(reference, "repro", "pretrain")
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out[-3000:]

    first = _dvc(repo_copy, "repro", "pretrain")
    ckpts = repo_copy / "checkpoints/pretrain"
    deadline = time.monotonic() + 300
    while not (ckpts / "step_00000100").is_dir() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.poll() is None, "pretrain finished before it could be killed: make it longer"

    # While it runs: a second dvc repro and a second pipeline are refused and change nothing.
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
    assert first.poll() is None, "the first run must still be running for this check to mean anything"

    # Kill it right after its next checkpoint, in the middle of training.
    newest = max(p.name for p in ckpts.glob("step_*"))
    while max(p.name for p in ckpts.glob("step_*")) == newest and first.poll() is None:
        time.sleep(0.01)
    assert first.poll() is None, "pretrain finished before it could be killed: make it longer"
    os.killpg(first.pid, signal.SIGKILL)  # dvc, the stage command and all: nothing gets to clean up
    first.wait()
    assert not (ckpts / "final").exists()
    assert (repo_copy / "dvc.lock").read_bytes() == lock_before  # pretrain not recorded as done

    again = _dvc(repo_copy, "repro", "pretrain")
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out[-3000:]
    assert "Running stage 'pretrain'" in out and "resumed from" in out
    a, b = _weights(reference), _weights(repo_copy)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lock = yaml.safe_load((repo_copy / "dvc.lock").read_text())
    assert "pretrain" in lock["stages"]


@pytest.mark.slow
def test_sigterm_to_the_pipeline_checkpoints_the_stage_and_marks_runs_killed(tmp_path, repo_copy, small_tokenizer,
                                                                             sms_file, alpaca_file, mlflow_uri):
    """SIGTERM to `gptforge pipeline` (a worker cancelling it, `docker stop`) reaches dvc and the
    training stage: the stage checkpoints the step it is at, both MLflow runs end KILLED, no
    process is left behind, and the next run resumes from that checkpoint."""
    params = {**stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file), **LONG_PRETRAIN,
              "tracking.enabled": True, "tracking.experiment": "pipeline-sigterm"}
    set_params(repo_copy, **params)
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=mlflow_uri)
    proc = subprocess.Popen([str(BIN / "gptforge"), "pipeline", "pretrain", "--no-pull", "--no-push"], cwd=repo_copy,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpts = repo_copy / "checkpoints/pretrain"
    deadline = time.monotonic() + 300
    while not (ckpts / "step_00000100").is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the pipeline finished before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("gptforge: pipeline stopped by SIGTERM")
    stopped = [line for line in err.splitlines() if "pretrain stopped by SIGTERM at step" in line]
    assert stopped, err[-3000:]
    step = int(stopped[0].split(" at step ")[1].split(";")[0])
    assert (ckpts / f"step_{step:08d}" / "checksums.json").is_file() and not (ckpts / "final").exists()
    assert processes_in(repo_copy) == []  # dvc and the stage command are gone too

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name("pipeline-sigterm")
    runs = {r.data.tags["gptforge.stage"]: r for r in client.search_runs([exp.experiment_id])
            if r.data.tags.get("gptforge.stage") in ("pipeline", "pretrain")}
    assert runs["pipeline"].info.status == "KILLED" and runs["pretrain"].info.status == "KILLED"
    assert runs["pretrain"].data.tags["mlflow.parentRunId"] == runs["pipeline"].info.run_id

    again = run_cli(["pipeline", "pretrain", "--no-pull", "--no-push"], repo_copy, env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"step_{step:08d}" in again.stderr and f"at step {step}" in again.stderr
    assert (ckpts / "final/model.safetensors").is_file()
