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
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import BIN, cli_env, error_lines, set_params, stage_params
from gptforge.modeling.weights import load_model as load_model_folder

pytestmark = pytest.mark.slow


def dvc(repo: Path, *args: str, env: dict, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dvc"), *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


def test_repro_runs_stale_stages_only(repo_copy, tmp_path, sms_file, alpaca_file, small_tokenizer, prefect_api,
                                      mlflow_server):
    set_params(repo_copy, **stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file))
    names = {model: f"dvc-test-{model}-{uuid.uuid4().hex[:8]}"
             for model in ("pretrain", "classify", "instruct", "preference")}
    set_params(repo_copy, **{"registry.names": names, "registry.promote": {"classify": {"classify.test_accuracy": ">= 0.0"}},
                             # the GPT-2 BPE (embedded): the language models then export to transformers
                             "tokenizer.path": "sample://gpt2_tokenizer", "model.vocab_size": 50304})
    mlflow_uri = mlflow_server  # a real `mlflow server` (SQLite backend): the registry as teams use it
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=mlflow_uri)

    first = dvc(repo_copy, "repro", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert sorted(ran_stages(first.stdout)) == sorted(["prepare_classify", "prepare_instruct", "prepare_preference",
                                                       "prepare_pretrain", "pretrain", "finetune_classify",
                                                       "finetune_instruct", "finetune_preference", "evaluate",
                                                       "register", "benchmark"])
    assert json.loads((repo_copy / "data/pretrain/manifest.json").read_text())["tokens"]["val"] == 500
    for folder in ("classify", "instruct"):
        assert {p.name for p in (repo_copy / "data" / folder).iterdir()} == {"train.jsonl", "val.jsonl", "test.jsonl"}
    lock = yaml.safe_load((repo_copy / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"prepare_pretrain", "prepare_classify", "prepare_instruct", "prepare_preference",
                                   "pretrain", "finetune_classify", "finetune_instruct", "finetune_preference",
                                   "evaluate", "register", "benchmark"}
    evaluated = json.loads((repo_copy / "metrics/evaluate.json").read_text())
    assert {"pretrain.hellaswag.acc_norm", "instruct.hellaswag.acc_norm", "preference.hellaswag.acc_norm"} <= set(evaluated)
    # The preference stage on the embedded pairs (ch. 7's 1,100, 6 identical ones dropped by the data stage).
    prepared = json.loads((repo_copy / "metrics/prepare_preference.json").read_text())
    assert prepared["records"] == 1100 and prepared["identical"] == 6
    preference = json.loads((repo_copy / "metrics/preference.json").read_text())
    assert preference["train_pairs"] == 8 and preference["val_reward_accuracy_before"] == 0
    assert len((repo_copy / "reports/preference_responses.jsonl").read_text().splitlines()) == 2
    assert load_model_folder(repo_copy / "checkpoints/preference/final").config.n_embd == 32
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

    # Stage register: three registered models, lineage on each version, the gate's alias.
    check_registry(repo_copy, client, names, env)

    second = dvc(repo_copy, "repro", env=env)
    assert second.returncode == 0 and ran_stages(second.stdout) == [], second.stdout
    again = subprocess.run([str(BIN / "gptforge"), "register"], cwd=repo_copy, env=env, capture_output=True, text=True,
                           timeout=300)  # forced: same weights, so no new version
    assert again.returncode == 0, again.stderr[-2000:]
    assert {m: len(client.search_model_versions(f"name = '{n}'")) for m, n in names.items()} == {
        "pretrain": 1, "classify": 1, "instruct": 1, "preference": 1}

    # A gate the new classifier fails: it becomes the challenger, the champion stays version 1.
    set_params(repo_copy, **{"data.classify.splits": [0.6, 0.2, 0.2],
                             "registry.promote": {"classify": {"classify.test_accuracy": ">= 2.0"}}})
    third = dvc(repo_copy, "repro", env=env)
    assert third.returncode == 0, third.stdout + third.stderr
    assert ran_stages(third.stdout) == ["prepare_classify", "finetune_classify", "evaluate", "register"]  # and what depends on it
    metrics = json.loads((repo_copy / "metrics/prepare_classify.json").read_text())
    assert metrics["val"] == int(24 * 0.2)
    assert client.get_model_version_by_alias(names["classify"], "champion").version == "1"
    challenger = client.get_model_version_by_alias(names["classify"], "challenger")
    assert challenger.version == "2" and challenger.tags["gptforge.gate"].startswith("failed: classify.test_accuracy")
    assert json.loads((repo_copy / "metrics/register.json").read_text())["classify.champion"] == 0

    set_params(repo_copy, **{"classify.lr": 1e-4})
    fourth = dvc(repo_copy, "repro", env=env)
    assert fourth.returncode == 0 and ran_stages(fourth.stdout) == ["finetune_classify", "evaluate", "register"], fourth.stdout

    shown = dvc(repo_copy, "metrics", "show", "--json", env=env)
    assert shown.returncode == 0 and "prepare_classify.json" in shown.stdout


def check_registry(repo: Path, client, names: dict, env: dict) -> None:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    for model, stage in (("pretrain", "pretrain"), ("classify", "finetune_classify"), ("instruct", "finetune_instruct"),
                         ("preference", "finetune_preference")):
        (version,) = client.search_model_versions(f"name = '{names[model]}'")
        tags = version.tags
        assert tags["git.commit"] == commit and tags["dvc.stage"] == stage
        outs = {o["path"]: o["md5"] for o in lock[stage]["outs"]}
        assert json.loads(tags["dvc.outs"]) == outs  # the weights' hashes as dvc.lock holds them
        deps = json.loads(tags["dvc.deps"])
        assert deps and all(lock_md5 == deps[d["path"]] for d in lock[stage]["deps"] if (lock_md5 := d.get("md5"))
                            and d["path"] in deps)
        assert tags["mlflow.training_run_id"] and tags["prefect.flow_run_id"]
        assert f"git checkout {commit} && dvc repro {stage}" in version.description
    assert client.get_model_version_by_alias(names["classify"], "champion").version == "1"
    assert "metric.classify.test_accuracy" in client.get_model_version(names["classify"], "1").tags

    # In a fresh process with only mlflow and the package: the classifier by its alias, and the
    # language model through the transformers flavor.
    script = (
        "import json, sys, mlflow\n"
        f"clf = mlflow.pyfunc.load_model('models:/{names['classify']}@champion')\n"
        "out = clf.predict(['WINNER!! You have won a free prize, call now', 'see you at lunch'])\n"
        f"lm = mlflow.transformers.load_model('models:/{names['instruct']}/1')\n"
        "text = lm('Give a synonym', max_new_tokens=4, do_sample=False)[0]['generated_text']\n"
        "print(json.dumps({'labels': list(out['label']), 'p': list(map(float, out['spam_probability'])), "
        "'text': text}))\n")
    proc = subprocess.run([str(BIN / "python"), "-c", script], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["text"].startswith("Give a synonym")
    # the registered pyfunc answers as `gptforge classify` does on the pipeline's own folder
    cli = subprocess.run([str(BIN / "gptforge"), "classify", "WINNER!! You have won a free prize, call now"], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=120)
    label, prob = cli.stdout.split()[:2]
    assert got["labels"][0] == label and abs(got["p"][0] - (float(prob) if label == "spam" else 1 - float(prob))) < 1e-3


def test_hub_sources_offline_fail_fast_naming_the_param(repo_copy, small_tokenizer, prefect_api, mlflow_uri):
    # The real runs' FineWeb-Edu source (configs/gpt2-124m-fineweb.yaml) on a machine with no
    # network; HF_HUB_OFFLINE (set by conftest) makes `datasets` fail without any network call.
    set_params(repo_copy, **{"tokenizer.path": str(small_tokenizer),
                             "data.pretrain.source": "hf://HuggingFaceFW/fineweb-edu",
                             "data.pretrain.name": "sample-10BT"})
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=mlflow_uri)
    start = time.monotonic()
    # Failing fast means one attempt and no wait on the network, checked below; the limit only
    # turns a hang into a failure (the failure took 8 s here beside other tests).
    r = dvc(repo_copy, "repro", env=env, timeout=300)
    print(f"dvc repro failed after {time.monotonic() - start:.1f} s")
    output = r.stdout + r.stderr
    assert r.returncode != 0
    [line] = error_lines(output)
    assert "hf://HuggingFaceFW/fineweb-edu" in line and "set data.pretrain.source to a local copy" in line
    assert "Traceback" not in output and "retry" not in output.lower()  # neither gptforge's retries nor Prefect's
