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
"""

from __future__ import annotations

import copy
import csv
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from gptforge.config.schema import Config
from gptforge.data.sources import read_records
from gptforge.errors import BadInput
from gptforge.finetune import trl_policy
from gptforge.finetune.common import (apply_lora, check_max_length, check_whole_batch, load_base, load_hf_base,
                                      model_positions, plot_curves, runtime, trainable_params)
from gptforge.finetune.hf_models import greedy_answers
from gptforge.finetune.templates import Example, encode
from gptforge.io import atomic_file
from gptforge.modeling.hf_causal import HFTokenizer, hf_config_dict, hf_source
from gptforge.modeling.weights import CONFIG_FILE
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics
from gptforge.training.loop import Runtime

log = logging.getLogger("gptforge")

SPLITS = ("train", "val", "test")
PARAM = "preference"
FIELDS = ("instruction", "input", "chosen", "rejected")


# ---------------------------------------------------------------------------------------------
# Data


def read_split(path: str | os.PathLike) -> list[dict]:
    """The {instruction, input, chosen, rejected} records of one split written by `gptforge
    prepare preference`; BadInput naming the file when it is missing, empty or not such records."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"preference data: {path} not found; run `gptforge prepare preference` first")
    records = []
    for number, rec in enumerate(read_records(path, param="preference data"), 1):
        if not (isinstance(rec, dict) and all(isinstance(rec.get(k), str) for k in ("instruction", "chosen", "rejected"))
                and isinstance(rec.get("input") or "", str)):
            raise BadInput(f"preference data: {path} record {number} is not an object with string \"instruction\", "
                           "\"chosen\" and \"rejected\"")
        records.append({"instruction": rec["instruction"], "input": rec.get("input") or "",
                        "chosen": rec["chosen"], "rejected": rec["rejected"]})
    if not records:
        raise BadInput(f"preference data: {path} has no pairs (the {path.stem} split is empty)")
    return records


@dataclass
class Pairs:
    """Encoded pairs of one split: trl's columns, the record index of each, what was dropped."""

    rows: list[dict] = field(default_factory=list)  # {"prompt_ids", "chosen_ids", "rejected_ids", "length"}
    kept: list[int] = field(default_factory=list)
    skipped_too_long: int = 0  # the prompt alone fills max_length
    identical: int = 0  # chosen and rejected are the same sequence once cut to max_length

    def prompts(self) -> list[Example]:
        """(prompt_ids, chosen_ids) of each pair: what the answer functions take."""
        return [(r["prompt_ids"], r["chosen_ids"]) for r in self.rows]


def encode_pairs(records: Sequence[dict], template: str, enc, max_length: int) -> Pairs:
    """Each record's prompt, chosen and rejected ids, encoded as the instruct stage encodes an
    (instruction, input, output) record (`templates.encode`: the response ends in the end-of-text
    id, or the chat template's end of turn)."""
    out = Pairs()
    for i, rec in enumerate(records):
        prompt, chosen = encode({**rec, "output": rec["chosen"]}, template, enc)
        _, rejected = encode({**rec, "output": rec["rejected"]}, template, enc)
        if len(prompt) >= max_length:
            out.skipped_too_long += 1
        elif (prompt + chosen)[:max_length] == (prompt + rejected)[:max_length]:
            out.identical += 1
        else:
            out.rows.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected,
                             "length": len(prompt) + max(len(chosen), len(rejected))})
            out.kept.append(i)
    return out



def encode_splits(records: dict[str, Sequence[dict]], template: str, enc, max_length: int, *, stage: str,
                  param: str) -> dict[str, Pairs]:
    """`encode_pairs` for every split: BadInput when a split keeps no pair at `param`.max_length,
    a warning (naming `stage`) for the pairs dropped. Shared by the DPO and reward-model stages."""
    pairs = {name: encode_pairs(recs, template, enc, max_length) for name, recs in records.items()}
    for name, p in pairs.items():
        if not p.rows:
            raise BadInput(f"preference data: none of the {len(records[name])} {name} pairs is usable at "
                           f"{param}.max_length={max_length} ({p.skipped_too_long} prompts fill it, {p.identical} "
                           "pairs are identical once cut to it)")
    skipped, identical = (sum(getattr(p, k) for p in pairs.values()) for k in ("skipped_too_long", "identical"))
    if skipped or identical:
        log.warning("%s: skipped %d pair(s) whose prompt fills max_length %d and dropped %d whose chosen and "
                    "rejected are identical once cut to it", stage, skipped, max_length, identical)
    return pairs

# ---------------------------------------------------------------------------------------------
# Models


def model_family(path: str, *, param: str) -> tuple[str, int | None]:
    """(architecture, vocabulary size) from a model's config.json without loading its weights:
    gptforge checkpoints and Hugging Face GPT-2 folders are both "gpt2" (our GPT converts to and
    from it); any other Hugging Face folder its `model_type`. A hub id (not a folder) is
    (its id, None): checked after loading. BadInput when a folder has no readable config.json."""
    if hf_source(path) is not None and not Path(path).is_dir():
        return path, None
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        raise BadInput(f"{param}: {path} is not a model folder (no {CONFIG_FILE}); run the stage that makes it "
                       "first, or name a gptforge checkpoint or a Hugging Face causal-LM folder")
    hf = hf_config_dict(config)
    if hf is not None:
        return hf["model_type"], hf.get("vocab_size")
    try:
        ours = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise BadInput(f"{param}: cannot read {config}") from None
    return "gpt2", ours.get("n_vocab") if isinstance(ours, dict) else None


def check_reference(init_from: str, reference: str) -> None:
    """One line (BadInput) when the reference cannot score the policy's tokens: another
    architecture or another vocabulary. The rewards are log-probability ratios of the same token
    ids under both models, so both need the same tokenizer; a smaller or larger model of the same
    family (GPT-2 124M as the reference of a 355M policy) is fine."""
    policy_arch, policy_vocab = model_family(init_from, param=f"{PARAM}.init_from")
    ref_arch, ref_vocab = model_family(reference, param=f"{PARAM}.reference")
    if policy_vocab is None or ref_vocab is None:
        return  # a hub id: compared after loading (`check_loaded_reference`)
    if ref_arch != policy_arch:
        raise BadInput(f"{PARAM}.reference: {reference} is a {ref_arch} model, the policy ({PARAM}.init_from "
                       f"{init_from}) a {policy_arch} model; the reference must be of the policy's architecture "
                       "and tokenizer")
    if ref_vocab != policy_vocab:
        raise BadInput(f"{PARAM}.reference: {reference} has a vocabulary of {ref_vocab} tokens, the policy "
                       f"{init_from} {policy_vocab}; the reference must use the policy's tokenizer")


def check_loaded_reference(policy: nn.Module, ref: nn.Module, reference: str) -> None:
    """`check_reference` for models that came from the hub (no config.json to read first)."""
    p, r = policy.config, ref.config
    if p.model_type != r.model_type or p.vocab_size != r.vocab_size:
        raise BadInput(f"{PARAM}.reference: {reference} is a {r.model_type} model with {r.vocab_size} tokens, the "
                       f"policy a {p.model_type} model with {p.vocab_size}; the reference must be of the policy's "
                       "architecture and tokenizer")


@dataclass
class Models:
    """The policy trl trains (a transformers model), its frozen reference (None: the policy with
    its LoRA adapter disabled), the encoder the templates use and the tokenizer trl is given."""

    policy: nn.Module
    reference: nn.Module | None
    enc: Any  # tiktoken's Encoding (our GPT) or hf_causal.HFTokenizer
    tokenizer: Any  # a transformers tokenizer: trl's processing_class (its pad id)
    gpt: Any = None  # our GPT as loaded (None for a Hugging Face model): its config goes back out
    hf_source: str | None = None


def load_models(cfg: Config, rt: Runtime) -> Models:
    """Policy, reference and tokenizers for `preference.init_from` / `preference.reference`."""
    c = cfg.preference
    if c.reference is not None:
        check_reference(c.init_from, c.reference)
    source = hf_source(c.init_from)
    if source is None:  # our GPT: trained by trl as transformers' GPT-2 with the same weights
        from gptforge.modeling.export import hf_tokenizer
        from gptforge.modeling.hf_convert import to_hf
        from gptforge.modeling.tokenizer import load_tokenizer

        enc = load_tokenizer(cfg.tokenizer.path)
        gpt = load_base(c.init_from, enc.n_vocab, param=f"{PARAM}.init_from")
        policy = to_hf(gpt).train()
        tokenizer = hf_tokenizer(cfg.tokenizer.path, gpt.config.block_size)
        ref = None
        if c.reference is not None:
            ref = to_hf(load_base(c.reference, enc.n_vocab, param=f"{PARAM}.reference"))
    else:
        policy, tokenizer = load_hf_base(source, rt, param=PARAM, lora=c.method == "lora")
        enc, gpt = HFTokenizer(tokenizer), None
        ref = None
        if c.reference is not None:
            ref_source = hf_source(c.reference)
            if ref_source is None:
                raise BadInput(f"{PARAM}.reference: {c.reference} is a gptforge GPT; the policy {c.init_from} is a "
                               f"Hugging Face {policy.config.model_type} model: the reference must be of its "
                               "architecture and tokenizer")
            ref, _ = load_hf_base(ref_source, rt, param=f"{PARAM}.reference", lora=False)
            check_loaded_reference(policy, ref, c.reference)
    if ref is None and c.method == "full":
        ref = copy.deepcopy(policy)  # the policy as it starts, frozen
    if ref is not None:
        ref.to(rt.device).eval().requires_grad_(False)
    policy.to(rt.device)
    if c.method == "lora":
        torch.manual_seed(c.seed)  # the adapters' init: the same in every run and on every process
        policy = apply_lora(policy, c.lora, task_type="CAUSAL_LM")
    return Models(policy, ref, enc, tokenizer, gpt, source)


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


def make_trainer(models: Models, pairs: dict[str, Pairs], cfg: Config, rt: Runtime, output_dir: str,
                 max_length: int, callbacks: Sequence[Any] = ()):
    """The DPOTrainer over the train pairs (the first `max_samples`), validating on all val pairs."""
    from datasets import Dataset
    from transformers.trainer_callback import ProgressCallback
    from trl import DPOConfig

    c = cfg.preference
    train_rows = pairs["train"].rows[: c.max_samples] if c.max_samples else pairs["train"].rows
    args = DPOConfig(
        output_dir=output_dir, report_to="none", save_strategy="no", seed=c.seed, data_seed=c.seed,
        # preference.batch_size is the whole batch: under torchrun each process takes its share
        per_device_train_batch_size=c.batch_size // rt.world_size,
        per_device_eval_batch_size=c.batch_size // rt.world_size,
        num_train_epochs=c.epochs, learning_rate=c.lr, weight_decay=c.weight_decay,
        lr_scheduler_type="constant",  # LLMs-from-scratch ch. 7: plain AdamW, no schedule
        beta=c.beta, loss_type=[c.loss_type], max_length=max_length, truncation_mode="keep_start",
        logging_steps=1, eval_strategy="steps", eval_steps=c.eval_interval,
        # the sampler reads the `length` column; kept (trl's collator ignores it) because the
        # Trainer drops unused columns before it builds the sampler
        train_sampling_strategy="group_by_length" if c.group_by_length else "random", length_column_name="length",
        remove_unused_columns=False,
        activation_checkpointing=c.gradient_checkpointing,  # trl's DPOConfig would default it on
        bf16=rt.precision == "bf16", fp16=rt.precision == "fp16", use_cpu=rt.device.type == "cpu",
        dataloader_pin_memory=rt.device.type == "cuda", disable_tqdm=False,
    )
    trainer = pretokenized_trainer_class()(
        model=models.policy, ref_model=models.reference, args=args, processing_class=models.tokenizer,
        train_dataset=Dataset.from_list(train_rows), eval_dataset=Dataset.from_list(pairs["val"].rows),
        callbacks=list(callbacks))
    trainer.remove_callback(ProgressCallback)  # it prints every log dict; Records shows a bar instead
    return trainer


METRIC_NAMES = {"loss": "loss", "rewards/chosen": "rewards_chosen", "rewards/rejected": "rewards_rejected",
                "rewards/accuracies": "reward_accuracy", "rewards/margins": "reward_margin",
                "logps/chosen": "logps_chosen", "logps/rejected": "logps_rejected"}


def records_callback(run, total_steps: int, *, names: dict[str, str] = METRIC_NAMES, desc: str = "preference",
                     shown: tuple[str, str] = ("margin", "train_reward_margin"), last_eval: bool = True):
    """A transformers TrainerCallback that sends trl's logs to the MLflow run under our names
    (`names`: trl's -> ours, as train_<ours>, and val_<ours> at evaluations), keeps them for the
    plots, and shows a progress bar (`desc`) with the loss and one more figure (`shown`: its
    label and metric). `last_eval` False cancels the Trainer's evaluation at the last step, for a
    stage that scores every validation pair itself after training (train_reward)."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class Records(TrainerCallback):
        def __init__(self) -> None:
            self.train: list[dict] = []
            self.val: list[dict] = []
            self.bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:  # one bar under torchrun
                self.bar = tqdm(total=state.max_steps or total_steps, desc=desc, unit="step", leave=False)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)
            if not last_eval and state.global_step >= state.max_steps:
                control.should_evaluate = False

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            prefix = "val_" if "eval_loss" in logs else "train_" if "loss" in logs else None
            if prefix is None:  # the end-of-training summary (train_runtime, ...)
                return
            key = (lambda k: f"eval_{k}") if prefix == "val_" else (lambda k: k)
            row = {f"{prefix}{ours}": float(logs[key(theirs)]) for theirs, ours in names.items()
                   if key(theirs) in logs}
            run.log_metrics(row, step=state.global_step)
            (self.val if prefix == "val_" else self.train).append({"step": state.global_step, **row})
            if self.bar is not None and prefix == "train_":
                self.bar.set_postfix({"loss": f"{row.get('train_loss', 0):.4f}",
                                      shown[0]: f"{row.get(shown[1], 0):.4f}"}, refresh=False)

    return Records()


# ---------------------------------------------------------------------------------------------
# Answers


def answers(model: nn.Module, examples: Sequence[Example], *, models: Models, gpt_model, max_new_tokens: int,
            rt: Runtime) -> list[str]:
    """Greedy answers to the prompts: our GPT with the instruct stage's `respond`, a Hugging Face
    model with `greedy_answers` (both stop at the model's end of text)."""
    if gpt_model is not None:
        from gptforge.finetune.instruct import respond

        return respond(gpt_model.to(rt.device).eval(), examples, enc=models.enc, max_new_tokens=max_new_tokens,
                       rt=rt)[0]
    was_training = model.training
    model.eval()
    try:
        return greedy_answers(model, examples, enc=models.enc, max_new_tokens=max_new_tokens,
                              positions=model_positions(model), rt=rt)[0]
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
    sft_answers = answers(models.policy, pairs["test"].prompts()[:n], models=models, gpt_model=models.gpt,
                          max_new_tokens=c.max_new_tokens, rt=rt)
    if models.gpt is not None:
        models.gpt.to("cpu")  # only its config is needed from here on: keep the device for training
    n_train, n_total = trainable_params(models.policy)
    log.info("preference: DPO (%s, beta %g, %s), %d of %d parameters train; template %s, max_length %d; %s",
             c.loss_type, c.beta, c.method, n_train, n_total, template, max_length,
             ", ".join(f"{len(p.rows)} {k}" for k, p in pairs.items()))
    run.log_metrics({"trainable_params": n_train, "total_params": n_total})
    return Session(models, records, pairs, rt, max_length, template, sft_answers)


def _val_summary(metrics: dict[str, float], suffix: str = "") -> dict[str, float]:
    return {f"val_reward_accuracy{suffix}": metrics["eval_rewards/accuracies"],
            f"val_reward_margin{suffix}": metrics["eval_rewards/margins"],
            f"val_loss{suffix}": metrics["eval_loss"],
            f"val_rewards_chosen{suffix}": metrics["eval_rewards/chosen"],
            f"val_rewards_rejected{suffix}": metrics["eval_rewards/rejected"]}


def train(s: Session, cfg: Config, run=NullRun()) -> Session:
    """Validation before, trl's DPO epochs, validation after."""
    import math

    c = cfg.preference
    torch.manual_seed(c.seed)
    s.workdir = tempfile.mkdtemp(prefix="gptforge-dpo-")  # trl's output_dir: nothing is saved there
    n_train = min(len(s.pairs["train"].rows), c.max_samples or len(s.pairs["train"].rows))
    s.callback = records_callback(run, math.ceil(n_train / c.batch_size) * c.epochs)
    s.trainer = make_trainer(s.models, s.pairs, cfg, s.rt, s.workdir, s.max_length, callbacks=[s.callback])
    s.before = _val_summary(s.trainer.evaluate(), "_before")
    s.rt.sync()
    t0 = time.perf_counter()
    s.trainer.train()
    s.rt.sync()
    s.train_seconds = time.perf_counter() - t0
    s.after = _val_summary(s.trainer.evaluate())
    log.info("preference: validation reward accuracy %.3f -> %.3f, margin %.4f -> %.4f",
             s.before["val_reward_accuracy_before"], s.after["val_reward_accuracy"],
             s.before["val_reward_margin_before"], s.after["val_reward_margin"])
    return s


def finish(s: Session, cfg: Config, run=NullRun(), out_dir: str | os.PathLike = "checkpoints/preference",
           metrics_path: str | os.PathLike = "metrics/preference.json",
           responses_path: str | os.PathLike = "reports/preference_responses.jsonl",
           plots_dir: str | os.PathLike = "plots") -> dict:
    """Save the adapter, merge it, answer the test prompts, and write the model, the records and
    the metrics."""
    import shutil

    c, out_dir, plots_dir = cfg.preference, Path(out_dir), Path(plots_dir)
    if not s.rt.master:  # under torchrun trl's trainer has kept every process's copy equal
        shutil.rmtree(s.workdir, ignore_errors=True)
        return {}
    n_train, n_total = trainable_params(s.trainer.model)
    trained = trl_policy.merged(s.trainer.model, method=c.method, out_dir=out_dir, started_as=s.models.gpt)

    prompts = s.pairs["test"].prompts()[:len(s.sft_answers)]
    dpo_answers = answers(trained.model, prompts, models=s.models, gpt_model=trained.gpt,
                          max_new_tokens=c.max_new_tokens, rt=s.rt)
    with atomic_file(responses_path, "w", encoding="utf-8") as f:
        for index, sft, dpo in zip(s.pairs["test"].kept, s.sft_answers, dpo_answers):
            rec = s.records["test"][index]
            f.write(json.dumps({**{k: rec[k] for k in FIELDS}, "sft_response": sft, "dpo_response": dpo},
                               ensure_ascii=False) + "\n")

    final = trl_policy.save(trained, s.models.tokenizer, out_dir / "final")

    history = s.callback.train
    val_history = s.callback.val
    write_csv(plots_dir / "preference.csv", history,
              ["step", "train_loss", "train_reward_margin", "train_reward_accuracy"])
    write_csv(plots_dir / "preference_val.csv", val_history,
              ["step", "val_loss", "val_reward_margin", "val_reward_accuracy"])
    png = plot_curves({"train (batch)": [(r["step"], r["train_reward_margin"]) for r in history],
                       "validation (all pairs)": [(r["step"], r["val_reward_margin"]) for r in val_history]},
                      "reward margin (beta x log-ratio, chosen - rejected)", plots_dir / "preference_margins.png")

    train_pairs = min(len(s.pairs["train"].rows), c.max_samples or len(s.pairs["train"].rows))
    steps = s.trainer.state.global_step
    metrics = {**s.before, **s.after,
               "train_pairs": train_pairs, "val_pairs": len(s.pairs["val"].rows),
               "skipped_too_long": sum(p.skipped_too_long for p in s.pairs.values()),
               "dropped_identical_after_truncation": sum(p.identical for p in s.pairs.values()),
               "steps": steps, "train_seconds": s.train_seconds,
               "pairs_per_sec": train_pairs * c.epochs / s.train_seconds if s.train_seconds > 0 else 0.0,
               "trainable_params": n_train, "total_params": n_total}
    publish_metrics(run, metrics, metrics_path)
    run.log_artifact(responses_path)
    for path in (plots_dir / "preference.csv", plots_dir / "preference_val.csv", png):
        if path is not None:
            run.log_artifact(path)
    trl_policy.log(run, trained, final)
    shutil.rmtree(s.workdir, ignore_errors=True)
    log.info("preference done: %d steps over %d pairs in %.1f s; validation reward accuracy %.3f, margin %.4f",
             steps, train_pairs, s.train_seconds, metrics["val_reward_accuracy"], metrics["val_reward_margin"])
    return metrics


def write_csv(path: str | os.PathLike, rows: Sequence[dict], fields: Sequence[str]) -> None:
    with atomic_file(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in fields})


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
