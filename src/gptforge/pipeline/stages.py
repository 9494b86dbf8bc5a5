"""The stage table: each DVC stage's recipe and the params it depends on.

`run_stage` wraps one recipe call in one MLflow run. Flows (Prefect) and the CLI both come
through here, so a stage behaves the same with or without Prefect. A pretrain asking for more
than one process launches torchrun here instead (`gptforge.training.launch`).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from gptforge.runtime import locks, tracking
from gptforge.runtime.steps import DIRECT, Steps

if TYPE_CHECKING:  # the CLI reads this table for --help, which should not load pydantic
    from gptforge.config.schema import Config
@dataclass(frozen=True)
class Stage:
    name: str
    recipe: str  # "module:function", imported when the stage runs
    params: tuple[str, ...]  # config sections it reads (logged to MLflow; DVC params in dvc.yaml)
    summary: str
    system_metrics: bool = False  # long stages: CPU/GPU/memory sampled into the MLflow run
    headline: tuple[str, ...] = ()  # metrics the pipeline's summary shows (default: the first few)

    def load(self) -> Callable[..., dict]:
        module, func = self.recipe.split(":")
        return getattr(importlib.import_module(module), func)


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("prepare_pretrain", "gptforge.data.pretrain:prepare_pretrain",
              ("tokenizer", "data.download", "data.pretrain"),
              "tokenize a text corpus into uint16 shards (data/pretrain/)"),
        Stage("prepare_classify", "gptforge.data.classify:prepare_classify",
              ("data.download", "data.classify"),
              "SMS Spam Collection -> balanced train/val/test jsonl (data/classify/)"),
        Stage("prepare_instruct", "gptforge.data.instruct:prepare_instruct",
              ("data.download", "data.instruct"),
              "Alpaca-style instructions -> train/val/test jsonl (data/instruct/)"),
        Stage("prepare_preference", "gptforge.data.preference:prepare_preference",
              ("data.download", "data.preference"),
              "preference pairs (prompt, chosen, rejected) -> train/val/test jsonl (data/preference/)"),
        Stage("prepare_base", "gptforge.data.base_models:prepare_base", ("base",),
              "fetch the Hugging Face models of base.models into checkpoints/base/NAME (base.only: one of them)"),
        Stage("synthesize", "gptforge.synthesize.stage:synthesize", ("tokenizer", "synthesize"),
              "documents -> checked question/answer pairs from an OpenAI-compatible endpoint (data/synthetic/NAME/)",
              headline=("kept", "pairs_returned", "requests")),
        Stage("pretrain", "gptforge.training.loop:pretrain", ("tokenizer", "model", "pretrain"),
              "pretrain GPT-2 on the token shards (checkpoints/pretrain/)", system_metrics=True,
              headline=("val_loss", "tokens_per_sec", "mfu", "hellaswag_acc_norm")),
        Stage("finetune_classify", "gptforge.finetune.classify:finetune_classify", ("tokenizer", "classify"),
              "fine-tune a spam classifier on data/classify (checkpoints/classify/)", system_metrics=True,
              headline=("test_accuracy", "f1")),
        Stage("finetune_instruct", "gptforge.finetune.instruct:finetune_instruct", ("tokenizer", "instruct"),
              "instruction fine-tuning on data/instruct (checkpoints/instruct/)", system_metrics=True,
              headline=("val_loss", "test_loss", "response_tokens_per_sec")),
        Stage("finetune_preference", "gptforge.finetune.preference:finetune_preference",
              ("tokenizer", "instruct.template", "preference"),
              "align the instruction model with preference pairs: DPO through trl (checkpoints/preference/)",
              system_metrics=True, headline=("val_reward_accuracy", "val_reward_margin")),
        Stage("evaluate", "gptforge.evaluate:evaluate", ("tokenizer", "evaluate"),
              "MMLU and HellaSwag (lm-eval) on every model the pipeline made (reports/evaluate.md)"),
        Stage("register", "gptforge.register:register", ("tokenizer", "registry"),
              "version every model the pipeline made in the MLflow Model Registry, with lineage and a promotion gate",
              headline=("classify.version", "classify.champion", "instruct.version")),
        Stage("benchmark", "gptforge.bench.stage:benchmark", ("model", "benchmark"),
              "time the training step for a grid of settings, attention and cross-entropy (reports/benchmark.md)"),
    )
}


def run_stage(name: str, cfg: Config, *, steps: Steps = DIRECT, tags: Mapping[str, Any] | None = None) -> dict:
    if "WORLD_SIZE" in os.environ:  # a torchrun worker: its launcher holds the stage's lock
        return _run_stage(name, cfg, steps=steps, tags=tags)
    # Two runs of one stage in one folder would write the same outputs (checkpoints) at once.
    with locks.hold(name, f"stage {name}"):
        return _run_stage(name, cfg, steps=steps, tags=tags)


def _run_stage(name: str, cfg: Config, *, steps: Steps, tags: Mapping[str, Any] | None) -> dict:
    stage = STAGES[name]
    if name == "pretrain":
        from gptforge.training.launch import launch_pretrain, needs_launch

        if needs_launch(cfg):
            # torchrun's workers run this stage again; their rank 0 opens the MLflow run (with `tags`).
            return steps(launch_pretrain, cfg, tags=tags)
    recipe = stage.load()
    # Under torchrun every process runs the recipe; only rank 0 records the run.
    with tracking.start_run(
        enabled=cfg.tracking.enabled and int(os.environ.get("RANK", "0")) == 0,
        experiment=cfg.tracking.experiment,
        stage=name,
        params=cfg.flat(*stage.params),
        tags=tags,
        system_metrics=stage.system_metrics,
    ) as run:
        return recipe(cfg, steps=steps, run=run)


# The param that names each stage's input, for checks before any work starts.
SOURCE_PARAMS = {
    "prepare_pretrain": "data.pretrain.source",
    "prepare_classify": "data.classify.source",
    "prepare_instruct": "data.instruct.source",
    "prepare_preference": "data.preference.source",
}


def check_inputs(name: str, cfg: Config) -> None:
    """Fail fast, with one line, on inputs that can be checked without doing the work."""
    from pathlib import Path

    from gptforge.errors import BadInput

    param = SOURCE_PARAMS.get(name)
    if param:
        source = cfg.flat()[param]
        if "://" not in source and not Path(source).exists():
            raise BadInput(f"{param}: local source not found: {source}")
    if name == "synthesize":
        from gptforge.synthesize.stage import selected_documents

        for key in selected_documents(cfg.synthesize):
            if not Path(cfg.synthesize.documents[key]).exists():
                raise BadInput(f"synthesize.documents.{key}: {cfg.synthesize.documents[key]} not found")
    if name == "prepare_pretrain":
        from gptforge.modeling.tokenizer import check_fits_uint16, load_tokenizer

        check_fits_uint16(load_tokenizer(cfg.tokenizer.path), cfg.tokenizer.path)
    if name == "pretrain":
        from gptforge.training.loop import grad_accum_steps

        grad_accum_steps(cfg, int(os.environ.get("WORLD_SIZE", cfg.pretrain.world_size)))
        if not Path("data/pretrain/manifest.json").is_file():
            raise BadInput("data/pretrain/manifest.json not found: run `gptforge prepare pretrain` first")
