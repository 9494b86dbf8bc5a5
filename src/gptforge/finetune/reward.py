"""`gptforge finetune reward` (DVC stage `train_reward`): a reward model on the preference pairs, through trl.

RLHF's first half (Ouyang et al. 2022; LLMs-from-scratch's notes on it): a scalar head on the SFT
model, trained so that a preferred answer scores above the rejected one. The pairs come from
`gptforge prepare preference`, encoded exactly as the DPO stage encodes them (`preference_data.read_split`,
`preference_data.encode_pairs`: the instruct stage's template, its end-of-text id) and cut to `max_length`
(keep the start); trl's `RewardTrainer` owns the loss, -log sigmoid(r_chosen - r_rejected) averaged
over the pairs of a batch (plus `center_rewards_coefficient` x mean(r^2) when set).

The model: gptforge's GPT becomes transformers' `GPT2ForSequenceClassification` (num_labels 1) with
the GPT's weights (`hf_convert.to_hf`) and a new `score` head; a Hugging Face causal LM folder
becomes `AutoModelForSequenceClassification` of the same folder and keeps its own tokenizer (the
pairs are encoded in its tokens; a folder without a tokenizer is refused before any model loads);
a sequence-classification folder with one label (a reward model) goes on training as it is. The
pad id is the end-of-text id, so the reward is read at the last token before it: the end of the
answer, the same place in every pair.

`val_accuracy` is the share of validation pairs with r_chosen > r_rejected, `val_margin` the mean
of r_chosen - r_rejected, both from plain forward passes before (`*_before`) and after training.

Writes `checkpoints/reward/final/` (a Hugging Face sequence-classification folder: safetensors,
config with pad_token_id, the tokenizer; `AutoModelForSequenceClassification.from_pretrained`
loads it), `metrics/reward.json`, `plots/reward.csv` (per step: loss, accuracy, margin),
`plots/reward_val.csv` and `plots/reward_margins.png`. Under torchrun each process takes
`batch_size // world` pairs a step; process 0 writes.
"""

from __future__ import annotations

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
from gptforge.errors import BadInput
from gptforge.finetune.common import (
    apply_lora,
    check_max_length,
    check_whole_batch,
    load_base,
    merge_lora,
    plot_curves,
    runtime,
    trainable_params,
)
from gptforge.finetune.preference_data import Pairs, encode_splits, read_split
from gptforge.finetune.trl_records import write_csv
from gptforge.io import atomic_dir
from gptforge.modeling.hf_causal import CONFIG_FILE, hf_config_dict, hf_source
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics
from gptforge.training.runtime import Runtime

log = logging.getLogger("gptforge")

PARAM = "reward"
SPLITS = ("train", "val")
HEADS = ("score", "classifier")  # the new head's module name in transformers' *ForSequenceClassification


# ---------------------------------------------------------------------------------------------
# The model


@dataclass
class RewardModel:
    """The model trl trains (a transformers *ForSequenceClassification, num_labels 1), the
    encoder the templates use, and the transformers tokenizer saved with it."""

    model: nn.Module
    enc: Any  # tiktoken's Encoding (our GPT) or hf_causal.HFTokenizer
    tokenizer: Any
    pad_id: int
    source: str  # "gptforge" or the Hugging Face folder / hub id


def is_sequence_classifier(path: str) -> bool:
    """A local folder saved from a *ForSequenceClassification model (a reward model already)."""
    hf = hf_config_dict(Path(path) / CONFIG_FILE) if Path(path).is_dir() else None
    return bool(hf) and any(str(a).endswith("ForSequenceClassification") for a in hf.get("architectures") or [])


def gpt_reward_model(gpt, enc, tokenizer_path: str | None, seed: int) -> RewardModel:
    """Transformers' GPT2ForSequenceClassification (num_labels 1) with our GPT's weights (its
    Hugging Face form: `to_hf`) and a new `score` head drawn with `seed`; pad id = end of text.
    `from_hf` takes it back (the score head aside): both GELUs are GPT-2's tanh approximation."""
    from transformers import GPT2ForSequenceClassification

    from gptforge.modeling.export import hf_tokenizer
    from gptforge.modeling.hf_convert import to_hf

    lm = to_hf(gpt)
    config = lm.config
    config.num_labels, config.pad_token_id = 1, int(enc.eot_token)
    # GPT-2's tanh GELU, as one fused kernel rather than gelu_new's five ops (a tenth of a CPU step)
    config.activation_function = "gelu_pytorch_tanh"
    config.architectures = ["GPT2ForSequenceClassification"]
    torch.manual_seed(seed)
    model = GPT2ForSequenceClassification(config)
    model.transformer.load_state_dict(lm.transformer.state_dict())  # strict: the same GPT-2 body
    tokenizer = hf_tokenizer(tokenizer_path, gpt.config.block_size)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(enc.eot_token))
    return RewardModel(model.train(), enc, tokenizer, int(enc.eot_token), "gptforge")


def hf_reward_model(source: str, seed: int) -> RewardModel:
    """AutoModelForSequenceClassification (num_labels 1) of a Hugging Face folder or hub id, with
    its own tokenizer. One line (BadInput), before any weights load, for: no config, a model type
    transformers has no sequence-classification head for, no tokenizer, a classifier with more
    than one label."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    from trl.trainer.reward_trainer import suppress_seqcls_warning

    from gptforge.modeling.hf_causal import HFTokenizer

    param = f"{PARAM}.init_from"
    path = Path(source).expanduser()
    local = path.is_dir()
    where = str(path) if local else source

    def reason(e: BaseException) -> str:
        text = " ".join(f"{type(e).__name__}: {e}".split())
        return text if len(text) <= 160 else text[:157] + "..."

    try:
        config = AutoConfig.from_pretrained(where, local_files_only=local)
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, unreadable config: one line either way
        raise BadInput(f"{param}: cannot read the config of {where} ({reason(e)})") from None
    if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise BadInput(
            f"{param}: {where} is a {config.model_type} model, for which transformers has no "
            "sequence-classification (reward) head"
        )
    classifier = any(str(a).endswith("ForSequenceClassification") for a in config.architectures or [])
    if classifier and config.num_labels != 1:
        raise BadInput(
            f"{param}: {where} is a classifier of {config.num_labels} labels; a reward model has one (a scalar score)"
        )
    has_tokenizer = not local or any(
        (path / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    )
    tokenizer = None
    if has_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=local)
        except Exception:  # noqa: BLE001 - reported below, in one line
            tokenizer = None
    if tokenizer is None or len(tokenizer) < 2:
        raise BadInput(
            f"{param}: {where} has no tokenizer; a reward model scores the pairs in its own tokens: "
            "save its tokenizer in the folder (tokenizer.save_pretrained)"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = HFTokenizer(tokenizer)  # BadInput without an eos token
    torch.manual_seed(seed)  # the new head's init
    try:
        with suppress_seqcls_warning():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                where, num_labels=1, local_files_only=local, dtype=torch.float32, output_loading_info=True
            )
    except Exception as e:  # noqa: BLE001 - damaged weights, shapes that disagree with config.json
        raise BadInput(f"{param}: cannot load {where} as a reward model ({reason(e)})") from None
    absent = [k for k in info.get("missing_keys", ()) if k.split(".")[0] not in HEADS]
    if absent:
        raise BadInput(f"{param}: {where} lacks tensors {', '.join(sorted(absent)[:3])}")
    model.config.pad_token_id = tokenizer.pad_token_id
    log.info(
        "reward model from Hugging Face %s %s (%.2fM parameters)",
        config.model_type,
        where,
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return RewardModel(model.train(), enc, tokenizer, int(tokenizer.pad_token_id), source)


def load_reward_model(cfg: Config, rt: Runtime) -> RewardModel:
    """The reward model for `reward.init_from` on `rt.device` (LoRA-wrapped under method lora)."""
    c = cfg.reward
    if is_sequence_classifier(c.init_from) or hf_source(c.init_from) is not None:
        rm = hf_reward_model(c.init_from, c.seed)
    else:  # our GPT, a GPT-2 size or a Hugging Face GPT-2 folder: all become our GPT first
        from gptforge.modeling.tokenizer import load_tokenizer

        enc = load_tokenizer(cfg.tokenizer.path)
        gpt = load_base(c.init_from, enc.n_vocab, param=f"{PARAM}.init_from")
        rm = gpt_reward_model(gpt, enc, cfg.tokenizer.path, c.seed)
    rm.model.to(rt.device)
    if c.method == "lora":  # adapters in the blocks; the new head trains whole
        torch.manual_seed(c.seed)
        head = [name for name, _ in rm.model.named_children() if name in HEADS]
        rm.model = apply_lora(rm.model, c.lora, extra_trainable=head)
    return rm


# ---------------------------------------------------------------------------------------------
# Pairs and scores


def reward_rows(pairs: Pairs, max_length: int) -> list[dict]:
    """trl's pretokenized columns: each side the prompt and its answer, cut to `max_length`; and
    `length`, the longer side's (both sides of a pair are padded together), for the sampler."""
    rows = []
    for r in pairs.rows:
        chosen = (r["prompt_ids"] + r["chosen_ids"])[:max_length]
        rejected = (r["prompt_ids"] + r["rejected_ids"])[:max_length]
        rows.append({"chosen_ids": chosen, "rejected_ids": rejected, "length": max(len(chosen), len(rejected))})
    return rows


@torch.no_grad()
def score_pairs(
    model: nn.Module, rows: Sequence[dict], pad_id: int, batch_size: int, rt: Runtime
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen, r_rejected), float64 on the CPU, of every row, from plain forward passes in eval
    mode, batched as trl's collator batches (right padding with `pad_id`); rows of similar length
    go together (less padding), the result is in the rows' order."""
    from trl.trainer.reward_trainer import DataCollatorForPreference

    collate = DataCollatorForPreference(pad_token_id=pad_id)
    order = sorted(range(len(rows)), key=lambda i: max(len(rows[i]["chosen_ids"]), len(rows[i]["rejected_ids"])))
    chosen = torch.empty(len(rows), dtype=torch.float64)
    rejected = torch.empty(len(rows), dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            batch = collate([rows[i] for i in index])
            with rt.autocast():
                logits = model(
                    input_ids=batch["input_ids"].to(rt.device), attention_mask=batch["attention_mask"].to(rt.device)
                ).logits
            r = logits.squeeze(-1).double().cpu()
            chosen[index], rejected[index] = r[: len(index)], r[len(index) :]
    finally:
        model.train(was_training)
    return chosen, rejected


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor, suffix: str = "") -> dict[str, float]:
    """val_accuracy (share with r_chosen > r_rejected), val_margin (mean difference), val_loss."""
    diff = chosen - rejected
    return {
        f"val_accuracy{suffix}": float((diff > 0).double().mean()),
        f"val_margin{suffix}": float(diff.mean()),
        f"val_loss{suffix}": float(-torch.nn.functional.logsigmoid(diff).mean()),
    }


# ---------------------------------------------------------------------------------------------
# trl


def make_trainer(
    rm: RewardModel,
    rows: dict[str, list[dict]],
    cfg: Config,
    rt: Runtime,
    output_dir: str,
    callbacks: Sequence[Any] = (),
):
    """trl's RewardTrainer over the train rows (the first `max_samples`), validating on the val rows
    every `eval_interval` steps. The rows are pretokenized (trl's `chosen_ids`/`rejected_ids`),
    already cut to max_length: trl neither tokenizes nor filters them."""
    from datasets import Dataset
    from transformers.trainer_callback import ProgressCallback
    from trl import RewardConfig, RewardTrainer

    c = cfg.reward
    train_rows = rows["train"][: c.max_samples] if c.max_samples else rows["train"]
    args = RewardConfig(
        output_dir=output_dir,
        report_to="none",
        save_strategy="no",
        seed=c.seed,
        data_seed=c.seed,
        # reward.batch_size is the whole batch: under torchrun each process takes its share
        per_device_train_batch_size=c.batch_size // rt.world_size,
        per_device_eval_batch_size=c.batch_size // rt.world_size,
        num_train_epochs=c.epochs,
        learning_rate=c.lr,
        weight_decay=c.weight_decay,
        lr_scheduler_type="constant",
        max_length=None,
        center_rewards_coefficient=c.center_rewards_coefficient,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=c.eval_interval,
        # pairs of similar lengths together: less padding (a quarter of the quickstart's tokens).
        # The sampler reads the `length` column, which trl's collator ignores: kept, since the
        # Trainer drops unused columns before it builds the sampler.
        train_sampling_strategy="group_by_length" if c.group_by_length else "random",
        length_column_name="length",
        remove_unused_columns=False,
        activation_checkpointing=c.gradient_checkpointing,  # trl's config would default it on
        bf16=rt.precision == "bf16",
        fp16=rt.precision == "fp16",
        use_cpu=rt.device.type == "cpu",
        dataloader_pin_memory=rt.device.type == "cuda",
        disable_tqdm=False,
    )
    trainer = RewardTrainer(
        model=rm.model,
        args=args,
        processing_class=rm.tokenizer,
        train_dataset=Dataset.from_list(train_rows),
        eval_dataset=Dataset.from_list(rows["val"]),
        callbacks=list(callbacks),
    )
    trainer.remove_callback(ProgressCallback)  # it prints every log dict; Records shows a bar instead
    return trainer


METRIC_NAMES = {"loss": "loss", "accuracy": "accuracy", "margin": "margin", "mean_reward": "mean_reward"}


def records_callback(run, total_steps: int):
    """The DPO stage's TrainerCallback (`trl_records.records_callback`) with trl's reward logs:
    train_loss, train_accuracy, train_margin, train_mean_reward (val_* at evaluations), a bar with
    the loss and the accuracy, and no Trainer evaluation at the last step: `train` scores every
    validation pair itself."""
    from gptforge.finetune.trl_records import records_callback as trl_records

    return trl_records(
        run, total_steps, names=METRIC_NAMES, desc="reward", shown=("acc", "train_accuracy"), last_eval=False
    )


# ---------------------------------------------------------------------------------------------
# The recipe


@dataclass
class Session:
    """What the recipe's steps hand each other."""

    rm: RewardModel
    pairs: dict[str, Pairs]
    rows: dict[str, list[dict]]
    rt: Runtime
    max_length: int
    template: str
    trainer: Any = None
    callback: Any = None
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    train_seconds: float = 0.0
    workdir: str = ""


def setup(cfg: Config, data_dir: str | os.PathLike, run=NullRun()) -> Session:
    """The pairs (read before any model loads), the reward model, the encoded and cut pairs."""
    c = cfg.reward
    rt = runtime(c.device, c.precision, param=PARAM)
    check_whole_batch(PARAM, c.batch_size, rt.world_size)
    records = {name: read_split(Path(data_dir) / f"{name}.jsonl") for name in SPLITS}
    template = c.template or cfg.instruct.template
    rm = load_reward_model(cfg, rt)
    if template == "chat" and rm.source == "gptforge":
        from gptforge.finetune.templates import chat_template_tokenizer

        chat_template_tokenizer(rm.enc)  # raises: tiktoken has no chat template
    max_length = check_max_length(c.max_length, rm.model, f"{PARAM}.max_length")
    pairs = encode_splits(records, template, rm.enc, max_length, stage="reward", param=PARAM)
    rows = {name: reward_rows(p, max_length) for name, p in pairs.items()}
    n_train, n_total = trainable_params(rm.model)
    log.info(
        "reward: a scalar head on %s (%s), %d of %d parameters train; template %s, max_length %d; %s",
        c.init_from,
        c.method,
        n_train,
        n_total,
        template,
        max_length,
        ", ".join(f"{len(p.rows)} {k}" for k, p in pairs.items()),
    )
    run.log_metrics({"trainable_params": n_train, "total_params": n_total})
    return Session(rm, pairs, rows, rt, max_length, template)


def train(s: Session, cfg: Config, run=NullRun()) -> Session:
    """Validation before, trl's epochs, validation after (every process scores every val pair)."""
    c = cfg.reward
    torch.manual_seed(c.seed)
    s.workdir = tempfile.mkdtemp(prefix="gptforge-reward-")  # trl's output_dir: nothing is saved there
    n_train = min(len(s.rows["train"]), c.max_samples or len(s.rows["train"]))
    s.callback = records_callback(run, math.ceil(n_train / c.batch_size) * c.epochs)
    s.trainer = make_trainer(s.rm, s.rows, cfg, s.rt, s.workdir, callbacks=[s.callback])
    s.before = pair_metrics(*score_pairs(s.trainer.model, s.rows["val"], s.rm.pad_id, c.batch_size, s.rt), "_before")
    s.rt.sync()
    t0 = time.perf_counter()
    s.trainer.train()
    s.rt.sync()
    s.train_seconds = time.perf_counter() - t0
    s.after = pair_metrics(*score_pairs(s.trainer.model, s.rows["val"], s.rm.pad_id, c.batch_size, s.rt))
    log.info(
        "reward: validation accuracy %.3f -> %.3f, margin %.4f -> %.4f",
        s.before["val_accuracy_before"],
        s.after["val_accuracy"],
        s.before["val_margin_before"],
        s.after["val_margin"],
    )
    return s


def save_reward_model(model: nn.Module, tokenizer, folder: str | os.PathLike) -> Path:
    """An ordinary Hugging Face sequence-classification folder (safetensors, config.json with
    num_labels 1, the label `reward` and pad_token_id, the tokenizer), written whole or not at all."""
    model.config.id2label, model.config.label2id = {0: "reward"}, {"reward": 0}
    from transformers.utils import logging as hf_logging

    model.config.use_cache = True  # training may have turned it off (gradient checkpointing)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" for one file
    try:
        with atomic_dir(folder) as tmp:
            model.save_pretrained(str(tmp), safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return Path(folder)


def finish(
    s: Session,
    cfg: Config,
    run=NullRun(),
    out_dir: str | os.PathLike = "checkpoints/reward",
    metrics_path: str | os.PathLike = "metrics/reward.json",
    plots_dir: str | os.PathLike = "plots",
) -> dict:
    """Merge LoRA, save the model, and write the curves and the metrics (process 0)."""
    import shutil

    c, out_dir, plots_dir = cfg.reward, Path(out_dir), Path(plots_dir)
    if not s.rt.master:  # under torchrun trl's trainer has kept every process's copy equal
        shutil.rmtree(s.workdir, ignore_errors=True)
        return {}
    n_train, n_total = trainable_params(s.trainer.model)
    model = merge_lora(s.trainer.model).eval()
    final = save_reward_model(model, s.rm.tokenizer, out_dir / "final")

    steps = s.trainer.state.global_step
    history = s.callback.train
    names = ("val_loss", "val_accuracy", "val_margin")
    val_history = (
        [{"step": 0, **{k: s.before[f"{k}_before"] for k in names}}]
        + s.callback.val
        + [{"step": steps, **{k: s.after[k] for k in names}}]
    )
    write_csv(plots_dir / "reward.csv", history, ["step", "train_loss", "train_accuracy", "train_margin"])
    write_csv(plots_dir / "reward_val.csv", val_history, ["step", "val_loss", "val_accuracy", "val_margin"])
    png = plot_curves(
        {
            "train (batch)": [(r["step"], r["train_margin"]) for r in history if "train_margin" in r],
            "validation (all pairs)": [(r["step"], r["val_margin"]) for r in val_history],
        },
        "reward margin (r_chosen - r_rejected)",
        plots_dir / "reward_margins.png",
    )

    train_pairs = min(len(s.rows["train"]), c.max_samples or len(s.rows["train"]))
    metrics = {
        **s.before,
        **s.after,
        "train_pairs": train_pairs,
        "val_pairs": len(s.rows["val"]),
        "skipped_too_long": sum(p.skipped_too_long for p in s.pairs.values()),
        "dropped_identical_after_truncation": sum(p.identical for p in s.pairs.values()),
        "steps": steps,
        "train_seconds": s.train_seconds,
        "pairs_per_sec": train_pairs * c.epochs / s.train_seconds if s.train_seconds > 0 else 0.0,
        "trainable_params": n_train,
        "total_params": n_total,
    }
    publish_metrics(run, metrics, metrics_path)
    for path in (plots_dir / "reward.csv", plots_dir / "reward_val.csv", png):
        if path is not None:
            run.log_artifact(path)
    run.log_artifact(final, "model")  # a sequence-classification folder: not the causal-LM flavor's
    shutil.rmtree(s.workdir, ignore_errors=True)
    log.info(
        "reward done: %d steps over %d pairs in %.1f s; validation accuracy %.3f (before %.3f), margin %.4f",
        steps,
        train_pairs,
        s.train_seconds,
        metrics["val_accuracy"],
        metrics["val_accuracy_before"],
        metrics["val_margin"],
    )
    return metrics


def train_reward(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run=NullRun(),
    data_dir: str | os.PathLike = "data/preference",
    out_dir: str | os.PathLike = "checkpoints/reward",
    metrics_path: str | os.PathLike = "metrics/reward.json",
    plots_dir: str | os.PathLike = "plots",
) -> dict:
    """The stage: set up, train, finish (each a step: a Prefect task under PrefectSteps)."""
    session = steps(setup, cfg, data_dir, run)
    session = steps(train, session, cfg, run)
    return steps(finish, session, cfg, run, out_dir, metrics_path, plots_dir)
