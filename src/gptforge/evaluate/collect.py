"""One model's evaluation results on disk, and stage `evaluate_report`, which gathers them.

dvc.yaml runs one stage per model (`evaluate@NAME`: `gptforge evaluate -S evaluate.only=NAME`), so
a target that wants one model runs only that model's chain. Each writes `metrics/evaluate/NAME.json`
(`<task>.<metric>`, `..._stderr`, `<task>.n`, `examples_per_sec`, `seconds`, `model_seconds`) and
`reports/evaluate/NAME/` (lm-eval's results and samples, plus `summary.json`: what the report needs
of that run). `evaluate_report` (`gptforge evaluate-report`) writes from them what one whole
`gptforge evaluate` writes: `metrics/evaluate.json` (`<model>.<task>.<metric>`) and
`reports/evaluate.md`, for every model of `evaluate.models` that has results, in that order.
May import `gptforge.evaluate.report` and gptforge's shared modules; no torch, no lm-eval.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

from gptforge.config.checks import only_entries
from gptforge.errors import BadInput
from gptforge.evaluate.report import write_report
from gptforge.evaluate.task_data import TaskPlan
from gptforge.io import entry_path, read_json, write_json
from gptforge.runtime import tracking
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun

log = logging.getLogger("gptforge")

SUMMARY = "summary.json"


def selected_models(ev) -> dict[str, str]:
    """The entries of `evaluate.models` this run evaluates (`evaluate.only`, else all)."""
    return {name: ev.models[name] for name in only_entries(ev.models, ev.only, "evaluate.models")}


def write_model_results(
    name: str, folder: Path, info: dict, mine: Mapping[str, float], plan: TaskPlan, results_dir: Path, metrics_path
) -> None:
    """One model's figures (metrics/evaluate/NAME.json) and what the report reads of its run
    (reports/evaluate/NAME/summary.json, beside lm-eval's results)."""
    import lm_eval

    summary = {
        "model": name,
        "checkpoint": str(folder),
        **{k: info[k] for k in ("flat", "examples", "seconds", "examples_per_sec", "model_seconds", "device")},
        "requests": dict(info.get("requests", {})),
        "cut_continuations": info.get("cut_continuations", 0),
        "tasks": {"names": list(plan.names), "local": dict(plan.local), "hub": dict(plan.hub)},
        "lm_eval_version": getattr(lm_eval, "__version__", "?"),
    }
    write_json(results_dir / name / SUMMARY, summary, default=str)
    write_json(entry_path(metrics_path, name), dict(mine))


def write_aggregate(
    per_model: dict[str, dict], plan: TaskPlan, cfg, run: NullRun, metrics_path, report_path, results_dir, version=None
) -> dict[str, float]:
    """metrics/evaluate.json (`<model>.<key>`) and reports/evaluate.md over `per_model` (name ->
    the summary of its run), logged to the stage's run with the per-model results folder."""
    metrics: dict[str, float] = {}
    for name, info in per_model.items():
        mine = {
            **info["flat"],
            "examples_per_sec": info["examples_per_sec"],
            "seconds": info["seconds"],
            "model_seconds": info["model_seconds"],
        }
        metrics.update({f"{name}.{k}": v for k, v in mine.items()})
    write_report(report_path, per_model, cfg, plan, version=version)
    tracking.publish_metrics(run, metrics, metrics_path)
    run.log_artifact(report_path)
    run.log_artifact(results_dir)
    return metrics


def evaluate_report(
    cfg,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    metrics_path="metrics/evaluate.json",
    report_path="reports/evaluate.md",
    results_dir="reports/evaluate",
) -> dict:
    """Stage `evaluate_report`: see the module docstring. Returns the flat metrics it wrote."""
    results_dir = Path(results_dir)
    per_model: dict[str, dict] = {}
    for name in cfg.evaluate.models:
        path = results_dir / name / SUMMARY
        if not path.is_file():
            log.info("evaluate_report: no results of %s (%s): left out", name, path)
            continue
        per_model[name] = read_json(path, missing=" not found")
    if not per_model:
        raise BadInput(
            f"evaluate_report: no model of evaluate.models has results in {results_dir}/NAME/{SUMMARY}: "
            "run `gptforge evaluate` (or `dvc repro evaluate`) first"
        )
    first = next(iter(per_model.values()))
    tasks = first["tasks"]
    plan = TaskPlan(
        names=tasks["names"], include_path=[], include_defaults=False, local=tasks["local"], hub=tasks["hub"]
    )
    return write_aggregate(
        per_model, plan, cfg, run, metrics_path, report_path, results_dir, version=first.get("lm_eval_version")
    )
