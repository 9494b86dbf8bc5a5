"""The lines `gptforge pipeline` (and `make run`) closes with: the headline numbers from the
metrics files grouped by model family, where the reports are, and how to open the MLflow and
Prefect UIs on the run.

A family is where a model's weights began: each folder's `init_from` is followed back (an
instruct variant's too) to a folder no stage of the chain made: checkpoints/pretrain/... (the
GPT pretrained here from scratch), checkpoints/base/NAME (a model of `base.models`, such as the
quickstart's SmolLM2), or a hub name. Each headline belongs to the model its stage made; the
lm-eval rows (with their standard errors) and the `evaluate_qa` lever table (token F1 without ->
with retrieval) to the model of their entry. A "before -> after" line with both values at zero
says nothing and is left out; so is any line whose metric is missing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from gptforge.config.chain import MODEL_FOLDERS, PRETRAINED, family, family_title
from gptforge.config.schema import variant_paths
from gptforge.io import read_json
from gptforge.runtime import mlflow_values

if TYPE_CHECKING:
    from gptforge.config.schema import Config
    from gptforge.pipeline.run import PipelineReport


# (label, model, metrics file, key, format, the key of the same figure before training or None):
# the numbers `make run` closes with; a figure with a "before" shows as "before -> after".
HEADLINES = (
    ("pretrain validation loss", "pretrain", "metrics/pretrain.json", "val_loss", "{:.3f}", None),
    ("pretrain training speed", "pretrain", "metrics/pretrain.json", "tokens_per_sec", "{:,.0f} tokens/s", None),
    ("spam test accuracy", "classify", "metrics/classify.json", "test_accuracy", "{:.4f}", None),
    ("spam test F1", "classify", "metrics/classify.json", "f1", "{:.4f}", None),
    ("instruct validation loss", "instruct", "metrics/instruct.json", "val_loss", "{:.3f}", None),
    (
        "instruct generation speed",
        "instruct",
        "metrics/instruct.json",
        "response_tokens_per_sec",
        "{:,.0f} tokens/s",
        None,
    ),
    (
        "DPO reward accuracy (val)",
        "preference",
        "metrics/preference.json",
        "val_reward_accuracy",
        "{:.3f}",
        "val_reward_accuracy_before",
    ),
    ("DPO reward margin (val)", "preference", "metrics/preference.json", "val_reward_margin", "{:.4f}", None),
    ("reward model accuracy (val)", "reward", "metrics/reward.json", "val_accuracy", "{:.3f}", "val_accuracy_before"),
    ("RL held-out reward", "rl", "metrics/rl.json", "heldout_reward", "{:.3f}", "heldout_reward_before"),
    # the answers of reports/rl_responses.jsonl against their references, SFT -> DPO and SFT -> RL
    ("DPO answers' token F1", "rl", "metrics/rl.json", "token_f1_dpo", "{:.3f}", "token_f1_sft"),
    ("DPO answers' distinct tokens", "rl", "metrics/rl.json", "distinct_share_dpo", "{:.3f}", "distinct_share_sft"),
    ("RL answers' token F1", "rl", "metrics/rl.json", "token_f1_rl", "{:.3f}", "token_f1_sft"),
    ("RL answers' distinct tokens", "rl", "metrics/rl.json", "distinct_share_rl", "{:.3f}", "distinct_share_sft"),
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
# lm-eval's headline metric of each task (metrics/evaluate.json: <model>.<task>.<metric>[_stderr])
EVAL_METRICS = (("hellaswag", "acc_norm"), ("mmlu", "acc"))
REPORTS = (
    "reports/evaluate.md",
    "reports/benchmark.md",
    "reports/register.md",
    "reports/instruct_responses.jsonl",
    "reports/preference_responses.jsonl",
    "reports/rl_responses.jsonl",
    "plots/",
)
WIDTH = 30  # the label column


def _config(root: Path) -> Config:
    """params.yaml of `root` (what the run used), else the defaults."""
    from gptforge.config.load import load_config

    with contextlib.suppress(Exception):
        return load_config(root / "params.yaml") if (root / "params.yaml").is_file() else load_config(None)
    return load_config(None)


def _shown(value: float, before: float | None, fmt: str) -> str | None:
    after = fmt.format(value)
    if before is None:
        return after
    first = fmt.format(before)
    if first == after and not any(c in "123456789" for c in after):
        return None  # 0.000 -> 0.000 says nothing
    return f"{first} -> {after}"


def model_lines(report: PipelineReport, root: Path, cfg: Config) -> Iterator[tuple[str, str]]:
    """(folder, line) for each headline that has its value, in the order of HEADLINES."""
    files: dict[str, dict] = {}  # each metrics file read once

    def metric(path: str, key: str | None):
        if key is None:
            return None
        if path not in files:
            files[path] = {}
            with contextlib.suppress(Exception):
                files[path] = read_json(root / path, missing="")
        value = files[path].get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def line(label: str, path: str, key: str, fmt: str, before_key: str | None) -> str | None:
        value = metric(path, key)
        shown = None if value is None else _shown(value, metric(path, before_key), fmt)
        return None if shown is None else f"{label:<{WIDTH}} {shown}"

    variants = [s.name.partition("@")[2] for s in report.stages if s.name.startswith(VARIANT_STAGE + "@")]
    variants += [
        n
        for n in cfg.instruct_variants.models
        if n not in variants and (root / variant_paths(n)["metrics_path"]).is_file()
    ]
    for name in variants:
        paths = variant_paths(name)
        for label, key, fmt in VARIANT_HEADLINES:
            label = f"{name} {label}" if len(variants) > 1 else label  # its family's group names it
            if text := line(label, paths["metrics_path"], key, fmt, f"{key}_before"):
                yield paths["out_dir"] + "/final", text
    for label, model, path, key, fmt, before_key in HEADLINES:
        if text := line(label, path, key, fmt, before_key):
            yield MODEL_FOLDERS[model], text


def evaluation_lines(root: Path, cfg: Config) -> Iterator[tuple[str, str]]:
    """(folder, line): each evaluated model's lm-eval metrics with their standard errors."""
    with contextlib.suppress(Exception):
        evaluated = read_json(root / "metrics/evaluate.json", missing="")
        for name, folder in cfg.evaluate.models.items():
            shown = []
            for task, metric in EVAL_METRICS:
                value = evaluated.get(f"{name}.{task}.{metric}")
                if isinstance(value, (int, float)):
                    stderr = evaluated.get(f"{name}.{task}.{metric}_stderr")
                    n = evaluated.get(f"{name}.{task}.n")
                    shown.append(
                        f"{task} {value:.3f}"
                        + (f" ± {stderr:.3f}" if isinstance(stderr, (int, float)) else "")
                        + (f" (n {int(n)})" if isinstance(n, (int, float)) else "")
                    )
            if shown:
                yield folder, f"{'lm-eval ' + name:<{WIDTH}} {', '.join(shown)}"


def lever_lines(root: Path, cfg: Config) -> Iterator[tuple[str, str]]:
    """(folder, line): each model's token F1 on a document set's questions, without -> with
    retrieval (metrics/evaluate_qa_NAME.json)."""
    from gptforge.rag.evaluate_qa import qa_models

    for doc_set in cfg.synthesize.documents:
        with contextlib.suppress(Exception):
            scores = read_json(root / f"metrics/evaluate_qa_{doc_set}.json", missing="")
            for name, folder in qa_models(cfg).items():
                plain, rag = scores.get(f"{name}.qa.token_f1"), scores.get(f"{name}.qa_rag.token_f1")
                n = scores.get(f"{name}.qa.n")
                if isinstance(plain, (int, float)) and isinstance(rag, (int, float)):
                    label = f"Q&A F1 {name}" if len(cfg.synthesize.documents) == 1 else f"{doc_set} Q&A F1 {name}"
                    about = cfg.synthesize.documents[doc_set]
                    count = f" ({int(n)} questions about {about})" if isinstance(n, (int, float)) else ""
                    yield folder, f"{label:<{WIDTH}} {plain:.3f} -> {rag:.3f} with retrieval{count}"


def gguf_lines(root: Path) -> list[str]:
    """Where register wrote the GGUF copy of the chain's last generative model (rl, else
    preference, instruct, pretrain) and the command that serves it."""
    for model in ("rl", "preference", "instruct", "pretrain"):
        with contextlib.suppress(Exception):
            result = read_json(root / f"reports/register/{model}.json", missing="").get("result") or {}
            gguf = result.get("gguf_file") or ""
            if gguf and Path(gguf).is_file():
                with contextlib.suppress(ValueError):  # shown from the repository when it is inside
                    gguf = str(Path(gguf).resolve().relative_to(root.resolve()))
                return [
                    f"{'GGUF of ' + model + ' (llama.cpp)':<{WIDTH + 2}} {gguf}",
                    f"{'  run it':<{WIDTH + 2}} llama-server -m {gguf}   (Ollama: ollama create "
                    f"{result.get('name', model)} -f {Path(gguf).parent / 'Modelfile'})",
                ]
            if str(result.get("gguf", "")).startswith("runs:/"):
                label = f"GGUF of {model} (llama.cpp)"
                return [f"{label:<{WIDTH + 2}} gptforge models gguf {model} --out gguf/{model}"]
    return []


def closing_summary(
    report: PipelineReport, root: Path = Path("."), prefect_flow_run: str | None = None, prefect_api: str | None = None
) -> list[str]:
    """What a user wants after a run: headline numbers grouped by model family, where the
    reports are, how to open the MLflow and Prefect UIs on it (`prefect_api`, else
    PREFECT_API_URL). Numbers come from the metrics files, so a run that re-ran nothing shows
    the last results."""
    cfg = _config(root)
    lines = [
        "",
        "Results" + (" (nothing was stale: the last run's numbers)" if not report.counts().get("ran") else "") + ":",
    ]
    groups: dict[str, list[str]] = {PRETRAINED: []}  # the from-scratch course first
    for folder, text in [*model_lines(report, root, cfg), *evaluation_lines(root, cfg), *lever_lines(root, cfg)]:
        groups.setdefault(family(folder, cfg), []).append(text)
    for family_root, texts in groups.items():
        if not texts:
            continue
        lines.append(f"  {family_title(family_root, cfg)}:")
        lines += [f"    {t}" for t in texts]
    with contextlib.suppress(Exception):
        registered = read_json(root / "metrics/register.json", missing="")
        versions = [
            f"{m} v{int(registered[f'{m}.version'])}"
            + (" champion" if registered.get(f"{m}.champion") else " challenger")
            for m in MODEL_FOLDERS
            if f"{m}.version" in registered
        ]
        if versions:
            lines.append(f"  {'registered models':<{WIDTH + 2}} {', '.join(versions)}")
    lines += [f"  {g}" for g in gguf_lines(root)]
    variants = [variant_paths(n) for n in cfg.instruct_variants.models]
    found = [r for r in (*REPORTS, *(p["responses_path"] for p in variants)) if (root / r).exists()]
    found += [
        f"reports/evaluate_qa_{d}.md"
        for d in cfg.synthesize.documents
        if (root / f"reports/evaluate_qa_{d}.md").exists()
    ]
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
    if any(
        (root / f).is_dir()
        for f in ("checkpoints/instruct/final", "checkpoints/classify/final", "checkpoints/rl/final")
    ):
        index = next((f"data/index/{d}" for d in cfg.synthesize.documents if (root / f"data/index/{d}").is_dir()), None)
        rag = f" --rag {index}" if index else ""
        cites = f", answers citing {cfg.synthesize.documents[index.rsplit('/', 1)[1]]}/" if index else ""
        lines.append(
            f"Serve: .venv/bin/gptforge serve{rag}   then http://127.0.0.1:8000 (chat page{cites}; OpenAI API at /v1)"
        )
    return lines
