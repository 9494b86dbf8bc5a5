"""Stage `evaluate`: every model the pipeline made, on HellaSwag and MMLU, with lm-evaluation-harness.

The stage's entry point (`evaluate(cfg)`, what `gptforge evaluate`, `flows/` and `tasks/` run
through `gptforge.pipeline.stages`) and its recipe: for each model in `evaluate.models` whose folder
exists, call `lm_eval.simple_evaluate` in-process with the model as an lm-eval `LM`, then write
the flat metrics, lm-eval's results, one MLflow run per model and the report. A model folder is
a gptforge checkpoint or a Hugging Face GPT-2 folder (our `GPT`, as `GptforgeLM`), or any other
Hugging Face causal-LM folder (Llama, Qwen2, ...: `hf_causal.hf_source`), which lm-eval's own
`HFLM` scores with the folder's tokenizer.
May import the modules beside it and gptforge's shared ones; torch, lm-eval and the model code
only when the stage runs, so importing the package stays cheap.

The parts: `lm` (`GptforgeLM`: our GPT behind lm-eval's LM interface, and why it is not the
`hf` model; `measured`: HFLM's throughput figures), `task_data` (which tasks, local HellaSwag
and MMLU checked and written as task configs), `report` (results flattened and saved, the
markdown report), `collect` (one model's results on disk, `evaluate.only`, and stage
`evaluate_report`, which writes the report from them).

`evaluate.only=NAME` (dvc.yaml's evaluate@NAME, one stage per model) evaluates that entry alone
and writes its results only (`metrics/evaluate/NAME.json`, `reports/evaluate/NAME/`); stage
`evaluate_report` then writes the two files below over every model. Without it the stage does both.

Outputs (`<model>` is the key in `evaluate.models`, `<task>` an lm-eval task or group name):
- `metrics/evaluate.json`: `<model>.<task>.<metric>` (acc, acc_norm, ...), `..._stderr`,
  `<model>.<task>.n` (examples scored), `<model>.examples_per_sec` and `<model>.seconds` (the
  whole lm-eval call: data, prompts, scoring, metrics), `<model>.model_seconds` (inside the model's
  scoring and generation: `GptforgeLM.seconds`, or HFLM's as `lm.measured` times them);
- `reports/evaluate/<model>/results.json` (lm-eval's results, samples removed),
  `samples_<task>.jsonl` (every request and response, lm-eval's `log_samples`) and `summary.json`
  (what the report reads of the run); `metrics/evaluate/<model>.json`, the model's rows unprefixed;
- one MLflow run per model (`evaluate:<model>`, nested under the stage's run when there is
  one) with the `<task>.<metric>` metrics and those files; the stage's run gets the whole file;
- `reports/evaluate.md`: every model x task x metric with ± stderr and n, the GPT-2 124M
  reference, and the spam classifier's and instruction model's test metrics when present.

Offline use: set HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 before the process imports
`datasets`/`transformers`; with both local sources nothing else is needed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from gptforge.errors import BadInput
from gptforge.evaluate.collect import selected_models, write_aggregate, write_model_results
from gptforge.evaluate.report import flatten_results, save_results
from gptforge.evaluate.task_data import TaskPlan, load_task_objects, plan_tasks
from gptforge.io import entry_path, read_json
from gptforge.runtime import mlflow_values, tracking
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun

if TYPE_CHECKING:
    import torch

log = logging.getLogger("gptforge")


def existing_models(models: Mapping[str, str]) -> dict[str, Path]:
    """The listed model folders that exist (gptforge checkpoints, Hugging Face GPT-2 or causal-LM
    folders); a missing one is skipped with a log line, but when none exists it is a BadInput
    naming them."""
    if not models:
        raise BadInput("evaluate.models: no models listed (name: checkpoint folder)")
    found = {name: Path(folder) for name, folder in models.items() if Path(folder).is_dir()}
    missing = {name: folder for name, folder in models.items() if name not in found}
    if not found:
        if len(missing) == 1:
            ((name, folder),) = missing.items()
            raise BadInput(f"evaluate.models.{name}: checkpoint folder {folder} not found")
        listed = ", ".join(f"{n} ({f})" for n, f in missing.items())
        raise BadInput(f"evaluate.models: none of the checkpoint folders exists: {listed}")
    for name, folder in missing.items():
        log.info("evaluate: skipping %s: checkpoint folder %s not found", name, folder)
    return found


def resolve_device(device: str) -> torch.device:
    """auto | cpu | cuda | cuda:N, checked as fine-tuning checks it; fp32 weights (TF32 matmuls on CUDA)."""
    from gptforge.finetune.common import runtime

    return runtime(device, "fp32", param="evaluate").device


@contextlib.contextmanager
def _child_of(run: NullRun):
    """Per-model MLflow runs nest under the stage's run when it is a real one (MLflow refuses a
    second top-level run while one is active)."""
    if not run.run_id:
        yield
        return
    old = os.environ.get(mlflow_values.PARENT_ENV)
    os.environ[mlflow_values.PARENT_ENV] = run.run_id
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(mlflow_values.PARENT_ENV, None)
        else:
            os.environ[mlflow_values.PARENT_ENV] = old


def scoring_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype a Hugging Face model is scored in (`evaluate.precision`)."""
    import torch

    from gptforge.modeling.hf_causal import resolved_precision

    return torch.bfloat16 if resolved_precision(precision, device.type) == "bf16" else torch.float32


def evaluate_model(
    name: str, folder: Path, plan: TaskPlan, tasks: list, cfg, enc, device: torch.device, results_dir: Path
) -> dict:
    """One model on every task: lm-eval results saved under results_dir/<name>/.

    `folder`: a gptforge checkpoint or a Hugging Face GPT-2 folder (checkpoints/base/NAME,
    converted), scored as our `GPT` with `enc` (`GptforgeLM`); or another Hugging Face causal-LM
    folder (`hf_causal.hf_source`), scored by lm-eval's `HFLM` with the folder's own tokenizer
    (`enc` unused). `tasks`: lm-eval's task objects (`load_task_objects`), loaded once for all
    the models; each model gets a copy, since a task keeps the requests of the run it served."""
    import copy

    from lm_eval import simple_evaluate

    from gptforge.evaluate import template_cache
    from gptforge.modeling.hf_causal import hf_source

    ev = cfg.evaluate
    param = f"evaluate.models.{name}"
    if hf_source(str(folder)) is not None:
        from lm_eval.models.huggingface import HFLM

        from gptforge.evaluate.lm import measured
        from gptforge.modeling.hf_causal import load_causal_lm

        model, tokenizer = load_causal_lm(str(folder), param=param, dtype=scoring_dtype(ev.precision, device))
        model = model.to(device).eval()  # HFLM takes a loaded model where it is (its device= is for a name)
        lm = measured(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=ev.batch_size, device=str(device)), name)
    else:
        from gptforge.evaluate.lm import GptforgeLM
        from gptforge.modeling.hf_convert import load_pretrained

        # a gptforge checkpoint, or a Hugging Face GPT-2 folder (checkpoints/base/NAME) converted
        model = load_pretrained(str(folder), param=param)[0].to(device).eval()
        lm = GptforgeLM(model, enc, batch_size=ev.batch_size, device=device, name=name)
    template_cache.install()
    start = time.perf_counter()
    results = simple_evaluate(
        model=lm,
        tasks=copy.deepcopy(tasks),
        num_fewshot=ev.num_fewshot,
        limit=ev.limit,
        batch_size=ev.batch_size,
        device=str(device),
        task_manager=plan.manager,
        log_samples=True,
    )
    seconds = time.perf_counter() - start
    examples = int(sum(v.get("effective", 0) for v in results.get("n-samples", {}).values()))
    flat = flatten_results(results)
    results["config"]["checkpoint"] = str(folder)
    save_results(results, results_dir / name)
    rate = examples / seconds if seconds > 0 else 0.0
    log.info(
        "evaluate %s: %d examples (%d loglikelihood requests) in %.1f s, %.1f examples/s on %s",
        name,
        examples,
        lm.counts["loglikelihood"],
        seconds,
        rate,
        device,
    )
    return {
        "flat": flat,
        "examples": examples,
        "seconds": seconds,
        "examples_per_sec": rate,
        "model_seconds": lm.seconds,
        "device": str(device),
        "requests": dict(lm.counts),
        "cut_continuations": lm.cut_continuations,
    }


def evaluate(
    cfg,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    metrics_path="metrics/evaluate.json",
    report_path="reports/evaluate.md",
    results_dir="reports/evaluate",
) -> dict:
    """Stage `evaluate`: see the module docstring. Returns the flat metrics it wrote: with
    `evaluate.only` (dvc.yaml's evaluate@NAME) that model's alone, unprefixed."""
    from gptforge.modeling.tokenizer import load_tokenizer

    only = cfg.evaluate.only
    models = existing_models(selected_models(cfg.evaluate))
    device = resolve_device(cfg.evaluate.device)
    results_dir = Path(results_dir)
    per_model: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gptforge-lm-eval-") as tmp:
        plan = steps(plan_tasks, cfg, Path(tmp))
        tasks = steps(load_task_objects, plan)  # once (seconds: lm-eval reads every subject's data)
        enc = load_tokenizer(cfg.tokenizer.path)
        for name, folder in models.items():
            with (
                _child_of(run),
                tracking.start_run(
                    enabled=cfg.tracking.enabled,
                    experiment=cfg.tracking.experiment,
                    stage=f"evaluate:{name}",
                    params={
                        **cfg.flat("evaluate"),
                        "model": name,
                        "checkpoint": str(folder),
                        "tokenizer.path": cfg.tokenizer.path,
                    },
                    tags={"gptforge.model": name},
                ) as model_run,
            ):
                info = steps(evaluate_model, name, folder, plan, tasks, cfg, enc, device, results_dir)
                mine = {
                    **info["flat"],
                    "examples_per_sec": info["examples_per_sec"],
                    "seconds": info["seconds"],
                    "model_seconds": info["model_seconds"],
                }
                model_run.log_metrics(mine)
                model_run.log_artifact(results_dir / name, "lm_eval")
            write_model_results(name, folder, info, mine, plan, results_dir, metrics_path)
            per_model[name] = info
        if only is None:  # the whole stage: the report over every model, as evaluate_report writes it
            return write_aggregate(per_model, plan, cfg, run, metrics_path, report_path, results_dir)
    mine = read_json(entry_path(metrics_path, only), missing=" not written")
    run.log_metrics(mine)
    run.log_artifact(entry_path(metrics_path, only))
    run.log_artifact(results_dir / only)
    return mine
