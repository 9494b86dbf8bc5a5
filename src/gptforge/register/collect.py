"""One model's registration outcome on disk, and stage `register_report`, which gathers them.

dvc.yaml runs one stage per model (`register@MODEL`: `gptforge register -S registry.only=MODEL`),
so a target that wants one model registers it after that model's chain alone. Each writes
`metrics/register/MODEL.json` (`version`, `new`, `champion`; empty when nothing was registered)
and `reports/register/MODEL.json` (what happened: its row of the report). `register_report`
(`gptforge register-report`) writes from them what one whole `gptforge register` writes
(`Registered` and `write_report` live here for both):
`metrics/register.json` (`<model>.version`, ...) and `reports/register.md`, in the order of
`registry.names`. May import gptforge's shared modules; no MLflow.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gptforge.config.checks import only_entries
from gptforge.io import atomic_file, entry_path, read_json, write_json
from gptforge.runtime import tracking
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun

log = logging.getLogger("gptforge")

REGISTERED, NOT_REGISTERED, ABSENT, OFF = "registered", "not registered", "no model folder", "tracking disabled"
CHAMPION, CHALLENGER = "champion", "challenger"


@dataclass
class Registered:
    """What happened to one model."""

    model: str
    name: str
    version: str
    new: bool
    passed: bool
    reasons: list[str] = field(default_factory=list)
    gguf: str = ""  # the version's GGUF files (an artifact URI), or why there are none; "" when off
    gguf_file: str = ""  # the .gguf file itself when the artifacts are a local folder, else ""


def write_report(path: str | Path, results: list[Registered], skipped: dict[str, str]) -> None:
    lines = [
        "# Registered models",
        "",
        "| model | registered name | version | new | alias | gate | GGUF |",
        "| --- | --- | ---: | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.model} | `{r.name}` | {r.version} | {'yes' if r.new else 'no (same weights)'} | "
            f"{CHAMPION if r.passed else CHALLENGER} | {'; '.join(r.reasons)} | {r.gguf} |"
        )
    for model, why in skipped.items():
        lines.append(f"| {model} | | | not registered | | {why} | |")
    if not results and not skipped:
        lines.append("| (none: no model folder found, or tracking disabled) | | | | | | |")
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def selected_models(registry) -> dict[str, str]:
    """The entries of `registry.names` this run registers (`registry.only`, else all)."""
    return {m: registry.names[m] for m in only_entries(registry.names, registry.only, "registry.names")}


def model_metrics(result) -> dict[str, int]:
    """A Registered's figures, unprefixed (metrics/register/MODEL.json)."""
    return {"version": int(result.version), "new": int(result.new), "champion": int(result.passed)}


def write_model_outcome(model: str, status: str, result=None, why: str = "", *, metrics_path, records_dir) -> dict:
    """metrics/register/MODEL.json and reports/register/MODEL.json; returns the figures."""
    figures = model_metrics(result) if result is not None else {}
    record = {"model": model, "status": status, "why": why, **({"result": asdict(result)} if result else {})}
    for path, body in ((entry_path(metrics_path, model), figures), (Path(records_dir) / f"{model}.json", record)):
        write_json(path, body)
    return figures


def register_report(
    cfg,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    metrics_path="metrics/register.json",
    report_path="reports/register.md",
    records_dir="reports/register",
) -> dict:
    """Stage `register_report`: see the module docstring. Returns the flat metrics it wrote."""
    results, skipped = [], {}
    for model in cfg.registry.names:
        path = Path(records_dir) / f"{model}.json"
        if not path.is_file():
            log.info("register_report: no outcome of %s (%s): left out", model, path)
            continue
        record = read_json(path, missing=" not found")
        if record.get("status") == REGISTERED:
            results.append(Registered(**record["result"]))
        elif record.get("status") == NOT_REGISTERED:
            skipped[model] = record.get("why", "")
    metrics: dict[str, float] = {}
    for r in results:
        metrics.update({f"{r.model}.{k}": v for k, v in model_metrics(r).items()})
    write_report(report_path, results, skipped)
    tracking.publish_metrics(run, metrics, metrics_path)
    run.log_artifact(report_path)
    return metrics
