"""Per-model evaluation and registration stages (dvc.yaml's evaluate@NAME and register@MODEL).

A target that names one model runs only that model's chain, asked of DVC itself (`dvc dag
TARGET`: the stages `dvc repro TARGET` considers; `dvc repro --dry` in a fresh clone stops at the
first stage whose input is not made yet): evaluate@instruct of the quickstart without DPO, the
reward model or RL; register@instruct of configs/qwen2.5-0.5b-lora.yaml (hub weights) without
pretraining. The reports (evaluate_report, register_report) still come from every model, and
are written from the per-model results as one whole run writes them. `evaluate.only` and
`registry.only` naming no entry are one-line errors.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from cli_support import BIN, REPO, cli_env, run_cli

from gptforge.config.load import load_config, read_params
from gptforge.errors import BadInput

TRAINED_AFTER_SFT = {"finetune_preference", "train_reward", "finetune_rl"}


def dvc_repo(tmp_path: Path, params: dict | None = None) -> Path:
    """dvc.yaml and params.yaml (the quickstart's, or `params`) in a fresh git + DVC repository."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(REPO / "dvc.yaml", repo / "dvc.yaml")
    if params is None:
        shutil.copy(REPO / "params.yaml", repo / "params.yaml")
    else:
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copytree(REPO / ".dvc", repo / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"))
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    return repo


def upstream(repo: Path, target: str) -> set[str]:
    """The stages `dvc repro TARGET` considers: TARGET and everything it depends on."""
    out = subprocess.run(
        [str(BIN / "dvc"), "dag", "--dot", target],
        cwd=repo,
        env=cli_env(DVC_NO_ANALYTICS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return {line.strip().strip('";') for line in out.stdout.splitlines() if line.startswith('"') and "->" not in line}


def test_one_models_evaluation_runs_only_its_chain(tmp_path):
    stages = upstream(dvc_repo(tmp_path), "evaluate@instruct")
    # prepare_instruct reads data/synthetic (data.instruct.source may be synthetic://NAME), where
    # synthesize@gptforge-docs writes the chunks of docs/
    assert stages == {
        "prepare_pretrain",
        "pretrain",
        "synthesize@gptforge-docs",
        "prepare_instruct",
        "finetune_instruct",
        "evaluate@instruct",
    }
    assert not stages & TRAINED_AFTER_SFT


def test_registering_a_fine_tuned_hub_model_does_not_pretrain(tmp_path):
    params = read_params(REPO / "configs/qwen2.5-0.5b-lora.yaml")  # what `gptforge pipeline --params` writes
    stages = upstream(dvc_repo(tmp_path, params), "register@instruct")
    assert not stages & {"pretrain", "prepare_pretrain"}, stages
    assert {"prepare_base@qwen2_5-0_5b-instruct", "finetune_instruct", "evaluate@instruct"} <= stages
    assert not {s for s in stages if s.startswith("register")} - {"register@instruct"}


def test_the_reports_still_come_from_every_model(tmp_path):
    repo = dvc_repo(tmp_path)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    evaluated = upstream(repo, "evaluate_report")
    assert {f"evaluate@{name}" for name in params["evaluate"]["models"]} <= evaluated
    registered = upstream(repo, "register_report")
    assert {f"register@{model}" for model in params["registry"]["names"]} <= registered
    # each per-model registration waits for its own evaluation alone (registry.evaluations)
    assert not {s for s in upstream(repo, "register@classify") if s.startswith("evaluate")}
    instruct = upstream(repo, "register@instruct")
    assert {s for s in instruct if s.startswith("evaluate")} == {"evaluate@instruct"}
    assert not instruct & {"finetune_instruct_variant@smollm2", "prepare_base@smollm2"}  # SmolLM2's chain
    assert {s for s in upstream(repo, "register@rl") if s.startswith("evaluate")} == set()


@pytest.mark.parametrize(
    "command, key, message",
    [
        (
            "evaluate",
            "evaluate.only",
            "evaluate.models has no entry 'nope' (entries: pretrain, instruct, smollm2, smollm2_sft)",
        ),
        (
            "register",
            "registry.only",
            "registry.names has no entry 'nope' (entries: pretrain, classify, instruct, preference, reward, rl)",
        ),
    ],
)
def test_only_naming_no_entry_is_one_line(tmp_path, command, key, message):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    out = run_cli([command, "-S", f"{key}=nope"], tmp_path, cli_env(GPTFORGE_PREFECT="0"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [f"gptforge: error: {message}"]


# ---------------------------------------------------------------------------------------------
# The reports from the per-model results


def summary(name: str, acc: float) -> dict:
    return {
        "model": name,
        "checkpoint": f"checkpoints/{name}/final",
        "flat": {"hellaswag.acc_norm": acc, "hellaswag.acc_norm_stderr": 0.01, "hellaswag.n": 8.0},
        "examples": 8,
        "seconds": 2.0,
        "examples_per_sec": 4.0,
        "model_seconds": 1.0,
        "device": "cpu",
        "tasks": {"names": ["hellaswag"], "local": {"hellaswag": "data/h.jsonl"}, "hub": {}},
        "lm_eval_version": "0.4.x",
    }


def test_evaluate_report_joins_the_models_in_evaluate_models_order(tmp_path, monkeypatch):
    from gptforge.evaluate.collect import evaluate_report

    monkeypatch.chdir(tmp_path)
    for name, acc in (("instruct", 0.3), ("pretrain", 0.25)):
        (tmp_path / "reports/evaluate" / name).mkdir(parents=True)
        (tmp_path / "reports/evaluate" / name / "summary.json").write_text(json.dumps(summary(name, acc)))
    cfg = load_config(None, ['evaluate.models={"pretrain": "a", "instruct": "b", "absent": "c"}'])
    metrics = evaluate_report(cfg)
    assert list(metrics)[:2] == ["pretrain.hellaswag.acc_norm", "pretrain.hellaswag.acc_norm_stderr"]
    assert metrics["instruct.hellaswag.acc_norm"] == 0.3 and metrics["instruct.examples_per_sec"] == 4.0
    assert json.loads(Path("metrics/evaluate.json").read_text()) == metrics
    report = Path("reports/evaluate.md").read_text()
    assert "lm-evaluation-harness 0.4.x" in report and "| instruct | hellaswag | acc_norm | 0.3000 |" in report
    assert not any(k.startswith("absent.") for k in metrics)  # no results: left out, as a missing folder
    with pytest.raises(BadInput, match="no model of evaluate.models has results"):
        evaluate_report(load_config(None, ['evaluate.models={"other": "x"}']))


def test_register_report_and_the_gate_read_the_per_model_files(tmp_path, monkeypatch):
    from gptforge.register import Registered, gate, metrics_of
    from gptforge.register.collect import ABSENT, NOT_REGISTERED, REGISTERED, register_report, write_model_outcome

    monkeypatch.chdir(tmp_path)
    where = {"metrics_path": "metrics/register.json", "records_dir": "reports/register"}
    write_model_outcome(
        "classify", REGISTERED, Registered("classify", "gptforge-classify", "3", True, False, ["x"]), **where
    )
    write_model_outcome("pretrain", NOT_REGISTERED, why="a .tiktoken tokenizer", **where)
    write_model_outcome("rl", ABSENT, **where)
    assert json.loads(Path("metrics/register/classify.json").read_text()) == {"version": 3, "new": 1, "champion": 0}
    metrics = register_report(load_config(None, []))
    assert metrics == {"classify.version": 3, "classify.new": 1, "classify.champion": 0}
    report = Path("reports/register.md").read_text()
    assert "| classify | `gptforge-classify` | 3 | yes | challenger | x |" in report
    assert "| pretrain | | | not registered | | a .tiktoken tokenizer | |" in report and "| rl |" not in report

    # evaluate@instruct's file beats a stale whole-run file; its tags keep the names they had
    Path("metrics/evaluate").mkdir(parents=True)
    Path("metrics/evaluate/instruct.json").write_text(json.dumps({"hellaswag.acc_norm": 0.4}))
    Path("metrics/evaluate.json").write_text(json.dumps({"instruct.hellaswag.acc_norm": 0.1}))
    assert gate.read_metric("evaluate.instruct.hellaswag.acc_norm", "metrics") == 0.4
    assert metrics_of("instruct", Path("metrics")) == {"evaluate.instruct.hellaswag.acc_norm": 0.4}
    assert metrics_of("pretrain", Path("metrics")) == {}
    Path("metrics/evaluate.json").write_text(json.dumps({"pretrain.mmlu.acc": 0.3}))
    assert metrics_of("pretrain", Path("metrics")) == {"evaluate.pretrain.mmlu.acc": 0.3}
    # registry.evaluations names the file: an evaluate@NAME's, or the model's own (no evaluation)
    assert metrics_of("instruct", Path("metrics"), "metrics/evaluate/instruct.json") == {
        "evaluate.instruct.hellaswag.acc_norm": 0.4
    }
    assert metrics_of("instruct", Path("metrics"), "metrics/instruct.json") == {}


def test_registry_evaluations_name_a_file_a_stage_writes(tmp_path):
    # the schema: one entry per registered model, an evaluate@NAME file or the model's own metrics
    with pytest.raises(BadInput, match=r"registry.evaluations: expected one entry for each of registry.names"):
        load_config(REPO / "params.yaml", ['registry.evaluations={"pretrain": "metrics/pretrain.json"}'])
    with pytest.raises(BadInput, match=r"registry.evaluations.rl: expected metrics/evaluate/NAME.json .* got 'x.json'"):
        load_config(REPO / "params.yaml", ["registry.evaluations.rl=x.json"])
    # the pipeline: an evaluate@NAME file needs NAME in evaluate.models, said before any work
    from gptforge.pipeline.run import resolve_params

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    with pytest.raises(BadInput) as e:
        resolve_params(None, ["registry.evaluations.rl=metrics/evaluate/rl.json"], tmp_path / "params.yaml")
    assert str(e.value) == (
        "registry.evaluations.rl: metrics/evaluate/rl.json is written by no stage (evaluate.models has no rl: "
        "pretrain, instruct, smollm2, smollm2_sft); name one of them, or metrics/rl.json"
    )
    resolve_params(None, ["registry.evaluations.rl=metrics/evaluate/smollm2_sft.json"], tmp_path / "params.yaml")
