"""`gptforge finetune classify`: a pretrained causal LM turned into a text classifier (spam/ham).

Raschka's LLMs-from-scratch chapter 6, as a recipe: the language-model head is replaced by a
`Linear(hidden size, n_classes)` that reads the final hidden state (after the final norm) of the
*last real token* of each text. The model is causal, so that token is the only one that has seen
the whole text; right padding comes after it and cannot change it (no attention mask needed).

`classify.init_from` is our own GPT (a gptforge checkpoint, a GPT-2 size, a Hugging Face GPT-2
folder) or any other Hugging Face causal LM (Llama, Qwen, SmolLM, ...: a folder or a hub id,
`hf_causal.hf_source`), which stays a transformers model and brings its own tokenizer
(`tokenizer.path` applies to our GPT only). What trains is `classify.trainable`, the same for
both kinds:

- `head`: the new head only (a linear probe of the pretrained features);
- `last_block`: the head, the last transformer block and the final norm (Raschka's choice:
  most of the accuracy of full fine-tuning for a fraction of the gradients). The blocks are
  found by structure, not by name (`hf_causal.find_blocks`): the longest `nn.ModuleList` in the
  backbone (our `transformer.h`, Llama's and Qwen's `model.layers`), its last entry the last
  block, and the final norm the module named `norm`/`ln_f`/`final_layernorm`/`final_layer_norm`
  outside it;
- `all`: every weight;
- `lora`: peft LoRA adapters on `classify.lora.target_modules` (`auto`: every Linear inside the
  blocks), plus the head in full.

`classify.gradient_checkpointing` recomputes the blocks' activations in the backward pass.
Texts longer than `max_length` tokens keep their first `max_length` tokens (as Raschka does);
batches are right-padded with the tokenizer's end-of-text (eos) id to their longest row.

The result, `checkpoints/classify/final/`, holds the backbone with LoRA merged into its weights
plus the head: `classifier.safetensors` and `classifier.json` (n_classes, labels, max_length,
`backbone`: `gpt` or `hf`). For our GPT the backbone is a gptforge model folder
(`model.safetensors` + `config.json`, which `gptforge export` and `load_model` read); for a
Hugging Face backbone it is an ordinary Hugging Face folder of the whole causal LM and its
tokenizer (`save_pretrained`; `AutoModelForCausalLM.from_pretrained` reads it), which
`load_classifier` recognises and whose tokenizer `classify_texts` then uses.

This module is the recipe; the classifier, its folder and `classify_texts` are in `classifier.py`,
the splits, batches and scores in `classify_data.py`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptforge.config.schema import Config
from gptforge.finetune.classifier import GPTClassifier, HFClassifier, LastTokenClassifier, save_classifier
from gptforge.finetune.classify_data import (
    SPLITS,
    Example,
    binary_report,
    collate,
    encode,
    load_splits,
    predict,
    scores,
)
from gptforge.finetune.common import (
    apply_lora,
    check_max_length,
    epoch_batches,
    load_base,
    load_hf_base,
    make_optimizer,
    merge_lora,
    plot_curves,
    runtime,
    train_epochs,
    trainable_params,
)
from gptforge.finetune.distributed import Wrapped, alone, gathered, part, wrap
from gptforge.io import atomic_dir
from gptforge.modeling.hf_causal import HFTokenizer, find_blocks, hf_source
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics
from gptforge.training.runtime import Runtime

log = logging.getLogger("gptforge")


# ---------------------------------------------------------------------------------------------
# The model to train


def set_trainable(model: LastTokenClassifier, trainable: str) -> None:
    """Freeze everything, then unfreeze what `trainable` (head | last_block | all) names: for
    `last_block` the last of the backbone's blocks and its final norm (`find_blocks`).
    `lora` is set up by `apply_lora` instead (it freezes the base itself)."""
    if trainable == "all":
        model.requires_grad_(True)
        return
    model.requires_grad_(False)
    parts: list[nn.Module] = [model.head]
    if trainable == "last_block":
        blocks, norm = find_blocks(model.backbone)
        parts += [blocks[-1]] + ([norm] if norm is not None else [])
    elif trainable != "head":
        raise ValueError(f"set_trainable: unknown trainable {trainable!r}")
    for module in parts:
        module.requires_grad_(True)


def build_classifier(cfg: Config, rt: Runtime) -> tuple[nn.Module, LastTokenClassifier, Any]:
    """(model to train, the classifier inside it, tokenizer): the base model from
    `classify.init_from` with a fresh head, with `classify.trainable` applied
    (`classify.gradient_checkpointing` is applied when `train` wraps it). Our GPT comes with `tokenizer.path`'s tiktoken
    tokenizer and on the CPU; any other Hugging Face causal LM with its own tokenizer (an
    `HFTokenizer`) and on `rt.device`. For `lora` the model to train is the peft wrapper;
    otherwise both are the same module."""
    c = cfg.classify
    source = hf_source(c.init_from)
    if source is None:  # our GPT: a checkpoint, a GPT-2 size or a Hugging Face GPT-2 folder
        enc = load_tokenizer(cfg.tokenizer.path)
        backbone = load_base(c.init_from, enc.n_vocab, param="classify.init_from")
    else:  # any other causal LM, with its own tokenizer (tokenizer.path does not apply)
        backbone, tokenizer = load_hf_base(source, rt, param="classify", lora=c.trainable == "lora")
        enc = HFTokenizer(tokenizer)
    max_length = check_max_length(c.max_length, backbone, "classify.max_length")
    torch.manual_seed(c.seed)  # the head's init
    if source is None:
        classifier: LastTokenClassifier = GPTClassifier(backbone, c.n_classes, max_length=max_length)
    else:
        classifier = HFClassifier(backbone, c.n_classes, max_length=max_length, tokenizer=enc)
    if c.trainable == "lora":
        return apply_lora(classifier, c.lora, extra_trainable=["head"]), classifier, enc
    set_trainable(classifier, c.trainable)
    return classifier, classifier, enc


# ---------------------------------------------------------------------------------------------
# The recipe


@dataclass
class Session:
    """What the recipe's steps hand each other."""

    model: nn.Module  # what trains: the classifier, or its peft wrapper
    classifier: LastTokenClassifier
    data: dict[str, list[Example]]
    rt: Runtime
    pad_id: int
    history: Any = None
    wrapped: Wrapped | None = None  # the model under the strategy (finetune/distributed.py)


def setup(cfg: Config, data_dir: str | os.PathLike, run=NullRun()) -> Session:
    """Data checks, tokenizer, base model with the new head and the trainable set."""
    c = cfg.classify
    rt = runtime(c.device, c.precision, param="classify")
    records = load_splits(data_dir, c.n_classes)  # bad data fails before the model is loaded
    model, classifier, enc = build_classifier(cfg, rt)
    model.to(rt.device)
    data, cut = {}, 0
    for name, recs in records.items():
        data[name], n_cut = encode(recs, enc, classifier.max_length)
        cut += n_cut
    n_train, n_total = trainable_params(model)
    log.info(
        "classify: trainable=%s, %d of %d parameters train (%.2f%%); max_length %d (%d texts cut to it)",
        c.trainable,
        n_train,
        n_total,
        100 * n_train / n_total,
        classifier.max_length,
        cut,
    )
    run.log_metrics({"trainable_params": n_train, "total_params": n_total})
    return Session(model, classifier, data, rt, enc.eot_token)


def train(s: Session, cfg: Config, run=NullRun()) -> Session:
    """Epochs of AdamW over the trainable parameters, with periodic validation."""
    c = cfg.classify
    torch.manual_seed(c.seed)  # dropout streams
    # A Hugging Face backbone's output head is not used by the classifier: DDP must not wait for it.
    s.wrapped = w = wrap(
        s.model,
        s.rt,
        c.strategy,
        param="classify",
        activation_checkpointing=c.gradient_checkpointing,
        find_unused_parameters=True,
    )
    optimizer = make_optimizer(w.module, c.lr, c.weight_decay, s.rt.device)

    def loss_fn(batch):
        rows, factor = part(batch, s.rt, trace=True)  # this process's rows (all of them on one)
        idx, lengths, labels = collate(rows, s.pad_id, s.rt.device)
        return F.cross_entropy(w.module(idx, lengths).float(), labels) * factor

    def evaluate():
        # Fixed prefixes of the splits, comparable from one evaluation to the next; train accuracy
        # beside val accuracy shows over-fitting (Raschka's ch. 6 curves).
        logits, labels = predict(w.module, s.data["val"], c.batch_size, s.pad_id, s.rt, max_batches=c.eval_batches)
        train_logits, train_labels = predict(
            w.module, s.data["train"], c.batch_size, s.pad_id, s.rt, max_batches=c.eval_batches
        )
        return {
            **scores(logits, labels, "val"),
            "train_accuracy": scores(train_logits, train_labels, "train")["train_accuracy"],
        }

    s.history = train_epochs(
        w.module,
        optimizer,
        loss_fn,
        lambda epoch: epoch_batches(s.data["train"], c.batch_size, c.seed, epoch),
        rt=s.rt,
        epochs=c.epochs,
        eval_interval=c.eval_interval,
        evaluate=evaluate,
        run=run,
        desc="classify",
    )
    return s


def finish(
    s: Session,
    cfg: Config,
    run=NullRun(),
    out_dir: str | os.PathLike = "checkpoints/classify",
    metrics_path: str | os.PathLike = "metrics/classify.json",
    plots_dir: str | os.PathLike = "plots",
) -> dict:
    """Merge LoRA, measure the saved model on the full splits, write the model, metrics and curves."""
    c = cfg.classify
    n_train, n_total = trainable_params(s.model)  # before merging: the adapters are gone after
    trained = gathered(s.wrapped) if s.wrapped is not None else s.model  # process 0's whole model
    if trained is None:  # another process: process 0 measures and writes
        return {}
    rt = alone(s.rt)
    # What is measured is what is saved: the merged weights, not the adapters beside them.
    classifier = merge_lora(trained)
    metrics: dict[str, float] = {}
    results = {}
    for name in SPLITS:
        logits, labels = predict(classifier, s.data[name], c.batch_size, s.pad_id, rt)
        results[name] = (logits.argmax(-1).tolist(), labels.tolist())
        split_scores = scores(logits, labels, name)
        if name == "train":
            # Not train_loss: that name is the per-step curve of batch losses in the run.
            split_scores.pop("train_loss")
        metrics.update(split_scores)
    metrics.update(binary_report(*results["test"]))
    seconds = s.history.epoch_seconds
    metrics.update(
        trainable_params=n_train,
        total_params=n_total,
        seconds_per_epoch=sum(seconds) / len(seconds) if seconds else 0.0,
        steps=s.history.step,
    )

    final = Path(out_dir) / "final"
    with atomic_dir(final) as tmp:
        save_classifier(classifier, tmp, extra={"trainable": c.trainable, "init_from": c.init_from})
    publish_metrics(run, metrics, metrics_path)
    run.log_artifact(final, "checkpoint")
    run.log_text(confusion_text(*results["test"], classifier.labels), "classify_confusion.txt")
    for png in write_plots(s.history, plots_dir):
        run.log_artifact(png)
    log.info(
        "classify done: accuracy train %.3f, val %.3f, test %.3f; test precision %.3f, recall %.3f, "
        "F1 %.3f; %.1f s per epoch",
        metrics["train_accuracy"],
        metrics["val_accuracy"],
        metrics["test_accuracy"],
        metrics["precision"],
        metrics["recall"],
        metrics["f1"],
        metrics["seconds_per_epoch"],
    )
    return metrics


def confusion_text(pred: Sequence[int], gold: Sequence[int], labels: Sequence[str]) -> str:
    """The full test confusion matrix as a small table (rows: true label, columns: predicted)."""
    n = len(labels)
    counts = [[0] * n for _ in range(n)]
    for p, g in zip(pred, gold):
        counts[g][p] += 1
    width = max(8, *(len(x) for x in labels))
    lines = ["true \\ predicted".ljust(width + 8) + "".join(x.rjust(width) for x in labels)]
    lines += [labels[g].ljust(width + 8) + "".join(str(v).rjust(width) for v in row) for g, row in enumerate(counts)]
    return "\n".join(lines) + "\n"


def write_plots(history, plots_dir: str | os.PathLike) -> list[Path]:
    """classify_loss.png and classify_accuracy.png over optimizer steps."""
    plots_dir = Path(plots_dir)
    val = history.evals
    made = [
        plot_curves(
            {
                "train (batch)": history.train_loss,
                "val (first eval_batches)": [(e["step"], e["val_loss"]) for e in val],
            },
            "cross-entropy loss",
            plots_dir / "classify_loss.png",
        ),
        plot_curves(
            {
                "train (first eval_batches)": [(e["step"], e["train_accuracy"]) for e in val],
                "val (first eval_batches)": [(e["step"], e["val_accuracy"]) for e in val],
            },
            "accuracy",
            plots_dir / "classify_accuracy.png",
        ),
    ]
    return [p for p in made if p is not None]


def finetune_classify(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run=NullRun(),
    data_dir: str | os.PathLike = "data/classify",
    out_dir: str | os.PathLike = "checkpoints/classify",
    metrics_path: str | os.PathLike = "metrics/classify.json",
    plots_dir: str | os.PathLike = "plots",
) -> dict:
    """The stage: set up, train, finish (each a step: a Prefect task under PrefectSteps)."""
    session = steps(setup, cfg, data_dir, run)
    session = steps(train, session, cfg, run)
    return steps(finish, session, cfg, run, out_dir, metrics_path, plots_dir)
