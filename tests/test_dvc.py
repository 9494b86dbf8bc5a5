"""`dvc repro` in a fresh git + DVC repository of this project: its helpers, the registry's
checks, and the default (remote) sources failing fast with no network.

The foundation issue's acceptance (with params pointing at local files `dvc repro` runs every
stage, a second `dvc repro` runs nothing, a params change re-runs only the stale stages) is
checked on the one full pipeline run of the suite, in test_deploy.py, with `check_registry`
from here.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from cli_support import BIN, cli_env, error_lines, set_params

pytestmark = pytest.mark.slow


def dvc(repo: Path, *args: str, env: dict, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dvc"), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '([\w@.-]+)'", output)  # foreach entries too: register@classify


def check_registry(repo: Path, client, names: dict, env: dict) -> None:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    for model, stage in (
        ("pretrain", "pretrain"),
        ("classify", "finetune_classify"),
        ("instruct", "finetune_instruct"),
        ("preference", "finetune_preference"),
        ("reward", "train_reward"),
        ("rl", "finetune_rl"),
    ):
        (version,) = client.search_model_versions(f"name = '{names[model]}'")
        tags = version.tags
        assert tags["git.commit"] == commit and tags["dvc.stage"] == stage
        outs = {o["path"]: o["md5"] for o in lock[stage]["outs"]}
        assert json.loads(tags["dvc.outs"]) == outs  # the weights' hashes as dvc.lock holds them
        deps = json.loads(tags["dvc.deps"])
        assert deps and all(
            lock_md5 == deps[d["path"]] for d in lock[stage]["deps"] if (lock_md5 := d.get("md5")) and d["path"] in deps
        )
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
        "'text': text}))\n"
    )
    proc = subprocess.run(
        [str(BIN / "python"), "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["text"].startswith("Give a synonym")
    # the registered pyfunc answers as `gptforge classify` does on the pipeline's own folder
    cli = subprocess.run(
        [str(BIN / "gptforge"), "classify", "WINNER!! You have won a free prize, call now"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    label, prob = cli.stdout.split()[:2]
    assert got["labels"][0] == label and abs(got["p"][0] - (float(prob) if label == "spam" else 1 - float(prob))) < 1e-3


def test_hub_sources_offline_fail_fast_naming_the_param(repo_copy, small_tokenizer, prefect_api, mlflow_uri):
    # The real runs' FineWeb-Edu source (configs/gpt2-124m-fineweb.yaml) on a machine with no
    # network; HF_HUB_OFFLINE (set by conftest) makes `datasets` fail without any network call.
    set_params(
        repo_copy,
        **{
            "tokenizer.path": str(small_tokenizer),
            "data.pretrain.source": "hf://HuggingFaceFW/fineweb-edu",
            "data.pretrain.name": "sample-10BT",
        },
    )
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=mlflow_uri)
    start = time.monotonic()
    # Failing fast means one attempt and no wait on the network, checked below; the limit only
    # turns a hang into a failure (the failure took 8 s here beside other tests).
    # Its stage only: a whole `dvc repro` would first dequantize the quickstart's SmolLM2
    # (prepare_base@smollm2, about 25 s) before reaching the stage under test.
    r = dvc(repo_copy, "repro", "prepare_pretrain", env=env, timeout=300)
    print(f"dvc repro failed after {time.monotonic() - start:.1f} s")
    output = r.stdout + r.stderr
    assert r.returncode != 0
    [line] = error_lines(output)
    assert "hf://HuggingFaceFW/fineweb-edu" in line and "set data.pretrain.source to a local copy" in line
    assert "Traceback" not in output and "retry" not in output.lower()  # neither gptforge's retries nor Prefect's
