"""What the stage writes from lm-eval's results: the flat metrics, the saved results and samples, the markdown report.

`flatten_results` turns lm-eval's nested results into `<task>.<metric>` figures, `save_results`
keeps lm-eval's results and per-sample records, `write_report` writes `reports/evaluate.md`.
May import `gptforge.io`, `gptforge.runtime.tracking` and, when it writes, lm-eval's version and JSON
helper; no torch, no model code; from the other `gptforge.evaluate` modules only the name
`TaskPlan`, for type hints.

Figures: `<task>.<metric>` (acc, acc_norm, ...; a filter other than `none` is appended as
`_<filter>`), `..._stderr`, and `<task>.n`, the examples scored (for a group, the sum over its
tasks). `mmlu.acc` is weighted by subject size like lm-eval's group; `mmlu.acc_subject_mean` is
the plain mean over subjects (the "average over the 57 subjects" some papers report).
The report shows every model x task x metric with ± stderr and n, the GPT-2 124M reference,
MMLU per subject, throughput, and the spam classifier's and instruction model's test metrics
when their metrics files are present.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from gptforge.io import atomic_dir, atomic_file
from gptforge.runtime import mlflow_values

if TYPE_CHECKING:
    from gptforge.evaluate.task_data import TaskPlan

log = logging.getLogger("gptforge")

# Published figures for GPT-2 124M, shown beside ours in the report.
REFERENCE = {("hellaswag", "acc_norm"): (0.3114, "GPT-2 124M in lm-eval")}
CHANCE = {("mmlu", "acc"): 0.25, ("mmlu", "acc_subject_mean"): 0.25}
OTHER_METRICS = {
    "metrics/classify.json": ("spam classifier", ("test_accuracy", "precision", "recall", "f1")),
    "metrics/instruct.json": ("instruction model", ("test_loss",)),
    "metrics/preference.json": ("preference-tuned model (DPO)", ("val_reward_accuracy", "val_reward_margin")),
}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def flatten_results(results: dict) -> dict[str, float]:
    """lm-eval's results -> {"<task>.<metric>": value}: `acc,none` -> `acc`, `acc_stderr,none`
    -> `acc_stderr`, another filter `f` -> `<metric>_<f>`; `<task>.n` examples scored; and
    `mmlu.acc_subject_mean`, the unweighted mean over the leaf `mmlu_*` tasks."""
    flat: dict[str, float] = {}
    n_samples = results.get("n-samples", {})
    leaves = set(results.get("configs", {}))
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if key in ("alias", "sample_len") or not _is_number(value):
                continue
            metric, _, filt = key.partition(",")
            if filt and filt != "none":
                metric += "_" + mlflow_values.metric_name(filt)
            flat[f"{task}.{metric}"] = float(value)
        if task in n_samples:
            flat[f"{task}.n"] = float(n_samples[task].get("effective", 0))
        else:  # a group: the sum over its leaf tasks
            members = _leaves_of(task, results)
            flat[f"{task}.n"] = float(sum(n_samples.get(t, {}).get("effective", 0) for t in members))
    subjects = [t for t in leaves if t.startswith("mmlu_") and f"{t}.acc" in flat]
    if "mmlu.acc" in flat and subjects:
        flat["mmlu.acc_subject_mean"] = sum(flat[f"{t}.acc"] for t in subjects) / len(subjects)
    return flat


def _leaves_of(group: str, results: dict) -> list[str]:
    children = results.get("group_subtasks", {}).get(group, [])
    out = []
    for child in children:
        out += _leaves_of(child, results) if child in results.get("group_subtasks", {}) else [child]
    return out


def save_results(results: dict, folder: Path) -> None:
    """results.json (without samples) and samples_<task>.jsonl, replacing `folder` as a whole."""
    from lm_eval.utils import handle_non_serializable

    samples = results.get("samples", {})
    with atomic_dir(folder) as tmp:
        body = {k: v for k, v in results.items() if k != "samples"}
        (tmp / "results.json").write_text(
            json.dumps(body, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        for task, rows in samples.items():
            with open(tmp / f"samples_{task}.jsonl", "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n")


def _fmt(v: float | None, digits: int = 4) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def write_report(
    path: str | Path,
    per_model: dict[str, dict],
    cfg,
    plan: TaskPlan,
    other_metrics: Mapping[str, str] = OTHER_METRICS,
    version: str | None = None,
) -> str:
    """reports/evaluate.md; `version`: lm-eval's, as the runs recorded it (None: the installed one)."""
    if version is None:
        import lm_eval

        version = getattr(lm_eval, "__version__", "?")
    ev = cfg.evaluate
    lines = [
        "# Evaluation",
        "",
        f"lm-evaluation-harness {version} through gptforge's `LM` "
        f"(`gptforge.evaluate`); num_fewshot: {'task default' if ev.num_fewshot is None else ev.num_fewshot}, "
        f"limit: {ev.limit if ev.limit is not None else 'none'} (per task; per subject for MMLU).",
        "",
    ]
    for name in plan.names:
        where = plan.local.get(name) or (
            f"lm-eval's own data ({plan.hub[name]} not set)" if name in plan.hub else "lm-eval's own task and data"
        )
        lines.append(f"- `{name}`: {where}")
    lines += ["", "| model | task | metric | value | ± stderr | n | reference |", "|---|---|---|---|---|---|---|"]
    for model, info in per_model.items():
        flat = info["flat"]
        for key in sorted(flat):
            task, _, metric = key.rpartition(".")
            if metric == "n" or metric.endswith("_stderr"):
                continue
            if task.startswith("mmlu_") and "mmlu" in plan.local:
                continue  # subjects: in results.json; the table shows the group
            stderr = flat.get(f"{task}.{metric}_stderr")
            ref = REFERENCE.get((task, metric))
            chance = CHANCE.get((task, metric))
            ref_text = f"{ref[0]:.4f} ({ref[1]})" if ref else (f"chance {chance:.2f} (4 choices)" if chance else "")
            n = flat.get(f"{task}.n")
            lines.append(
                f"| {model} | {task} | {metric} | {_fmt(flat[key])} | {_fmt(stderr)} | "
                f"{'' if n is None else int(n)} | {ref_text} |"
            )
    subjects = {
        m: {k.rpartition(".")[0]: v for k, v in info["flat"].items() if k.startswith("mmlu_") and k.endswith(".acc")}
        for m, info in per_model.items()
    }
    if any(subjects.values()) and "mmlu" in plan.local:
        models = list(per_model)
        lines += [
            "",
            "MMLU accuracy per subject:",
            "",
            "| subject | " + " | ".join(models) + " |",
            "|---|" + "---|" * len(models),
        ]
        for task in sorted(set().union(*subjects.values())):
            lines.append(
                f"| {task[len('mmlu_') :]} | " + " | ".join(_fmt(subjects[m].get(task)) for m in models) + " |"
            )
    lines += [
        "",
        "Throughput (this machine; seconds: the whole lm-eval call, model seconds: inside our model):",
        "",
        "| model | examples | seconds | examples/s | model seconds | device |",
        "|---|---|---|---|---|---|",
    ]
    for model, info in per_model.items():
        lines.append(
            f"| {model} | {info['examples']} | {info['seconds']:.1f} | {info['examples_per_sec']:.1f} | "
            f"{info['model_seconds']:.2f} | {info['device']} |"
        )
    lines += [
        "",
        "HellaSwag here is lm-eval's: query `activity_label: ctx_a Ctx_b` with `[...]` tags stripped, "
        "acc_norm normalised by characters. The `hellaswag_acc_norm` in metrics/pretrain.json is "
        "build-nanogpt's completion-style score (raw `ctx`, loss per token); the two are not comparable.",
    ]
    outcome = []
    for file, (what, keys) in other_metrics.items():
        p = Path(file)
        if not p.is_file():
            continue
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            log.warning("evaluate: %s not readable (%s); left out of the report", p, e)
            continue
        for key in keys:
            if _is_number(data.get(key)):
                outcome.append(f"| {what} | {key} | {_fmt(float(data[key]))} | `{file}` |")
    if outcome:
        lines += [
            "",
            "## The rest of the pipeline",
            "",
            "| model | metric | value | from |",
            "|---|---|---|---|",
            *outcome,
        ]
    text = "\n".join(lines) + "\n"
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text
