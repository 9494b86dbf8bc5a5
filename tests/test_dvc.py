"""`dvc repro` over the three prepare stages, in a fresh git + DVC repository of this project.

Acceptance of the foundation issue: with params pointing at local files, `dvc repro` runs the
three stages; a second `dvc repro` runs nothing; changing `data.classify.splits` re-runs only
`prepare_classify`. And with the default (remote) sources and no network, the pipeline fails
fast with one line naming the source and the param to set.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, cli_env, error_lines, set_params, stage_params

pytestmark = pytest.mark.slow


def dvc(repo: Path, *args: str, env: dict, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dvc"), *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


def test_repro_runs_stale_stages_only(repo_copy, tmp_path, sms_file, alpaca_file, small_tokenizer, prefect_api,
                                      mlflow_uri):
    set_params(repo_copy, **stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file))
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=mlflow_uri)

    first = dvc(repo_copy, "repro", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert sorted(ran_stages(first.stdout)) == sorted(["prepare_classify", "prepare_instruct", "prepare_pretrain",
                                                       "pretrain", "finetune_classify", "finetune_instruct", "evaluate",
                                                       "benchmark"])
    assert json.loads((repo_copy / "data/pretrain/manifest.json").read_text())["tokens"]["val"] == 500
    for folder in ("classify", "instruct"):
        assert {p.name for p in (repo_copy / "data" / folder).iterdir()} == {"train.jsonl", "val.jsonl", "test.jsonl"}
    lock = yaml.safe_load((repo_copy / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"prepare_pretrain", "prepare_classify", "prepare_instruct", "pretrain",
                                   "finetune_classify", "finetune_instruct", "evaluate", "benchmark"}
    evaluated = json.loads((repo_copy / "metrics/evaluate.json").read_text())
    assert {"pretrain.hellaswag.acc_norm", "instruct.hellaswag.acc_norm"} <= set(evaluated)
    assert "| baseline |" in (repo_copy / "reports/benchmark.md").read_text()
    assert {"test_accuracy", "precision", "recall", "f1"} <= set(json.loads((repo_copy / "metrics/classify.json").read_text()))
    assert len((repo_copy / "reports/instruct_responses.jsonl").read_text().splitlines()) == 2
    assert set(json.loads((repo_copy / "metrics/pretrain.json").read_text())) >= {
        "train_loss", "val_loss", "tokens", "tokens_per_sec", "mfu"}
    assert (repo_copy / "checkpoints/pretrain/final/model.safetensors").is_file()
    assert (repo_copy / "plots/pretrain.csv").read_text().startswith("step,train_loss,val_loss,lr")

    # Each stage run is an MLflow run tagged with its DVC stage and its Prefect flow run.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name("gptforge")
    runs = client.search_runs([exp.experiment_id], "tags.`dvc.stage` != ''", order_by=["attributes.start_time ASC"])
    by_stage = {r.data.tags["dvc.stage"]: r for r in runs}  # the newest run of each stage
    assert {"prepare_pretrain", "prepare_classify", "prepare_instruct", "pretrain"} <= set(by_stage)
    trained = client.search_runs([exp.experiment_id], "tags.`dvc.stage` = 'pretrain'")[0]
    assert trained.info.status == "FINISHED"
    logged_steps = {m.step for m in client.get_metric_history(trained.info.run_id, "train_loss")}
    assert {1, 2, 3, 4} <= logged_steps  # per step (log_interval 1), plus the final value
    assert trained.data.params["model.n_embd"] == "32"
    artifacts = {a.path for a in client.list_artifacts(trained.info.run_id)}
    assert {"checkpoint", "pretrain.csv", "pretrain.png", "pretrain.json"} <= artifacts
    pretrain = by_stage["prepare_pretrain"]
    assert pretrain.info.status == "FINISHED" and pretrain.data.metrics["tokens_per_sec"] > 0
    assert pretrain.data.tags["prefect.flow_run_id"] and pretrain.data.tags["git.commit"]
    assert "manifest.json" in [a.path for a in client.list_artifacts(pretrain.info.run_id)]

    second = dvc(repo_copy, "repro", env=env)
    assert second.returncode == 0 and ran_stages(second.stdout) == [], second.stdout

    set_params(repo_copy, **{"data.classify.splits": [0.6, 0.2, 0.2]})
    third = dvc(repo_copy, "repro", env=env)
    assert third.returncode == 0, third.stdout + third.stderr
    assert ran_stages(third.stdout) == ["prepare_classify", "finetune_classify", "evaluate"]  # and what depends on it
    metrics = json.loads((repo_copy / "metrics/prepare_classify.json").read_text())
    assert metrics["val"] == int(24 * 0.2)

    set_params(repo_copy, **{"classify.lr": 1e-4})
    fourth = dvc(repo_copy, "repro", env=env)
    assert fourth.returncode == 0 and ran_stages(fourth.stdout) == ["finetune_classify", "evaluate"], fourth.stdout

    shown = dvc(repo_copy, "metrics", "show", "--json", env=env)
    assert shown.returncode == 0 and "prepare_classify.json" in shown.stdout


def test_hub_sources_offline_fail_fast_naming_the_param(repo_copy, small_tokenizer, prefect_api, mlflow_uri):
    # The real runs' FineWeb-Edu source (configs/gpt2-124m-fineweb.yaml) on a machine with no
    # network; HF_HUB_OFFLINE (set by conftest) makes `datasets` fail without any network call.
    set_params(repo_copy, **{"tokenizer.path": str(small_tokenizer),
                             "data.pretrain.source": "hf://HuggingFaceFW/fineweb-edu",
                             "data.pretrain.name": "sample-10BT"})
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=mlflow_uri)
    start = time.monotonic()
    r = dvc(repo_copy, "repro", env=env, timeout=120)
    elapsed = time.monotonic() - start
    assert r.returncode != 0 and elapsed < 60
    [line] = error_lines(r.stdout + r.stderr)
    assert "hf://HuggingFaceFW/fineweb-edu" in line and "set data.pretrain.source to a local copy" in line
    assert "Traceback" not in r.stdout + r.stderr
