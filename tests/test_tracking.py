"""Tracking: one MLflow run per stage run, read back through MlflowClient from a SQLite store.

Every test gets its own copy of one migrated database (migrations cost about 7 s once).
"""

from __future__ import annotations

import math
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import gptforge
from gptforge.config.load import load_config
from gptforge.runtime import tracking
from gptforge.runtime.mlflow_values import artifact_location, is_secret, metric_name
from gptforge.runtime.tracking import MlflowRun, NullRun, start_run


def _db_path(uri: str) -> Path:
    return Path(uri[len("sqlite:///") :])


@pytest.fixture(scope="module")
def template_db(mlflow_uri, tmp_path_factory) -> Path:
    """A private copy of the session's migrated database, taken before this module writes to it."""
    dst = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    shutil.copy(_db_path(mlflow_uri), dst)
    return dst


@pytest.fixture
def clean_env(tmp_path, monkeypatch) -> Path:
    """cwd is an empty folder outside any git checkout; no tracking variables from the caller."""
    work = tmp_path / "work"
    work.mkdir()
    for name in (
        "MLFLOW_TRACKING_URI",
        "GPTFORGE_PARENT_RUN_ID",
        "DVC_STAGE",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_EXPERIMENT_ID",
        "MLFLOW_RUN_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.chdir(work)
    return work


@pytest.fixture
def store(template_db, tmp_path, clean_env, monkeypatch):
    """A migrated SQLite store in its own folder (not the cwd), named by MLFLOW_TRACKING_URI."""
    from mlflow.tracking import MlflowClient

    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(template_db, db)
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # A fresh experiment name: the template may hold experiments of tests that ran before it was copied.
    exp = f"gf-{uuid.uuid4().hex[:8]}"
    return SimpleNamespace(uri=uri, db=db, cwd=clean_env, client=MlflowClient(tracking_uri=uri), exp=exp)


def one_run(store, stage="prepare_pretrain", **kw):
    """Run an empty stage run and return its run id."""
    with start_run(enabled=True, experiment=store.exp, stage=stage, **kw) as run:
        assert isinstance(run, MlflowRun)
        run_id = run.run_id
    return run_id


def git_repo(folder: Path) -> str:
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    subprocess.run(
        ["git", "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-q", "--allow-empty", "-m", "x"],
        cwd=folder,
        check=True,
    )
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=folder, check=True, capture_output=True, text=True
    ).stdout.strip()


# ---------------------------------------------------------------------------------------------
# No store needed


@pytest.mark.parametrize(
    "name, clean",
    [
        ("acc,none", "acc_none"),
        ("acc_norm,none", "acc_norm_none"),
        ("mmlu/acc stderr:x-y.z", "mmlu/acc stderr:x-y.z"),
        ("loss(val)", "loss_val_"),
        ("ü", "_"),
    ],
)
def test_metric_name(name, clean):
    assert metric_name(name) == clean


@pytest.mark.parametrize(
    "name, secret",
    [
        ("data.api_token", True),
        ("hf_key", True),
        ("HF_TOKEN", True),
        ("db.password", True),
        ("aws_secret_access_key", True),
        ("data.pretrain.max_tokens", False),
        ("data.pretrain.val_tokens", False),
        ("tokenizer.path", False),
        ("pretrain.keep_last", False),
    ],
)
def test_is_secret(name, secret):
    assert is_secret(name) is secret


def test_artifact_location(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    beside = (tmp_path / "mlartifacts").as_uri()
    assert artifact_location("sqlite:///mlflow.db") == beside
    assert artifact_location(f"sqlite:///{tmp_path}/mlflow.db") == beside
    assert artifact_location(f"sqlite:///{tmp_path}/sub/x.db?timeout=5") == (tmp_path / "sub" / "mlartifacts").as_uri()
    assert artifact_location("sqlite:///rel/dir/m.db") == (tmp_path / "rel" / "dir" / "mlartifacts").as_uri()
    for uri in (
        "http://127.0.0.1:5000",
        "https://mlflow.example.com",
        "sqlite://",
        "sqlite:///:memory:",
        "postgresql://u@h/db",
        "databricks",
    ):
        assert artifact_location(uri) is None, uri


def test_disabled_gives_a_null_run_and_no_database(clean_env):
    with start_run(enabled=False, experiment="x", stage="s", params={"a": 1}, tags={"t": 1}) as run:
        assert type(run) is NullRun
        assert run.run_id is None
        run.log_params({"a": 1})
        run.log_metrics({"loss": 1.0}, step=1)
        run.log_artifact(clean_env)
        run.log_text("x", "x.txt")
        run.set_tags({"a": "b"})
    assert list(clean_env.iterdir()) == []


def test_disabled_run_still_raises(clean_env):
    with pytest.raises(ValueError), start_run(enabled=False, experiment="x", stage="s"):
        raise ValueError("boom")


def test_without_mlflow_gives_a_null_run(clean_env, monkeypatch, caplog):
    def missing():
        raise ImportError("no mlflow")

    monkeypatch.setattr(tracking, "_import_mlflow", missing)
    with start_run(enabled=True, experiment="x", stage="s") as run:
        assert type(run) is NullRun
    assert "not tracked" in caplog.text
    assert list(clean_env.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Runs in a real store


@pytest.mark.slow
def test_run_records_status_name_tags_and_params(store):
    commit = git_repo(store.cwd)
    params = {
        **load_config(None).flat("data.pretrain"),
        "data.api_token": "hf_abc123",
        "hf_key": "k-999",
        "data.classify.splits": [0.7, 0.1, 0.2],
        "long": "x" * 10_000,
    }
    run_id = one_run(store, params=params, tags={"team": "nlp", "dropped": None})
    run = store.client.get_run(run_id)

    assert run.info.status == "FINISHED"
    assert run.info.run_name == "prepare_pretrain"
    tags = run.data.tags
    assert tags["gptforge.stage"] == "prepare_pretrain"
    assert tags["gptforge.version"] == gptforge.__version__
    assert tags["device"] == "cpu" or tags["device"].startswith("cuda:")
    assert tags["git.commit"] == commit
    assert tags["team"] == "nlp"
    assert "dropped" not in tags
    assert "dvc.stage" not in tags

    logged = run.data.params
    assert logged["data.pretrain.max_tokens"] == "20000000"
    assert logged["data.pretrain.val_tokens"] == "1000000"
    assert logged["data.pretrain.source"] == "hf://HuggingFaceFW/fineweb-edu"
    assert logged["data.pretrain.sha256"] == "null"
    assert logged["data.classify.splits"] == "[0.7, 0.1, 0.2]"
    assert logged["data.api_token"] == "***"
    assert logged["hf_key"] == "***"
    assert len(logged["long"]) <= 6000 and logged["long"].endswith("...")
    assert set(logged) == set(params)

    exp = store.client.get_experiment_by_name(store.exp)
    assert run.info.experiment_id == exp.experiment_id
    import mlflow

    assert mlflow.active_run() is None


@pytest.mark.slow
def test_outside_a_git_checkout_there_is_no_commit_tag(store):
    tags = store.client.get_run(one_run(store)).data.tags
    assert "git.commit" not in tags
    assert "mlflow.source.git.commit" not in tags
    assert tags["gptforge.stage"] == "prepare_pretrain"


@pytest.mark.slow
def test_dvc_stage_tag(store, monkeypatch):
    monkeypatch.setenv("DVC_STAGE", "prepare_classify")
    tags = store.client.get_run(one_run(store, stage="prepare_classify")).data.tags
    assert tags["dvc.stage"] == "prepare_classify"


@pytest.mark.slow
def test_metrics_with_steps_skip_non_finite_and_bools(store):
    with start_run(enabled=True, experiment=store.exp, stage="pretrain") as run:
        for step in range(3):
            run.log_metrics(
                {
                    "train_loss": 3.0 - step,
                    "acc,none": 0.25 * step,
                    "nan": math.nan,
                    "inf": math.inf,
                    "flag": True,
                    "np_loss": np.float32(0.5 + step),
                    "tokens": np.int64(100 * step),
                    "text": "x",
                },
                step=step,
            )
        run.log_metrics({"only_bad": math.nan, "only_bool": False})  # nothing to log: no error
        run.log_metrics({"final": 7})
        run_id = run.run_id

    history = store.client.get_metric_history(run_id, "train_loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(0, 3.0), (1, 2.0), (2, 1.0)]
    acc = store.client.get_metric_history(run_id, "acc_none")
    assert sorted((m.step, m.value) for m in acc) == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert sorted((m.step, m.value) for m in store.client.get_metric_history(run_id, "np_loss")) == [
        (0, 0.5),
        (1, 1.5),
        (2, 2.5),
    ]
    metrics = store.client.get_run(run_id).data.metrics
    assert metrics["final"] == 7.0
    assert metrics["tokens"] == 200.0
    assert set(metrics) == {"train_loss", "acc_none", "np_loss", "tokens", "final"}


@pytest.mark.slow
def test_artifacts_land_beside_the_database(store):
    report = store.cwd / "report.md"
    report.write_text("# report\n")
    ckpt = store.cwd / "final"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"\0" * 16)
    (ckpt / "sub" / "config.json").write_text("{}")
    with start_run(enabled=True, experiment=store.exp, stage="pretrain") as run:
        run.log_artifact(report)
        run.log_artifact(report, artifact_path="reports")
        run.log_artifact(ckpt)
        run.log_artifact(ckpt, artifact_path="checkpoints/final")
        run.log_text("hello", "notes/hello.txt")
        run.log_artifact(store.cwd / "missing.txt")  # absent: nothing logged, no error
        run_id = run.run_id

    def listing(path=None):
        return {a.path for a in store.client.list_artifacts(run_id, path)}

    assert listing() == {"report.md", "reports", "final", "checkpoints", "notes"}
    assert listing("reports") == {"reports/report.md"}
    assert listing("final") == {"final/model.safetensors", "final/sub"}
    assert listing("final/sub") == {"final/sub/config.json"}
    assert listing("checkpoints/final") == {"checkpoints/final/model.safetensors", "checkpoints/final/sub"}

    beside = store.db.parent / "mlartifacts"
    exp = store.client.get_experiment_by_name(store.exp)
    assert exp.artifact_location == beside.as_uri()
    run = store.client.get_run(run_id)
    assert run.info.artifact_uri.startswith(beside.as_uri() + "/")
    # Runs keep their artifacts under mlartifacts/<run id>/artifacts/.
    root = beside / run_id / "artifacts"
    assert run.info.artifact_uri == root.as_uri()
    assert {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} == {
        "report.md",
        "reports/report.md",
        "final/model.safetensors",
        "final/sub/config.json",
        "checkpoints/final/model.safetensors",
        "checkpoints/final/sub/config.json",
        "notes/hello.txt",
    }
    assert (root / "notes" / "hello.txt").read_text() == "hello"
    assert (root / "final" / "model.safetensors").read_bytes() == b"\0" * 16
    # Nothing in the working directory: no ./mlruns, no ./mlartifacts.
    assert not (store.cwd / "mlruns").exists() and not (store.cwd / "mlartifacts").exists()


@pytest.mark.slow
def test_existing_experiment_keeps_its_artifact_location(store, tmp_path):
    elsewhere = (tmp_path / "elsewhere").as_uri()
    store.client.create_experiment(store.exp, artifact_location=elsewhere)
    run = store.client.get_run(one_run(store))
    assert run.info.artifact_uri.startswith(elsewhere + "/")


@pytest.mark.slow
def test_default_uri_is_mlflow_db_in_cwd_with_mlartifacts(template_db, clean_env):
    from mlflow.tracking import MlflowClient

    shutil.copy(template_db, clean_env / "mlflow.db")  # migrated already, to save ~7 s
    (clean_env / "x.txt").write_text("x")
    name = f"gf-{uuid.uuid4().hex[:8]}"
    with start_run(enabled=True, experiment=name, stage="evaluate") as run:
        run.log_artifact(clean_env / "x.txt")
        run_id = run.run_id

    client = MlflowClient(tracking_uri=f"sqlite:///{clean_env / 'mlflow.db'}")
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    exp = client.get_experiment(got.info.experiment_id)
    assert exp.name == name
    assert exp.artifact_location == (clean_env / "mlartifacts").as_uri()
    assert got.info.artifact_uri == (clean_env / "mlartifacts" / run_id / "artifacts").as_uri()
    assert (clean_env / "mlartifacts" / run_id / "artifacts" / "x.txt").read_text() == "x"
    assert not (clean_env / "mlruns").exists()


@pytest.mark.slow
def test_exception_marks_the_run_failed_and_propagates(store):
    seen = {}
    with pytest.raises(ValueError, match="boom"):
        with start_run(enabled=True, experiment=store.exp, stage="pretrain") as run:
            seen["id"] = run.run_id
            run.log_metrics({"loss": 1.0}, step=0)
            raise ValueError("boom")
    run = store.client.get_run(seen["id"])
    assert run.info.status == "FAILED"
    assert run.data.metrics["loss"] == 1.0
    import mlflow

    assert mlflow.active_run() is None
    # The next run starts cleanly after a failure.
    assert store.client.get_run(one_run(store)).info.status == "FINISHED"


@pytest.mark.slow
def test_keyboard_interrupt_marks_the_run_killed(store):
    seen = {}
    with pytest.raises(KeyboardInterrupt):
        with start_run(enabled=True, experiment=store.exp, stage="pretrain") as run:
            seen["id"] = run.run_id
            raise KeyboardInterrupt
    assert store.client.get_run(seen["id"]).info.status == "KILLED"


@pytest.mark.slow
def test_parent_run_id_makes_a_child_run(store, monkeypatch):
    exp_id = store.client.create_experiment(store.exp)
    parent = store.client.create_run(exp_id, run_name="pipeline").info.run_id
    monkeypatch.setenv("GPTFORGE_PARENT_RUN_ID", parent)
    child = store.client.get_run(one_run(store, stage="prepare_classify"))
    assert child.data.tags["mlflow.parentRunId"] == parent
    assert child.info.status == "FINISHED"
    assert child.info.run_name == "prepare_classify"
    # The parent is left to whoever started it.
    assert store.client.get_run(parent).info.status == "RUNNING"
    # Without the variable a run is top-level.
    monkeypatch.delenv("GPTFORGE_PARENT_RUN_ID")
    assert "mlflow.parentRunId" not in store.client.get_run(one_run(store)).data.tags


@pytest.mark.slow
def test_a_local_store_is_written_at_once_and_system_metrics_come_from_our_sampler(store, monkeypatch):
    """SQLite cannot go away under a run: records go to it synchronously (no outbox thread), its
    errors surface at once, and the system metrics sampler (which never asks the store for the
    run's status) publishes through the run."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    with start_run(enabled=True, experiment=store.exp, stage="pretrain", system_metrics=True) as run:
        assert run._outbox is None
        run.log_metrics({"train_loss": 2.5}, step=3)
        assert [(m.step, m.value) for m in store.client.get_metric_history(run.run_id, "train_loss")] == [(3, 2.5)]
        run.log_params({"a": 1})
        with pytest.raises(Exception, match="(?i)changing param values is not allowed"):
            run.log_params({"a": 2})
        deadline = time.monotonic() + 20
        while not any(k.startswith("system/") for k in store.client.get_run(run.run_id).data.metrics):
            assert time.monotonic() < deadline, "no system metrics"
            time.sleep(0.1)
        run_id = run.run_id
    assert not [t for t in threading.enumerate() if t.name.startswith(("gptforge-mlflow", "SystemMetricsMonitor"))]
    got = store.client.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert "system/cpu_utilization_percentage" in got.data.metrics
