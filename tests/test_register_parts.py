"""The parts of the `register` stage: the spam classifier as an MLflow pyfunc (it predicts in a
fresh process what `classify_texts` does here), the promotion gate (operators, boundaries, the
longest-prefix metrics file, missing metrics), and the lineage of a version (weights hash, DVC
lock hashes, the training run, the version's tags and description)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pandas as pd
import pytest
import test_finetune_classify as ftc
import torch

from gptforge.errors import BadInput
from gptforge.finetune import classifier as clf
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.register import gate, lineage
from gptforge.runtime.tracking import start_run

base = ftc.base  # the small random GPT checkpoint of test_finetune_classify (a fixture), reused here

TEXTS = ["WINNER!! Claim your free prize now, call 09061701461", "see you at lunch"]


@pytest.fixture(scope="module")
def store(mlflow_uri, tmp_path_factory):
    """A private copy of the session's migrated MLflow database, and a fresh experiment name."""
    db = tmp_path_factory.mktemp("register-store") / "mlflow.db"
    shutil.copy(mlflow_uri[len("sqlite:///") :], db)
    return f"sqlite:///{db}"


@pytest.fixture
def tracked(store, tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI names the store, cwd is a scratch folder; returns a new experiment name."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    for name in ("GPTFORGE_PARENT_RUN_ID", "DVC_STAGE", "GPTFORGE_RUN_TAGS", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return f"register-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------------------------------------
# pyfunc


@pytest.fixture(scope="module")
def classifier_folder(base, tmp_path_factory):
    """A classifier (random head) on the small GPT of test_finetune_classify, saved as the recipe does."""
    from gptforge.modeling.weights import load_model

    torch.manual_seed(1)
    folder = tmp_path_factory.mktemp("classifier") / "final"
    clf.save_classifier(clf.GPTClassifier(load_model(base), 2, max_length=ftc.BLOCK), folder)
    return folder


@pytest.mark.slow
def test_pyfunc_predicts_in_a_fresh_process_what_classify_texts_does(
    classifier_folder, small_tokenizer, tracked, store, tmp_path
):
    import mlflow

    from gptforge.register.pyfunc import log_classifier

    with start_run(enabled=True, experiment=tracked, stage="register") as run:
        info = log_classifier(classifier_folder, tokenizer_path=small_tokenizer)
    assert info.signature.outputs.input_names() == ["label", "spam_probability"]
    requirements = mlflow.pyfunc.get_model_dependencies(info.model_uri, format="pip")
    pins = open(requirements).read().split()
    assert f"mlflow=={mlflow.__version__}" in pins and f"torch=={torch.__version__.split('+')[0]}" in pins

    enc = load_tokenizer(str(small_tokenizer))
    want = clf.classify_texts(clf.load_classifier(classifier_folder), TEXTS, enc, "cpu")
    want_spam = [p if i == 1 else 1 - p for i, p in want]

    code = (
        "import json, sys, mlflow, pandas as pd; m = mlflow.pyfunc.load_model(sys.argv[1]); "
        "out = m.predict(pd.DataFrame({'text': json.loads(sys.argv[2])})); "
        "print(json.dumps(out.to_dict('list')))"
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, f"runs:/{run.run_id}/model", json.dumps(TEXTS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["label"] == [["ham", "spam"][i] for i, _ in want]
    assert got["spam_probability"] == pytest.approx(want_spam, abs=1e-6)

    # In this process, through MLflow's own input handling: a list, a Series, a one-column frame.
    model = mlflow.pyfunc.load_model(info.model_uri)
    for given in (TEXTS, pd.Series(TEXTS), pd.DataFrame({"sms": TEXTS})):
        out = model.predict(given)
        assert list(out.columns) == ["label", "spam_probability"]
        assert out["label"].tolist() == got["label"]
        assert out["spam_probability"].tolist() == pytest.approx(want_spam, abs=1e-6)
    with pytest.raises(BadInput, match="text"):
        model.unwrap_python_model().predict(None, pd.DataFrame({"a": TEXTS, "b": TEXTS}))


# ---------------------------------------------------------------------------------------------
# gate


@pytest.fixture
def metrics_dir(tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    (folder / "classify.json").write_text(json.dumps({"test_accuracy": 0.96334, "steps": 40}))
    (folder / "evaluate.json").write_text(json.dumps({"instruct.hellaswag.acc_norm": 0.23, "base.mmlu.acc": 0.5}))
    return folder


@pytest.mark.parametrize(
    "text, op, number",
    [
        (">= 0.95", ">=", 0.95),
        (">0.3", ">", 0.3),
        ("<= 2.5", "<=", 2.5),
        ("< 1", "<", 1.0),
        ("==1", "==", 1.0),
        (" >= -1e-3 ", ">=", -0.001),
    ],
)
def test_parse_condition(text, op, number):
    assert gate.parse_condition(text) == (op, number)


@pytest.mark.parametrize("text", ["0.95", "=> 0.95", ">= ", ">= x", "!= 1", ">= 0.9 0.8", ">= nan", "", 0.95, None])
def test_parse_condition_refuses_anything_else_in_one_line(text):
    with pytest.raises(BadInput) as e:
        gate.check("classifier", {"classify.test_accuracy": text}, "no-such-dir")
    message = str(e.value)
    assert "registry.promote.classifier.classify.test_accuracy" in message and "\n" not in message


@pytest.mark.parametrize(
    "condition, passed",
    [
        (">= 0.96334", True),
        ("> 0.96334", False),
        ("<= 0.96334", True),
        ("< 0.96334", False),
        ("== 0.96334", True),
        ("== 0.9633", False),
        (">= 0.97", False),
        ("< 1", True),
    ],
)
def test_each_operator_at_its_boundary(metrics_dir, condition, passed):
    result = gate.check("classifier", {"classify.test_accuracy": condition}, metrics_dir)
    assert result.passed is passed
    assert result.values == {"classify.test_accuracy": 0.96334}
    assert result.reasons == [f"classify.test_accuracy 0.9633 {condition}: {'ok' if passed else 'not met'}"]


def test_the_longest_prefix_names_the_file(metrics_dir):
    # Both metrics/evaluate.json and metrics/evaluate.instruct.json exist: the longer prefix wins.
    (metrics_dir / "evaluate.instruct.json").write_text(json.dumps({"hellaswag.acc_norm": 0.9}))
    assert gate.read_metric("evaluate.instruct.hellaswag.acc_norm", metrics_dir) == 0.9
    assert gate.read_metric("evaluate.base.mmlu.acc", metrics_dir) == 0.5
    (metrics_dir / "evaluate.instruct.json").unlink()
    result = gate.check("instruct", {"evaluate.instruct.hellaswag.acc_norm": ">= 0.30"}, metrics_dir)
    assert not result.passed
    assert result.reasons == ["evaluate.instruct.hellaswag.acc_norm 0.2300 >= 0.30: not met"]


def test_missing_file_or_key_fails_the_gate_with_a_reason(tmp_path, metrics_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)  # metrics_dir's default "metrics" is tmp_path/metrics
    result = gate.check(
        "m", {"evaluate.instruct.hellaswag.acc": ">= 0.3", "nothing.here": "> 0", "classify.test_accuracy": ">= 0.95"}
    )
    assert not result.passed
    assert result.reasons[0] == "metrics/evaluate.json has no instruct.hellaswag.acc"
    assert result.reasons[1].startswith("no metrics file for nothing.here")
    assert result.reasons[2] == "classify.test_accuracy 0.9633 >= 0.95: ok"
    assert result.values == {"classify.test_accuracy": 0.96334}
    assert gate.check("m", {}, metrics_dir) == gate.GateResult(True, ["no conditions"], {})


# ---------------------------------------------------------------------------------------------
# lineage


def test_folder_hash_is_stable_and_sees_one_byte(tmp_path):
    a = tmp_path / "a"
    (a / "sub").mkdir(parents=True)
    (a / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (a / "sub" / "config.json").write_text('{"n": 1}')
    first = lineage.folder_hash(a)
    b = tmp_path / "b"
    shutil.copytree(a, b)  # another place, other mtimes: the same hash
    os.utime(b / "model.safetensors", (0, 0))
    assert lineage.folder_hash(b) == first and len(first) == 64
    data = bytearray((b / "model.safetensors").read_bytes())
    data[500] ^= 1
    (b / "model.safetensors").write_bytes(bytes(data))
    assert lineage.folder_hash(b) != first
    (b / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (b / "sub" / "config.json").rename(b / "config.json")  # same bytes, another path
    assert lineage.folder_hash(b) != first
    with pytest.raises(BadInput):
        lineage.folder_hash(tmp_path / "missing")


DVC_LOCK = """\
schema: '2.0'
stages:
  finetune_classify:
    cmd: gptforge finetune classify
    deps:
    - path: checkpoints/pretrain/final
      hash: md5
      md5: 1111.dir
      size: 100
      nfiles: 3
    - path: data/classify
      hash: md5
      md5: 2222.dir
      size: 50
      nfiles: 3
    - path: src/gptforge/finetune/classify.py
      hash: md5
      md5: 3333
      size: 10
    params:
      params.yaml:
        classify.epochs: 1
    outs:
    - path: checkpoints/classify
      hash: md5
      md5: 4444.dir
      size: 90
      nfiles: 4
    - path: metrics/classify.json
      md5: '5555'
      size: 20
"""


def test_dvc_lock_hashes(tmp_path):
    lock = tmp_path / "dvc.lock"
    lock.write_text(DVC_LOCK)
    assert lineage.dvc_lock_hashes("finetune_classify", lock) == {
        "outs": {"checkpoints/classify": "4444.dir", "metrics/classify.json": "5555"},
        "deps": {"checkpoints/pretrain/final": "1111.dir", "data/classify": "2222.dir"},
    }
    assert lineage.dvc_lock_hashes("pretrain", lock) == {}
    assert lineage.dvc_lock_hashes("finetune_classify", tmp_path / "none.lock") == {}


def test_training_run_is_the_newest_finished_run_of_the_stage(tracked, store, monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    assert lineage.training_run(client, tracked, "finetune_classify") is None  # no such experiment
    monkeypatch.setenv("DVC_STAGE", "finetune_classify")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no checkout: the image's commit
    monkeypatch.setenv("GPTFORGE_GIT_COMMIT", "c0ffee123")
    ids = []
    for flow_run in ("flow-1", "flow-2"):
        monkeypatch.setenv("GPTFORGE_RUN_TAGS", json.dumps({"prefect.flow_run_id": flow_run}))
        with start_run(enabled=True, experiment=tracked, stage="finetune_classify") as run:
            ids.append(run.run_id)
    with pytest.raises(RuntimeError), start_run(enabled=True, experiment=tracked, stage="finetune_classify"):
        raise RuntimeError("a failed run is no training run")
    monkeypatch.setenv("DVC_STAGE", "pretrain")
    with start_run(enabled=True, experiment=tracked, stage="pretrain"):
        pass  # another stage
    experiment_id = client.get_experiment_by_name(tracked).experiment_id
    client.create_run(experiment_id, tags={"dvc.stage": "finetune_classify"})  # newest, still RUNNING

    run_id, tags = lineage.training_run(client, tracked, "finetune_classify")
    assert run_id == ids[1]
    assert tags["prefect.flow_run_id"] == "flow-2" and tags["dvc.stage"] == "finetune_classify"
    assert tags["git.commit"] == "c0ffee123"
    assert lineage.training_run(client, tracked, "evaluate") is None


def test_version_tags_and_description():
    lock = {"outs": {"checkpoints/classify": "4444.dir"}, "deps": {"data/classify": "2222.dir"}}
    run = ("abc123", {"git.commit": "c0ffee", "prefect.flow_run_id": "flow-2", "other": "x"})
    tags = lineage.version_tags(
        stage="finetune_classify",
        weights_hash="f" * 64,
        lock=lock,
        run=run,
        metrics={"classify.test_accuracy": 0.1 + 0.2, "classify.steps": 40},
    )
    assert tags == {
        "gptforge.weights_hash": "f" * 64,
        "git.commit": "c0ffee",
        "dvc.stage": "finetune_classify",
        "dvc.outs": '{"checkpoints/classify": "4444.dir"}',
        "dvc.deps": '{"data/classify": "2222.dir"}',
        "prefect.flow_run_id": "flow-2",
        "mlflow.training_run_id": "abc123",
        "metric.classify.test_accuracy": "0.30000000000000004",
        "metric.classify.steps": "40.0",
    }
    assert float(tags["metric.classify.test_accuracy"]) == 0.1 + 0.2
    assert lineage.version_tags(stage="s", commit="beef", run=run)["git.commit"] == "beef"  # given wins
    assert lineage.version_tags(stage="s") == {"dvc.stage": "s"}  # absent values left out
    assert lineage.description("finetune_classify", "c0ffee") == (
        "Made by DVC stage `finetune_classify` at git commit `c0ffee`. Reproduce: "
        "`git checkout c0ffee && dvc repro finetune_classify` (the data and weights hashes are in the tags)."
    )
