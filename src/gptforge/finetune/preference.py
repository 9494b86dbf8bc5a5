"""`gptforge finetune preference`: Direct Preference Optimization after instruction tuning, through trl.

LLMs-from-scratch ch. 7's last step as a stage: preference pairs (a prompt, a chosen and a
rejected response; `gptforge prepare preference`) -> the prompt rendered with the instruct
stage's template and encoded by the same code (`templates.encode`) -> trl's `DPOTrainer`, which
owns the loss (-log sigmoid(beta * (chosen log-ratio - rejected log-ratio)), or another of its
`loss_type`s), the reference model's log-probabilities and the reward metrics -> the aligned
model.

The policy starts from `preference.init_from` (default the instruct stage's model). gptforge's
own GPT goes to trl as transformers' GPT-2 (`hf_convert.to_hf`) and comes back as a gptforge
checkpoint (`from_hf`); any other Hugging Face causal LM stays one. The reference is frozen:
`preference.reference` null means the same model, a frozen copy under `method: full`, or under
`method: lora` the policy with its adapter disabled (peft's way: no second model in memory).

Why trl's trainer gets token ids rather than text: `PretokenizedDPOTrainer` skips trl's own
tokenization, so the prompt is exactly the SFT stage's (its templates, its end-of-text id,
special-token strings in the data kept as text) and pairs can be checked before training:
a pair whose chosen and rejected sequences are the same once cut to `max_length` carries no
preference and is dropped and counted; a prompt that fills `max_length` is skipped and counted
as in the instruct stage. trl's collator then truncates exactly as checked (keep_start).

What it writes:
- `checkpoints/preference/final/`: the aligned model (LoRA merged), a gptforge checkpoint or a
  Hugging Face folder as the model it started from; `checkpoints/preference/adapter/` under lora;
- `metrics/preference.json`: the validation split's reward accuracy, margin and loss before and
  after training, the pairs used and dropped, steps, time;
- `plots/preference.csv` (per logged step: train loss, margin, accuracy) and
  `plots/preference_val.csv` (each validation: loss, margin, accuracy), `dvc plots show`'s
  `preference_margins`, and `plots/preference_margins.png`;
- `reports/preference_responses.jsonl`: the first test prompts with the chosen and rejected
  references and the SFT and the DPO model's greedy answers side by side.
Per logged step the MLflow run gets loss, rewards chosen/rejected, reward accuracy and margin.

The pairs are read and encoded in `preference_data.py`, the models loaded in
`preference_models.py`; trl's logs go to the run through `trl_records.py`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from gptforge.config.schema import Config
from gptforge.finetune import trl_policy
from gptforge.finetune.common import (
    check_max_length,
    check_whole_batch,
    model_positions,
    plot_curves,
    runtime,
    trainable_params,
)
from gptforge.finetune.hf_models import greedy_answers
from gptforge.finetune.preference_data import Pairs, encode_splits, read_split
from gptforge.finetune.preference_models import PARAM, Models, load_models
from gptforge.finetune.templates import Example
from gptforge.finetune.trl_records import records_callback, write_csv
from gptforge.io import atomic_file
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics
from gptforge.training.runtime import Runtime

log = logging.getLogger("gptforge")

SPLITS = ("train", "val", "test")
FIELDS = ("instruction", "input", "chosen", "rejected")


# ---------------------------------------------------------------------------------------------
# trl


def pretokenized_trainer_class():
    """trl's DPOTrainer taking pairs already encoded (`encode_pairs`): `_prepare_dataset` is
    where trl 1.16 tokenizes text, and the one method overridden. Everything else, the loss
    included, is trl's."""
    from trl import DPOTrainer

    class PretokenizedDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    return PretokenizedDPOTrainer


def make_trainer(
    models: Models,
    pairs: dict[str, Pairs],
    cfg: Config,
    rt: Runtime,
    output_dir: str,
    max_length: int,
    callbacks: Sequence[Any] = (),
):
    """The DPOTrainer over the train pairs (the first `max_samples`), validating on all val pairs."""
    from datasets import Dataset
    from transformers.trainer_callback import ProgressCallback
    from trl import DPOConfig

    c = cfg.preference
    train_rows = pairs["train"].rows[: c.max_samples] if c.max_samples else pairs["train"].rows
    args = DPOConfig(
        output_dir=output_dir,
        report_to="none",
        save_strategy="no",
        seed=c.seed,
        data_seed=c.seed,
        # preference.batch_size is the whole batch: under torchrun each process takes its share
        per_device_train_batch_size=c.batch_size // rt.world_size,
        per_device_eval_batch_size=c.batch_size // rt.world_size,
        num_train_epochs=c.epochs,
        learning_rate=c.lr,
        weight_decay=c.weight_decay,
        lr_scheduler_type="constant",  # LLMs-from-scratch ch. 7: plain AdamW, no schedule
        beta=c.beta,
        loss_type=[c.loss_type],
        max_length=max_length,
        truncation_mode="keep_start",
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=c.eval_interval,
        # the sampler reads the `length` column; kept (trl's collator ignores it) because the
        # Trainer drops unused columns before it builds the sampler
        train_sampling_strategy="group_by_length" if c.group_by_length else "random",
        length_column_name="length",
        remove_unused_columns=False,
        activation_checkpointing=c.gradient_checkpointing,  # trl's DPOConfig would default it on
        bf16=rt.precision == "bf16",
        fp16=rt.precision == "fp16",
        use_cpu=rt.device.type == "cpu",
        dataloader_pin_memory=rt.device.type == "cuda",
        disable_tqdm=False,
    )
    trainer = pretokenized_trainer_class()(
        model=models.policy,
        ref_model=models.reference,
        args=args,
        processing_class=models.tokenizer,
        train_dataset=Dataset.from_list(train_rows),
        eval_dataset=Dataset.from_list(pairs["val"].rows),
        callbacks=list(callbacks),
    )
    trainer.remove_callback(ProgressCallback)  # it prints every log dict; Records shows a bar instead
    return trainer


# ---------------------------------------------------------------------------------------------
# Answers


def answers(
    model: nn.Module, examples: Sequence[Example], *, models: Models, gpt_model, max_new_tokens: int, rt: Runtime
) -> list[str]:
    """Greedy answers to the prompts: our GPT with the instruct stage's `respond`, a Hugging Face
    model with `greedy_answers` (both stop at the model's end of text)."""
    if gpt_model is not None:
        from gptforge.finetune.instruct import respond

        return respond(gpt_model.to(rt.device).eval(), examples, enc=models.enc, max_new_tokens=max_new_tokens, rt=rt)[
            0
        ]
    was_training = model.training
    model.eval()
    try:
        return greedy_answers(
            model, examples, enc=models.enc, max_new_tokens=max_new_tokens, positions=model_positions(model), rt=rt
        )[0]
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------------------------------
# The recipe


@dataclass
class Session:
    """What the recipe's steps hand each other."""

    models: Models
    records: dict[str, list[dict]]
    pairs: dict[str, Pairs]
    rt: Runtime
    max_length: int
    template: str
    sft_answers: list[str]
    trainer: Any = None
    callback: Any = None
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    train_seconds: float = 0.0
    workdir: str = ""


def setup(cfg: Config, data_dir: str | os.PathLike, run=NullRun()) -> Session:
    """Data and reference checks, the models, the encoded pairs, and the SFT model's answers to
    the first test prompts (before it changes)."""
    c = cfg.preference
    rt = runtime(c.device, c.precision, param=PARAM)
    check_whole_batch(PARAM, c.batch_size, rt.world_size)
    records = {name: read_split(Path(data_dir) / f"{name}.jsonl") for name in SPLITS}  # fail before the models
    template = c.template or cfg.instruct.template
    models = load_models(cfg, rt)
    if template == "chat" and models.gpt is not None:
        from gptforge.finetune.templates import chat_template_tokenizer

        chat_template_tokenizer(models.enc)  # raises: tiktoken has no chat template
    max_length = check_max_length(c.max_length, models.policy, f"{PARAM}.max_length")

    pairs = encode_splits(records, template, models.enc, max_length, stage="preference", param=PARAM)

    n = len(pairs["test"].rows) if c.n_responses is None else min(c.n_responses, len(pairs["test"].rows))
    if not rt.master:  # under torchrun process 0 answers (before and after) and writes
        n = 0
    sft_answers = answers(
        models.policy,
        pairs["test"].prompts()[:n],
        models=models,
        gpt_model=models.gpt,
        max_new_tokens=c.max_new_tokens,
        rt=rt,
    )
    if models.gpt is not None:
        models.gpt.to("cpu")  # only its config is needed from here on: keep the device for training
    n_train, n_total = trainable_params(models.policy)
    log.info(
        "preference: DPO (%s, beta %g, %s), %d of %d parameters train; template %s, max_length %d; %s",
        c.loss_type,
        c.beta,
        c.method,
        n_train,
        n_total,
        template,
        max_length,
        ", ".join(f"{len(p.rows)} {k}" for k, p in pairs.items()),
    )
    run.log_metrics({"trainable_params": n_train, "total_params": n_total})
    return Session(models, records, pairs, rt, max_length, template, sft_answers)


def _val_summary(metrics: dict[str, float], suffix: str = "") -> dict[str, float]:
    return {
        f"val_reward_accuracy{suffix}": metrics["eval_rewards/accuracies"],
        f"val_reward_margin{suffix}": metrics["eval_rewards/margins"],
        f"val_loss{suffix}": metrics["eval_loss"],
        f"val_rewards_chosen{suffix}": metrics["eval_rewards/chosen"],
        f"val_rewards_rejected{suffix}": metrics["eval_rewards/rejected"],
    }


# The validation of a policy that is its own reference, under the sigmoid loss: every implicit
# reward beta * (log pi(y|x) - log pi_ref(y|x)) is 0, so no pair ranks right (the comparison is
# strict), the margin is 0 and the loss is -log sigmoid(0) = log 2.
SAME_AS_REFERENCE = {
    "eval_loss": math.log(2),
    "eval_rewards/accuracies": 0.0,
    "eval_rewards/margins": 0.0,
    "eval_rewards/chosen": 0.0,
    "eval_rewards/rejected": 0.0,
}


def start_validation(trainer, cfg: Config) -> dict[str, float]:
    """The validation before training. With `preference.reference` null the policy starts as its
    reference (a frozen copy, or under LoRA the policy with its adapter off, whose B matrices
    start at zero), so under the sigmoid loss the figures are SAME_AS_REFERENCE exactly: logged
    as an evaluation would log them (the run, plots/preference_val.csv) without scoring every pair
    twice (43 s of the quickstart's DPO stage). Any other loss or reference is measured, and so
    is a run under torchrun: the one-process and DDP runs of tests/test_finetune_distributed.py
    agree within its 2% only when both evaluated first (with the one-process run skipping it
    their validation losses were 2.7% apart; not traced further)."""
    c = cfg.preference
    if c.reference is None and c.loss_type == "sigmoid" and trainer.args.world_size == 1:
        trainer.log(dict(SAME_AS_REFERENCE))
        return dict(SAME_AS_REFERENCE)
    return trainer.evaluate()


def train(s: Session, cfg: Config, run=NullRun()) -> Session:
    """Validation before, trl's DPO epochs, validation after."""
    c = cfg.preference
    torch.manual_seed(c.seed)
    s.workdir = tempfile.mkdtemp(prefix="gptforge-dpo-")  # trl's output_dir: nothing is saved there
    n_train = min(len(s.pairs["train"].rows), c.max_samples or len(s.pairs["train"].rows))
    # last_eval False: the validation after training below is the only one at the last step (the
    # Trainer's own would score every pair a second time: 26 s of the quickstart's DPO stage)
    s.callback = records_callback(run, math.ceil(n_train / c.batch_size) * c.epochs, last_eval=False)
    s.trainer = make_trainer(s.models, s.pairs, cfg, s.rt, s.workdir, s.max_length, callbacks=[s.callback])
    s.before = _val_summary(start_validation(s.trainer, cfg), "_before")
    s.rt.sync()
    t0 = time.perf_counter()
    s.trainer.train()
    s.rt.sync()
    s.train_seconds = time.perf_counter() - t0
    s.after = _val_summary(s.trainer.evaluate())
    log.info(
        "preference: validation reward accuracy %.3f -> %.3f, margin %.4f -> %.4f",
        s.before["val_reward_accuracy_before"],
        s.after["val_reward_accuracy"],
        s.before["val_reward_margin_before"],
        s.after["val_reward_margin"],
    )
    return s


def finish(
    s: Session,
    cfg: Config,
    run=NullRun(),
    out_dir: str | os.PathLike = "checkpoints/preference",
    metrics_path: str | os.PathLike = "metrics/preference.json",
    responses_path: str | os.PathLike = "reports/preference_responses.jsonl",
    plots_dir: str | os.PathLike = "plots",
) -> dict:
    """Save the adapter, merge it, answer the test prompts, and write the model, the records and
    the metrics."""
    import shutil

    c, out_dir, plots_dir = cfg.preference, Path(out_dir), Path(plots_dir)
    if not s.rt.master:  # under torchrun trl's trainer has kept every process's copy equal
        shutil.rmtree(s.workdir, ignore_errors=True)
        return {}
    n_train, n_total = trainable_params(s.trainer.model)
    trained = trl_policy.merged(s.trainer.model, method=c.method, out_dir=out_dir, started_as=s.models.gpt)

    prompts = s.pairs["test"].prompts()[: len(s.sft_answers)]
    dpo_answers = answers(
        trained.model, prompts, models=s.models, gpt_model=trained.gpt, max_new_tokens=c.max_new_tokens, rt=s.rt
    )
    with atomic_file(responses_path, "w", encoding="utf-8") as f:
        for index, sft, dpo in zip(s.pairs["test"].kept, s.sft_answers, dpo_answers):
            rec = s.records["test"][index]
            f.write(
                json.dumps(
                    {**{k: rec[k] for k in FIELDS}, "sft_response": sft, "dpo_response": dpo}, ensure_ascii=False
                )
                + "\n"
            )

    final = trl_policy.save(trained, s.models.tokenizer, out_dir / "final")

    history = s.callback.train
    val_history = s.callback.val
    write_csv(
        plots_dir / "preference.csv", history, ["step", "train_loss", "train_reward_margin", "train_reward_accuracy"]
    )
    write_csv(
        plots_dir / "preference_val.csv", val_history, ["step", "val_loss", "val_reward_margin", "val_reward_accuracy"]
    )
    png = plot_curves(
        {
            "train (batch)": [(r["step"], r["train_reward_margin"]) for r in history],
            "validation (all pairs)": [(r["step"], r["val_reward_margin"]) for r in val_history],
        },
        "reward margin (beta x log-ratio, chosen - rejected)",
        plots_dir / "preference_margins.png",
    )

    train_pairs = min(len(s.pairs["train"].rows), c.max_samples or len(s.pairs["train"].rows))
    steps = s.trainer.state.global_step
    metrics = {
        **s.before,
        **s.after,
        "train_pairs": train_pairs,
        "val_pairs": len(s.pairs["val"].rows),
        "skipped_too_long": sum(p.skipped_too_long for p in s.pairs.values()),
        "dropped_identical_after_truncation": sum(p.identical for p in s.pairs.values()),
        "steps": steps,
        "train_seconds": s.train_seconds,
        "pairs_per_sec": train_pairs * c.epochs / s.train_seconds if s.train_seconds > 0 else 0.0,
        "trainable_params": n_train,
        "total_params": n_total,
    }
    publish_metrics(run, metrics, metrics_path)
    run.log_artifact(responses_path)
    for path in (plots_dir / "preference.csv", plots_dir / "preference_val.csv", png):
        if path is not None:
            run.log_artifact(path)
    trl_policy.log(run, trained, final)
    shutil.rmtree(s.workdir, ignore_errors=True)
    log.info(
        "preference done: %d steps over %d pairs in %.1f s; validation reward accuracy %.3f, margin %.4f",
        steps,
        train_pairs,
        s.train_seconds,
        metrics["val_reward_accuracy"],
        metrics["val_reward_margin"],
    )
    return metrics


def finetune_preference(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run=NullRun(),
    data_dir: str | os.PathLike = "data/preference",
    out_dir: str | os.PathLike = "checkpoints/preference",
    metrics_path: str | os.PathLike = "metrics/preference.json",
    responses_path: str | os.PathLike = "reports/preference_responses.jsonl",
    plots_dir: str | os.PathLike = "plots",
) -> dict:
    """The stage: set up, train, finish (each a step: a Prefect task under PrefectSteps)."""
    session = steps(setup, cfg, data_dir, run)
    session = steps(train, session, cfg, run)
    return steps(finish, session, cfg, run, out_dir, metrics_path, responses_path, plots_dir)
