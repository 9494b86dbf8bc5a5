"""The stage table: each DVC stage's recipe and the params it depends on.

`run_stage` wraps one recipe call in one MLflow run. Flows (Prefect) and the CLI both come
through here, so a stage behaves the same with or without Prefect. A pretrain asking for more
than one process (pretrain or a fine-tuning stage) launches torchrun here instead
(`gptforge.training.launch`). `run_recorded`
is how a stage command runs: its MLflow run and Prefect flow run go to its journal, and the
recorder makes them (`gptforge.runtime.recording`), so the process starts on its work at once.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from gptforge.runtime import locks, tracking
from gptforge.runtime.steps import DIRECT, Steps

log = logging.getLogger("gptforge")

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
    report: str | None = None  # a markdown report it writes, shown as a Prefect artifact too
    # Its work needs its MLflow run in the process (register: the registry makes model versions
    # from the models logged in it), so its run talks to MLflow directly even when recorded.
    mlflow_in_process: bool = False

    def load(self) -> Callable[..., dict]:
        module, func = self.recipe.split(":")
        return getattr(importlib.import_module(module), func)


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage(
            "prepare_pretrain",
            "gptforge.data.pretrain_stage:prepare_pretrain",
            ("tokenizer", "data.download", "data.pretrain"),
            "tokenize a text corpus into uint16 shards (data/pretrain/)",
        ),
        Stage(
            "prepare_classify",
            "gptforge.data.classify:prepare_classify",
            ("data.download", "data.classify"),
            "SMS Spam Collection -> balanced train/val/test jsonl (data/classify/)",
        ),
        Stage(
            "prepare_instruct",
            "gptforge.data.instruct:prepare_instruct",
            ("data.download", "data.instruct"),
            "Alpaca-style instructions -> train/val/test jsonl (data/instruct/)",
        ),
        Stage(
            "prepare_preference",
            "gptforge.data.preference:prepare_preference",
            ("data.download", "data.preference"),
            "preference pairs (prompt, chosen, rejected) -> train/val/test jsonl (data/preference/)",
        ),
        Stage(
            "prepare_base",
            "gptforge.data.base_models:prepare_base",
            ("base",),
            "fetch the Hugging Face models of base.models into checkpoints/base/NAME (base.only: one of them)",
        ),
        Stage(
            "synthesize",
            "gptforge.synthesize.stage:synthesize",
            ("tokenizer", "synthesize"),
            "documents -> checked question/answer pairs from an OpenAI-compatible endpoint (data/synthetic/NAME/)",
            headline=("kept", "pairs_returned", "requests"),
        ),
        Stage(
            "index",
            "gptforge.rag.stage:index",
            ("synthesize.documents", "index"),
            "index a document set's chunks for retrieval: BM25, dense, hybrid (data/index/NAME/)",
            headline=("recall_at_5", "mrr", "chunks"),
        ),
        Stage(
            "evaluate_qa",
            "gptforge.rag.evaluate_qa:evaluate_qa",
            ("tokenizer", "instruct.template", "index", "evaluate", "evaluate_qa"),
            "a document set's held-out questions (or evaluate_qa.questions.NAME) answered by each model, "
            "without and with retrieval (reports/evaluate_qa_NAME.md)",
        ),
        Stage(
            "pretrain",
            "gptforge.training.loop:pretrain",
            ("tokenizer", "model", "pretrain", "distributed"),
            "pretrain GPT-2 on the token shards (checkpoints/pretrain/)",
            system_metrics=True,
            headline=("val_loss", "tokens_per_sec", "mfu", "hellaswag_acc_norm"),
        ),
        Stage(
            "finetune_classify",
            "gptforge.finetune.classify:finetune_classify",
            ("tokenizer", "classify", "distributed"),
            "fine-tune a spam classifier on data/classify (checkpoints/classify/)",
            system_metrics=True,
            headline=("test_accuracy", "f1"),
        ),
        Stage(
            "finetune_instruct",
            "gptforge.finetune.instruct:finetune_instruct",
            ("tokenizer", "instruct", "distributed"),
            "instruction fine-tuning on data/instruct (checkpoints/instruct/)",
            system_metrics=True,
            headline=("val_loss", "test_loss", "response_tokens_per_sec"),
        ),
        Stage(
            "finetune_instruct_variant",
            "gptforge.finetune.instruct:finetune_instruct_variant",
            ("tokenizer", "instruct", "instruct_variants"),
            "one more instruction fine-tuning: instruct_variants.models.NAME over the instruct section "
            "(checkpoints/instruct_NAME/)",
            system_metrics=True,
            headline=("test_loss", "test_loss_before", "token_f1", "token_f1_before"),
        ),
        Stage(
            "finetune_preference",
            "gptforge.finetune.preference:finetune_preference",
            ("tokenizer", "instruct.template", "preference", "distributed"),
            "align the instruction model with preference pairs: DPO through trl (checkpoints/preference/)",
            system_metrics=True,
            headline=("val_reward_accuracy", "val_reward_margin"),
        ),
        Stage(
            "train_reward",
            "gptforge.finetune.reward:train_reward",
            ("tokenizer", "instruct.template", "reward", "distributed"),
            "a reward model on the preference pairs: trl's RewardTrainer, a scalar head (checkpoints/reward/)",
            system_metrics=True,
            headline=("val_accuracy", "val_accuracy_before", "val_margin"),
        ),
        Stage(
            "finetune_rl",
            "gptforge.finetune.rl:finetune_rl",
            ("tokenizer", "instruct.template", "instruct.judge", "rl", "distributed"),
            "online RL on the instruction prompts: trl's GRPO (or RLOO), rewards from params, KL to the "
            "starting model (checkpoints/rl/)",
            system_metrics=True,
            headline=("heldout_reward", "heldout_reward_before"),
        ),
        Stage(
            "evaluate",
            "gptforge.evaluate:evaluate",
            ("tokenizer", "evaluate"),
            "MMLU and HellaSwag (lm-eval) on every model the pipeline made (reports/evaluate.md; "
            "evaluate.only: one of them, metrics/evaluate/NAME.json)",
        ),
        Stage(
            "evaluate_report",
            "gptforge.evaluate.collect:evaluate_report",
            ("evaluate",),
            "the evaluation report over every model's results (evaluate@NAME): reports/evaluate.md, "
            "metrics/evaluate.json",
        ),
        Stage(
            "register",
            "gptforge.register:register",
            ("tokenizer", "registry"),
            "version every model the pipeline made in the MLflow Model Registry, with lineage and a promotion gate "
            "(registry.only: one of them)",
            headline=("classify.version", "classify.champion", "instruct.version", "version", "champion"),
            report="reports/register.md",
            mlflow_in_process=True,
        ),
        Stage(
            "register_report",
            "gptforge.register.collect:register_report",
            ("registry",),
            "the registry report over every model's outcome (register@MODEL): reports/register.md, "
            "metrics/register.json",
            headline=("classify.version", "classify.champion", "instruct.version"),
            report="reports/register.md",
        ),
        Stage(
            "benchmark",
            "gptforge.bench.stage:benchmark",
            ("model", "benchmark"),
            "time the training step for a grid of settings, attention and cross-entropy (reports/benchmark.md)",
        ),
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
    from gptforge.training.launch import TRAINING_STAGES

    if name in TRAINING_STAGES:
        from gptforge.training.launch import launcher, needs_launch

        if needs_launch(cfg, name):
            # torchrun's workers run this stage again; their rank 0 opens the MLflow run (with `tags`).
            return steps(launcher(name), cfg, tags=tags)
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


def run_recorded(name: str, cfg: Config, *, params: str | None, overrides: list[str], prefect: bool) -> dict:
    """A stage command's run with its records journaled: the MLflow run (unless tracking is off
    or MLflow is not installed) and, with `prefect`, the flow run with a task run per step,
    its log lines, and its metrics (and report) as markdown artifacts."""
    import importlib.util
    from pathlib import Path

    from gptforge.runtime import recording

    stage = STAGES[name]
    mlflow = cfg.tracking.enabled and not stage.mlflow_in_process and importlib.util.find_spec("mlflow") is not None
    if stage.mlflow_in_process and cfg.tracking.enabled:
        wait_for_earlier_records()
    with recording.recorded(
        stage=name,
        flow_name=flow_name(name),
        summary=stage.summary,
        parameters={"params": params, "overrides": list(overrides)},
        prefect=prefect,
        mlflow=mlflow,
        experiment=cfg.tracking.experiment,
    ) as steps:
        tags = None
        if steps is not None and stage.mlflow_in_process and cfg.tracking.enabled:
            tags = recording.flow_run_of(steps.journal, timeout=60.0)  # its run is made here: tag it here
        metrics = run_stage(name, cfg, steps=steps or DIRECT, tags=tags)
        if steps is not None:
            key = flow_name(name)
            steps.journal.write(
                "artifact_md",
                key=f"{key}-metrics",
                markdown=metrics_markdown(name, metrics),
                description=f"{name} metrics",
            )
            if stage.report is not None and Path(stage.report).is_file():
                steps.journal.write(
                    "artifact_md",
                    key=f"{key}-report",
                    markdown=Path(stage.report).read_text(encoding="utf-8"),
                    description=f"{name}: {stage.report}",
                )
        return metrics


def wait_for_earlier_records(timeout: float = 600.0) -> None:
    """A stage that reads earlier stages' MLflow runs (register: their logged models, its
    lineage) starts once the recorder has delivered their journals (bounded)."""
    from gptforge.runtime import recording

    journals = recording.pending()
    if not journals:
        return
    log.info("waiting for the recorder to deliver %d earlier stage journal(s)", len(journals))
    if not recording.wait_delivered(journals, timeout):
        from gptforge.errors import StageFailed

        raise StageFailed(
            f"the recorder has not delivered {len(recording.pending())} earlier stage journal(s) "
            f"within {timeout:.0f} s (see .gptforge/recorder/recorder.log)"
        )


def flow_name(stage: str) -> str:
    """The stage's Prefect flow name (and artifact key prefix): `prepare_classify` -> `prepare-classify`."""
    return stage.replace("_", "-")


def metrics_markdown(stage: str, metrics: Mapping[str, Any]) -> str:
    rows = "\n".join(
        f"| `{k}` | {v:,.4g} |" if isinstance(v, float) else f"| `{k}` | {v:,} |" for k, v in metrics.items()
    )
    return f"### {stage}\n\n| metric | value |\n| --- | --- |\n{rows}\n"


# The param that names each stage's input, for checks before any work starts.
SOURCE_PARAMS = {
    "prepare_pretrain": "data.pretrain.source",
    "prepare_classify": "data.classify.source",
    "prepare_instruct": "data.instruct.source",
    "prepare_preference": "data.preference.source",
}


# The trl stages whose batch_size is the whole batch, split evenly over the processes.
WHOLE_BATCH_SECTIONS = {"finetune_preference": "preference", "train_reward": "reward", "finetune_rl": "rl"}


def check_inputs(name: str, cfg: Config) -> None:
    """Fail fast, with one line, on inputs that can be checked without doing the work."""
    from pathlib import Path

    from gptforge.errors import BadInput

    param = SOURCE_PARAMS.get(name)
    if param:
        source = cfg.flat()[param]
        if "://" not in source and not Path(source).exists():
            raise BadInput(f"{param}: local source not found: {source}")
    if name == "evaluate":
        from gptforge.evaluate.collect import selected_models

        selected_models(cfg.evaluate)
    if name == "register":
        from gptforge.register.collect import selected_models

        selected_models(cfg.registry)
    if name in ("index", "evaluate_qa"):
        from gptforge.synthesize.stage import selected_documents

        selected_documents(cfg.synthesize)
    if name == "synthesize":
        from gptforge.synthesize.stage import selected_documents

        for key in selected_documents(cfg.synthesize):
            if not Path(cfg.synthesize.documents[key]).exists():
                raise BadInput(f"synthesize.documents.{key}: {cfg.synthesize.documents[key]} not found")
    if name == "prepare_pretrain":
        from gptforge.modeling.tokenizer import check_fits_uint16, load_tokenizer

        check_fits_uint16(load_tokenizer(cfg.tokenizer.path), cfg.tokenizer.path)
    section = WHOLE_BATCH_SECTIONS.get(name)
    if section:
        world = int(os.environ.get("WORLD_SIZE", cfg.world_size(section)))
        batch = getattr(cfg, section).batch_size
        if batch % world:
            raise BadInput(
                f"{section}.batch_size ({batch}) is the whole batch, shared by the {world} processes "
                f"({section}.nproc_per_node x distributed.nnodes): make it a multiple of their number"
            )
    if name == "pretrain":
        from gptforge.training.loop import grad_accum_steps

        grad_accum_steps(cfg, int(os.environ.get("WORLD_SIZE", cfg.world_size("pretrain"))))
        if not Path("data/pretrain/manifest.json").is_file():
            raise BadInput("data/pretrain/manifest.json not found: run `gptforge prepare pretrain` first")
