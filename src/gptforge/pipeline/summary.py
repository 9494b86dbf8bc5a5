"""The lines `gptforge pipeline` (and `make run`) closes with: the headline numbers from the
metrics files (an instruct variant's, such as the quickstart's SmolLM2, before -> after), where
the reports are, and how to open the MLflow and Prefect UIs on the run.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from gptforge.config.schema import variant_paths
from gptforge.io import read_json
from gptforge.runtime import mlflow_values

if TYPE_CHECKING:
    from gptforge.pipeline.run import PipelineReport


# (label, metrics file, key, format, the key of the same figure before training or None): the
# numbers `make run` closes with; a figure with a "before" shows as "before -> after".
HEADLINES = (
    ("pretrain validation loss", "metrics/pretrain.json", "val_loss", "{:.3f}", None),
    ("pretrain training speed", "metrics/pretrain.json", "tokens_per_sec", "{:,.0f} tokens/s", None),
    ("spam test accuracy", "metrics/classify.json", "test_accuracy", "{:.4f}", None),
    ("spam test F1", "metrics/classify.json", "f1", "{:.4f}", None),
    ("instruct validation loss", "metrics/instruct.json", "val_loss", "{:.3f}", None),
    ("instruct generation speed", "metrics/instruct.json", "response_tokens_per_sec", "{:,.0f} tokens/s", None),
    ("DPO reward accuracy (val)", "metrics/preference.json", "val_reward_accuracy", "{:.3f}", None),
    ("DPO reward margin (val)", "metrics/preference.json", "val_reward_margin", "{:.4f}", None),
    ("reward model accuracy (val)", "metrics/reward.json", "val_accuracy", "{:.3f}", "val_accuracy_before"),
    ("RL held-out reward", "metrics/rl.json", "heldout_reward", "{:.3f}", "heldout_reward_before"),
    # the answers of reports/rl_responses.jsonl against their references, SFT -> DPO and SFT -> RL
    ("DPO answers' token F1", "metrics/rl.json", "token_f1_dpo", "{:.3f}", "token_f1_sft"),
    ("DPO answers' distinct tokens", "metrics/rl.json", "distinct_share_dpo", "{:.3f}", "distinct_share_sft"),
    ("RL answers' token F1", "metrics/rl.json", "token_f1_rl", "{:.3f}", "token_f1_sft"),
    ("RL answers' distinct tokens", "metrics/rl.json", "distinct_share_rl", "{:.3f}", "distinct_share_sft"),
)
# An instruct variant's lines (stage finetune_instruct_variant@NAME): label, key, format; the
# figure before training is the key with `_before`.
VARIANT_STAGE = "finetune_instruct_variant"
VARIANT_HEADLINES = (
    ("SFT test loss", "test_loss", "{:.3f}"),
    ("SFT token F1", "token_f1", "{:.3f}"),
    ("SFT ROUGE-L", "rouge_l", "{:.3f}"),
    ("SFT exact match", "exact_match", "{:.3f}"),
    ("SFT distinct tokens", "distinct_share", "{:.3f}"),
)
REPORTS = (
    "reports/evaluate.md",
    "reports/benchmark.md",
    "reports/register.md",
    "reports/instruct_responses.jsonl",
    "reports/preference_responses.jsonl",
    "reports/rl_responses.jsonl",
    "plots/",
)


def closing_summary(
    report: PipelineReport, root: Path = Path("."), prefect_flow_run: str | None = None, prefect_api: str | None = None
) -> list[str]:
    """What a user wants after a run: headline numbers, where the reports are, how to open the
    MLflow and Prefect UIs on it (`prefect_api`, else PREFECT_API_URL). Numbers come from the
    metrics files, so a run that re-ran nothing shows the last results."""

    def metric(path: str, key: str):
        with contextlib.suppress(Exception):
            value = read_json(root / path, missing="").get(key)
            return value if isinstance(value, (int, float)) else None
        return None

    lines = [
        "",
        "Results" + (" (nothing was stale: the last run's numbers)" if not report.counts().get("ran") else "") + ":",
    ]

    def add(label: str, path: str, key: str, fmt: str, before_key: str | None) -> None:
        value = metric(path, key)
        if value is not None:
            before = metric(path, before_key) if before_key else None
            shown = fmt.format(value) if before is None else f"{fmt.format(before)} -> {fmt.format(value)}"
            lines.append(f"  {label:<28} {shown}")

    for label, path, key, fmt, before_key in HEADLINES:
        add(label, path, key, fmt, before_key)
    names = [s.name.partition("@")[2] for s in report.stages if s.name.startswith(VARIANT_STAGE + "@")]
    variants = {name: variant_paths(name) for name in names}
    for name, paths in variants.items():
        for label, key, fmt in VARIANT_HEADLINES:
            add(f"{name} {label}", paths["metrics_path"], key, fmt, f"{key}_before")
    with contextlib.suppress(Exception):
        evaluated = read_json(root / "metrics/evaluate.json", missing="")
        for key, value in evaluated.items():
            model, _, rest = key.partition(".")
            if rest in ("hellaswag.acc_norm", "mmlu.acc") and isinstance(value, (int, float)):
                lines.append(f"  {model + ' ' + rest.replace('.', ' '):<28} {value:.4f}")
    with contextlib.suppress(Exception):
        registered = read_json(root / "metrics/register.json", missing="")
        versions = [
            f"{m} v{int(registered[f'{m}.version'])}"
            + (" champion" if registered.get(f"{m}.champion") else " challenger")
            for m in ("pretrain", "classify", "instruct", "preference", "reward", "rl")
            if f"{m}.version" in registered
        ]
        if versions:
            lines.append(f"  {'registered models':<28} {', '.join(versions)}")
    found = [r for r in (*REPORTS, *(paths["responses_path"] for paths in variants.values())) if (root / r).exists()]
    if found:
        lines.append("Reports: " + ", ".join(found))
    uri = mlflow_values.tracking_uri()
    if uri.startswith(("http://", "https://")):
        lines.append(f"MLflow: {report.run_url or uri}")
    else:
        lines.append(
            f"MLflow: mlflow ui --backend-store-uri {uri}   then http://127.0.0.1:5000"
            + (f"  (pipeline run {report.run_id})" if report.run_id else "")
        )
    api = prefect_api or os.environ.get("PREFECT_API_URL")
    if api:
        ui = api.rstrip("/").removesuffix("/api")
        lines.append(f"Prefect: {ui}/runs" + (f"/flow-run/{prefect_flow_run}" if prefect_flow_run else ""))
    else:
        lines.append(
            "Prefect: prefect server start   then http://127.0.0.1:4200/runs"
            + (f"/flow-run/{prefect_flow_run}" if prefect_flow_run else "")
        )
    if (root / "checkpoints/instruct/final").is_dir() or (root / "checkpoints/classify/final").is_dir():
        lines.append("Serve: .venv/bin/gptforge serve   then http://127.0.0.1:8000 (chat page; OpenAI API at /v1)")
    return lines
