"""`gptforge models list|promote` against a real `mlflow server` (SQLite backend, 127.0.0.1),
then that server's UI page of a registered model (`/#/models/NAME`) in headless Chromium.

The registered models and their versions are made here with MlflowClient, with the tags and
aliases of the register stage's contract (docs/registry.md), so these tests do not run the
stage. The screenshot is a test artifact (under $GPTFORGE_TEST_ARTIFACTS or test-artifacts/).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cli_support import REPO, cli_env, last_error_line, run_cli
from process_support import free_port

from gptforge.cli import main

ARTIFACTS = Path(os.environ.get("GPTFORGE_TEST_ARTIFACTS", REPO / "test-artifacts"))
CLASSIFY, INSTRUCT = "gptforge-classify", "gptforge-instruct"


def make_registry(url: str):
    """gptforge-classify versions 1 (champion, gate passed) and 2 (challenger, gate failed),
    gptforge-instruct version 1 (champion, no conditions); each version's source a tiny
    artifact of one run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    run_id = client.create_run(client.create_experiment("models-cli")).info.run_id
    client.log_text(run_id, "not really weights", "model/weights.txt")
    lineage = {
        "gptforge.weights_hash": "ab" * 32,
        "git.commit": "c0ffee" * 6 + "c0ff",
        "dvc.outs": "{}",
        "dvc.deps": "{}",
        "prefect.flow_run_id": "flow-run-1",
        "mlflow.training_run_id": run_id,
    }
    versions = [
        (
            CLASSIFY,
            "finetune_classify",
            {
                "gptforge.gate": "passed",
                "metric.classify.test_accuracy": "0.9633333333333334",
                "metric.classify.f1": "0.9664429530201343",
            },
        ),
        (
            CLASSIFY,
            "finetune_classify",
            {
                "gptforge.gate": "failed: classify.test_accuracy 0.91 < 0.95",
                "metric.classify.test_accuracy": "0.91",
                "metric.classify.f1": "0.9",
            },
        ),
        (
            INSTRUCT,
            "finetune_instruct",
            {
                "gptforge.gate": "no conditions",
                "metric.instruct.val_loss": "3.456",
                "metric.evaluate.instruct.hellaswag.acc_norm": "0.23",
            },
        ),
    ]
    for name in (CLASSIFY, INSTRUCT):
        client.create_registered_model(name)
    for name, stage, tags in versions:
        client.create_model_version(
            name, f"runs:/{run_id}/model", run_id=run_id, tags={**lineage, "dvc.stage": stage, **tags}
        )
    client.set_registered_model_alias(CLASSIFY, "champion", "1")
    client.set_registered_model_alias(CLASSIFY, "challenger", "2")
    client.set_registered_model_alias(INSTRUCT, "champion", "1")
    return client


@pytest.mark.slow
def test_list_promote_and_the_ui(mlflow_server, tmp_path):
    client = make_registry(mlflow_server)
    env = cli_env(MLFLOW_TRACKING_URI=mlflow_server)

    out = run_cli(["models", "list"], tmp_path, env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    assert rows[0] == ["NAME", "VERSION", "ALIASES", "CREATED", "GATE", "METRICS"]
    # newest first per model, the configured models in registry.names' order
    assert [r[:3] for r in rows[1:]] == [
        [CLASSIFY, "2", "challenger"],
        [CLASSIFY, "1", "champion"],
        [INSTRUCT, "1", "champion"],
    ]
    lines = out.stdout.splitlines()
    assert "failed: classify.test_accuracy 0.91 < 0.95" in lines[1] and "test_accuracy=0.91 f1=0.9" in lines[1]
    assert " passed " in lines[2] and lines[2].endswith("test_accuracy=0.9633 f1=0.9664")
    assert "no conditions" in lines[3] and lines[3].endswith("val_loss=3.456 hellaswag.acc_norm=0.23")
    for column in rows[0][1:]:  # aligned: every cell starts where its header does
        start = lines[0].index(column)
        assert all(line[start - 2 : start] == "  " and line[start] != " " for line in lines[1:]), column

    out = run_cli(["models", "promote", "classify", "2"], tmp_path, env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"{CLASSIFY} version 2 is now @champion (before: version 1)"
    assert client.get_registered_model(CLASSIFY).aliases == {"champion": "2", "challenger": "2"}
    assert client.get_model_version_by_alias(CLASSIFY, "champion").version == "2"

    out = run_cli(["models", "list", "--name", CLASSIFY], tmp_path, env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line.split()[:3] for line in out.stdout.splitlines()[1:]] == [
        [CLASSIFY, "2", "challenger,champion"],
        [CLASSIFY, "1", "-"],
    ]

    for args, expected in (
        (["promote", "gptforge-nope", "1"], "no registered model 'gptforge-nope'"),
        (["promote", CLASSIFY, "7"], f"{CLASSIFY} has no version 7; its versions: 1, 2"),
    ):
        out = run_cli(["models", *args], tmp_path, env, timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        assert expected in last_error_line(out.stderr)
        assert out.stdout == ""
    assert client.get_registered_model(CLASSIFY).aliases == {"champion": "2", "challenger": "2"}

    # The same server's UI, on the registered model's page (one server start less than a test of its own).
    from browser import Browser, find_chromium

    binary = find_chromium()
    if binary is None:
        pytest.skip(
            "no chromium: the UI page is not checked (the CLI checks above passed; apt-get install -y chromium)"
        )
    browser = Browser(binary, free_port())
    try:
        text = browser.page_text_and_screenshot(
            f"{mlflow_server}/#/models/{CLASSIFY}",
            [CLASSIFY, "Version 2", "Version 1", "champion", "challenger"],
            ARTIFACTS / "mlflow-registered-model.png",
        )
    finally:
        browser.close()
    assert INSTRUCT not in text


@pytest.mark.slow
def test_unreachable_server_is_one_line(tmp_path):
    env = cli_env(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}")
    out = run_cli(["models", "list"], tmp_path, env, timeout=120)
    assert out.returncode == 1
    assert "cannot be reached" in last_error_line(out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_no_models_says_how_to_make_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default: sqlite:///mlflow.db here
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert out == (
        "no registered models in sqlite:///mlflow.db: `gptforge register` or `dvc repro register` "
        "registers the pipeline's models\n"
    )
    assert not (tmp_path / "mlflow.db").exists()  # reading does not create a database
    assert main(["models", "promote", "classify", "1"]) == 2
    assert "no registered model 'gptforge-classify'" in capsys.readouterr().err
