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
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file as _load_safetensors
from safetensors.torch import save as _safetensors_bytes

from gptforge.config.schema import Config
from gptforge.data.sources import read_records
from gptforge.errors import BadInput
from gptforge.finetune.common import (apply_lora, check_max_length, enable_gradient_checkpointing, epoch_batches,
                                      load_base, load_hf_base, make_optimizer, merge_lora, model_positions,
                                      plot_curves, runtime, train_epochs, trainable_params)
from gptforge.finetune.distributed import Wrapped, alone, gather_rows, gathered, part, wrap
from gptforge.finetune.hf_models import save_hf_model
from gptforge.io import atomic_dir, atomic_file, write_json
from gptforge.modeling.gpt import GPT
from gptforge.modeling.hf_causal import HFTokenizer, find_blocks, hf_source, load_causal_lm
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.modeling.weights import load_model, save_model
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics
from gptforge.training.loop import Runtime

log = logging.getLogger("gptforge")

SPLITS = ("train", "val", "test")
HEAD_FILE = "classifier.safetensors"
HEAD_CONFIG = "classifier.json"
BINARY_LABELS = ["ham", "spam"]  # data/classify's labels 0 and 1
POSITIVE = 1  # precision/recall/F1 are for "spam"


# ---------------------------------------------------------------------------------------------
# The model


class LastTokenClassifier(nn.Module):
    """A causal backbone and a linear head on the final hidden state of each row's last real token.

    `forward(idx, lengths)`: idx (B, T) token ids right-padded to T, lengths (B,) the real
    token counts (>= 1) -> logits (B, n_classes). The index comes from the lengths, not from
    looking for the padding id, which a text may contain. Subclasses hold the backbone (as
    `backbone`) and say how to read its hidden states (`hidden_states(idx)` -> (B, T, C), after
    the final norm); `tokenizer` is the tokenizer the classifier must be used with when it
    brings its own (a Hugging Face model's `HFTokenizer`), None when the caller's is the one.
    """

    tokenizer: Any = None

    def _add_head(self, hidden_size: int, n_classes: int, labels: Sequence[str] | None, max_length: int) -> None:
        self.head = nn.Linear(hidden_size, n_classes)
        self.n_classes = n_classes
        self.labels = list(labels) if labels is not None else default_labels(n_classes)
        self.max_length = max_length

    @property
    def backbone(self) -> nn.Module:
        raise NotImplementedError

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden_states(idx)  # (B, T, C)
        last = hidden[torch.arange(idx.size(0), device=idx.device), lengths.to(idx.device) - 1]
        # The head only ever sees B vectors, never B*T: a (B, T, n_classes) output would be
        # wasted work for every position but one. A bf16 backbone (LoRA on CUDA) still feeds
        # the float32 head outside autocast.
        return self.head(last.to(self.head.weight.dtype))


class GPTClassifier(LastTokenClassifier):
    """The classifier on our own GPT (`self.gpt`). The backbone's own `lm_head` stays (tied to
    the embedding, unused here) so the backbone remains a plain GPT that `save_model` writes and
    `load_model` reads."""

    def __init__(self, gpt: GPT, n_classes: int, labels: Sequence[str] | None = None, max_length: int | None = None):
        super().__init__()
        self.gpt = gpt
        self._add_head(gpt.config.n_embd, n_classes, labels, max_length if max_length is not None
                       else gpt.config.block_size)

    @property
    def backbone(self) -> nn.Module:
        return self.gpt

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt.hidden_states(idx)


class HFClassifier(LastTokenClassifier):
    """The classifier on a Hugging Face causal LM (`self.lm`: LlamaForCausalLM, Qwen2ForCausalLM,
    ...), with the model's own tokenizer (`tokenizer`, an `HFTokenizer`). The hidden states come
    from its decoder (`get_decoder()`: the LlamaModel inside, whose `last_hidden_state` is after
    the final norm), so the vocabulary logits are never computed; the LM head stays, unused, so
    the backbone is saved as an ordinary causal LM."""

    def __init__(self, lm: nn.Module, n_classes: int, labels: Sequence[str] | None = None,
                 max_length: int | None = None, tokenizer: HFTokenizer | None = None):
        super().__init__()
        self.lm = lm
        self._add_head(lm.config.hidden_size, n_classes, labels,
                       max_length if max_length is not None else model_positions(lm))
        self.tokenizer = tokenizer

    @property
    def backbone(self) -> nn.Module:
        return self.lm

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        # Right padding needs no attention mask (causal); no cache in a classifier.
        return self.lm.get_decoder()(input_ids=idx, use_cache=False).last_hidden_state


def default_labels(n_classes: int) -> list[str]:
    return list(BINARY_LABELS) if n_classes == 2 else [str(i) for i in range(n_classes)]


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
    `classify.init_from` with a fresh head, with `classify.trainable` and
    `classify.gradient_checkpointing` applied. Our GPT comes with `tokenizer.path`'s tiktoken
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
    if c.gradient_checkpointing:
        enable_gradient_checkpointing(backbone)
    if c.trainable == "lora":
        return apply_lora(classifier, c.lora, extra_trainable=["head"]), classifier, enc
    set_trainable(classifier, c.trainable)
    return classifier, classifier, enc


# ---------------------------------------------------------------------------------------------
# Data


@dataclass
class Example:
    tokens: list[int]  # 1..max_length ids
    label: int


def read_split(path: str | os.PathLike, n_classes: int) -> list[dict]:
    """The {"text", "label"} records of one jsonl split. BadInput naming the file (and the
    record: its line, in the files `prepare classify` writes) when the file is missing or empty,
    a line is not such a record, or a label is outside [0, n_classes)."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"classify data: {path} not found; run `gptforge prepare classify` first")
    records = []
    for number, rec in enumerate(read_records(path, param="classify data"), 1):
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise BadInput(f"{path}: record {number}: expected an object with a string \"text\" and a \"label\"")
        label = rec.get("label")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < n_classes:
            raise BadInput(f"{path}: record {number}: label {label!r} is outside [0, {n_classes}) "
                           f"(classify.n_classes = {n_classes})")
        records.append({"text": rec["text"], "label": label})
    if not records:
        raise BadInput(f"classify data: {path} has no examples (the {path.stem} split is empty)")
    return records


def load_splits(data_dir: str | os.PathLike, n_classes: int) -> dict[str, list[dict]]:
    """train, val and test records from `data_dir` (see read_split for the checks)."""
    splits = {name: read_split(Path(data_dir) / f"{name}.jsonl", n_classes) for name in SPLITS}
    log.info("classify data: %s", ", ".join(f"{len(v)} {k}" for k, v in splits.items()))
    return splits


def encode(records: list[dict], enc, max_length: int) -> tuple[list[Example], int]:
    """(examples, how many texts were cut). A text keeps its first `max_length` token ids; an
    empty text becomes the end-of-text token alone, so every row has a last token to read."""
    examples, cut = [], 0
    for r in records:
        ids = enc.encode_ordinary(r["text"])
        cut += len(ids) > max_length
        examples.append(Example(ids[:max_length] or [enc.eot_token], r["label"]))
    return examples, cut


def collate(examples: Sequence[Example], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(idx (B, T), lengths (B,), labels (B,)) with rows right-padded with `pad_id` to the
    batch's longest row: shorter padding than the dataset's longest, the same logits."""
    lengths = [len(e.tokens) for e in examples]
    idx = torch.full((len(examples), max(lengths)), pad_id, dtype=torch.long)
    for i, e in enumerate(examples):
        idx[i, : len(e.tokens)] = torch.tensor(e.tokens, dtype=torch.long)
    labels = torch.tensor([e.label for e in examples], dtype=torch.long)
    return idx.to(device), torch.tensor(lengths, device=device), labels.to(device)


def batches(examples: Sequence[Example], batch_size: int) -> list[list[Example]]:
    return [list(examples[i:i + batch_size]) for i in range(0, len(examples), batch_size)]


# ---------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def predict(model: nn.Module, examples: Sequence[Example], batch_size: int, pad_id: int, rt: Runtime,
            max_batches: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (N, n_classes) float32 on the CPU, labels (N,)) over `examples` in order (the first
    `max_batches` batches only, when given); eval mode, autocast, then back to the old mode.
    Under torchrun (`rt.world_size` > 1, `model` the wrapped classifier) each process scores its
    part of every batch and all get every row, grouped by process."""
    was_training = model.training
    model.eval()
    out, gold = [], []
    try:
        for i, batch in enumerate(batches(examples, batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            rows, factor = part(batch, rt)
            idx, lengths, labels = collate(rows, pad_id, rt.device)
            with rt.autocast():
                logits = model(idx, lengths)
            if factor:
                out.append(logits.float().cpu())
                gold.append(labels.cpu())
    finally:
        model.train(was_training)
    return gather_rows(_cat(out, torch.float32), rt), gather_rows(_cat(gold, torch.long), rt)


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """torch.cat, or an empty tensor of `dtype` that torch.cat skips (a process with no rows)."""
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)


def scores(logits: torch.Tensor, labels: torch.Tensor, prefix: str) -> dict[str, float]:
    return {f"{prefix}_loss": F.cross_entropy(logits, labels).item(),
            f"{prefix}_accuracy": (logits.argmax(-1) == labels).float().mean().item()}


def binary_report(pred: Sequence[int], gold: Sequence[int], positive: int = POSITIVE) -> dict[str, float]:
    """Counts and precision/recall/F1 of `positive` against every other class (for two classes,
    the usual confusion matrix). An empty denominator gives 0, not NaN: metrics files hold
    numbers, and 0 is what "no positive predictions" is worth."""
    tp = sum(p == positive and g == positive for p, g in zip(pred, gold))
    fp = sum(p == positive and g != positive for p, g in zip(pred, gold))
    fn = sum(p != positive and g == positive for p, g in zip(pred, gold))
    tn = len(gold) - tp - fp - fn
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1,
            "test_tp": tp, "test_fp": fp, "test_tn": tn, "test_fn": fn}


# ---------------------------------------------------------------------------------------------
# Saving and loading the result


def save_classifier(classifier: LastTokenClassifier, folder: str | os.PathLike,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write the backbone and the head (classifier.safetensors + classifier.json) into `folder`.
    Our GPT's backbone as `save_model` writes it (model.safetensors + config.json); a Hugging
    Face backbone as an ordinary Hugging Face folder of the causal LM and its tokenizer
    (`save_hf_model`: safetensors, config.json, generation_config.json, tokenizer files)."""
    folder = Path(folder)
    if isinstance(classifier, HFClassifier):
        save_hf_model(classifier.lm, classifier.tokenizer.tokenizer, folder)
        backbone = "hf"
    else:
        save_model(classifier.gpt, folder)
        backbone = "gpt"
    head = {k: v.detach().contiguous().cpu() for k, v in classifier.head.state_dict().items()}
    with atomic_file(folder / HEAD_FILE, "wb") as f:
        f.write(_safetensors_bytes(head, metadata={"format": "pt"}))
    write_json(folder / HEAD_CONFIG, {"n_classes": classifier.n_classes, "labels": classifier.labels,
                                      "max_length": classifier.max_length, "backbone": backbone, **(extra or {})})
    return folder


def load_classifier(folder: str | os.PathLike, map_location="cpu") -> LastTokenClassifier:
    """The classifier in a folder written by the recipe (eval mode): a GPTClassifier, or an
    HFClassifier (float32, with the folder's own tokenizer as `tokenizer`) when the folder is a
    Hugging Face causal-LM folder (`hf_source`). Any problem is a one-line BadInput naming the
    file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"classifier folder not found: {folder} (run `gptforge finetune classify` first)")
    meta_path, head_path = folder / HEAD_CONFIG, folder / HEAD_FILE
    for path in (meta_path, head_path):
        if not path.is_file():
            raise BadInput(f"{path}: not found (a classifier folder holds {HEAD_FILE} and {HEAD_CONFIG} "
                           "beside the model)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        n_classes, labels, max_length = int(meta["n_classes"]), list(meta["labels"]), int(meta["max_length"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{meta_path}: not a classifier description ({type(e).__name__}: {e})") from None
    if len(labels) != n_classes:
        raise BadInput(f"{meta_path}: {len(labels)} labels for {n_classes} classes")
    if hf_source(str(folder)) is not None:
        # float32 whatever the saved dtype (transformers 5 loads the saved one by default):
        # classify_texts runs without autocast, where exact probabilities matter.
        lm, tokenizer = load_causal_lm(str(folder), param="classifier", dtype=torch.float32)
        classifier: LastTokenClassifier = HFClassifier(lm, n_classes, labels, max_length,
                                                       tokenizer=HFTokenizer(tokenizer))
    else:
        if meta.get("backbone", "gpt") != "gpt":
            raise BadInput(f"{meta_path}: the backbone is a {meta['backbone']!r} model, but {folder / 'config.json'} "
                           "is not a Hugging Face causal LM's config")
        classifier = GPTClassifier(load_model(folder, map_location=map_location), n_classes, labels, max_length)
    positions = model_positions(classifier.backbone)
    if max_length > positions:
        raise BadInput(f"{meta_path}: max_length ({max_length}) is above the model's {positions} positions")
    classifier.to(map_location)
    try:
        head = _load_safetensors(str(head_path), device=str(map_location))
        classifier.head.load_state_dict(head, strict=True)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise BadInput(f"{head_path}: not this classifier's head ({' '.join(str(e).split())[:200]})") from None
    return classifier.eval()


@torch.no_grad()
@torch.no_grad()
def class_probabilities(classifier: LastTokenClassifier, texts: Sequence[str], enc, device="cpu",
                        batch_size: int = 32) -> torch.Tensor:
    """(N, n_classes) softmax probabilities of every class for each text, in order, in fp32 (a
    few texts, where exact probabilities matter more than speed); texts are cut to the
    classifier's max_length tokens as in training. A classifier that brings its own tokenizer
    (`classifier.tokenizer`: a Hugging Face backbone's) is used with it, and `enc` is ignored."""
    if getattr(classifier, "tokenizer", None) is not None:
        enc = classifier.tokenizer
    examples, _ = encode([{"text": t, "label": 0} for t in texts], enc, classifier.max_length)
    if not examples:
        return torch.zeros(0, classifier.n_classes)
    logits, _ = predict(classifier, examples, batch_size, enc.eot_token, Runtime(device=torch.device(device)))
    return logits.softmax(-1)


def classify_texts(classifier: LastTokenClassifier, texts: Sequence[str], enc, device, batch_size: int = 32
                   ) -> list[tuple[int, float]]:
    """(label index, its softmax probability) for each text, in order (`class_probabilities`)."""
    probs = class_probabilities(classifier, texts, enc, device, batch_size)
    best = probs.argmax(-1)
    return [(int(i), float(probs[row, i])) for row, i in enumerate(best)]


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
    log.info("classify: trainable=%s, %d of %d parameters train (%.2f%%); max_length %d (%d texts cut to it)",
             c.trainable, n_train, n_total, 100 * n_train / n_total, classifier.max_length, cut)
    run.log_metrics({"trainable_params": n_train, "total_params": n_total})
    return Session(model, classifier, data, rt, enc.eot_token)


def train(s: Session, cfg: Config, run=NullRun()) -> Session:
    """Epochs of AdamW over the trainable parameters, with periodic validation."""
    c = cfg.classify
    torch.manual_seed(c.seed)  # dropout streams
    # A Hugging Face backbone's output head is not used by the classifier: DDP must not wait for it.
    s.wrapped = w = wrap(s.model, s.rt, c.strategy, param="classify", find_unused_parameters=True)
    optimizer = make_optimizer(w.module, c.lr, c.weight_decay, s.rt.device)

    def loss_fn(batch):
        rows, factor = part(batch, s.rt, trace=True)  # this process's rows (all of them on one)
        idx, lengths, labels = collate(rows, s.pad_id, s.rt.device)
        return F.cross_entropy(w.module(idx, lengths).float(), labels) * factor

    def evaluate():
        # Fixed prefixes of the splits, comparable from one evaluation to the next; train accuracy
        # beside val accuracy shows over-fitting (Raschka's ch. 6 curves).
        logits, labels = predict(w.module, s.data["val"], c.batch_size, s.pad_id, s.rt, max_batches=c.eval_batches)
        train_logits, train_labels = predict(w.module, s.data["train"], c.batch_size, s.pad_id, s.rt,
                                             max_batches=c.eval_batches)
        return {**scores(logits, labels, "val"),
                "train_accuracy": scores(train_logits, train_labels, "train")["train_accuracy"]}

    s.history = train_epochs(
        w.module, optimizer, loss_fn, lambda epoch: epoch_batches(s.data["train"], c.batch_size, c.seed, epoch),
        rt=s.rt, epochs=c.epochs, eval_interval=c.eval_interval, evaluate=evaluate, run=run, desc="classify")
    return s


def finish(s: Session, cfg: Config, run=NullRun(), out_dir: str | os.PathLike = "checkpoints/classify",
           metrics_path: str | os.PathLike = "metrics/classify.json",
           plots_dir: str | os.PathLike = "plots") -> dict:
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
    metrics.update(trainable_params=n_train, total_params=n_total,
                   seconds_per_epoch=sum(seconds) / len(seconds) if seconds else 0.0, steps=s.history.step)

    final = Path(out_dir) / "final"
    with atomic_dir(final) as tmp:
        save_classifier(classifier, tmp, extra={"trainable": c.trainable, "init_from": c.init_from})
    publish_metrics(run, metrics, metrics_path)
    run.log_artifact(final, "checkpoint")
    run.log_text(confusion_text(*results["test"], classifier.labels), "classify_confusion.txt")
    for png in write_plots(s.history, plots_dir):
        run.log_artifact(png)
    log.info("classify done: accuracy train %.3f, val %.3f, test %.3f; test precision %.3f, recall %.3f, "
             "F1 %.3f; %.1f s per epoch", metrics["train_accuracy"], metrics["val_accuracy"],
             metrics["test_accuracy"], metrics["precision"], metrics["recall"], metrics["f1"],
             metrics["seconds_per_epoch"])
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
        plot_curves({"train (batch)": history.train_loss,
                     "val (first eval_batches)": [(e["step"], e["val_loss"]) for e in val]},
                    "cross-entropy loss", plots_dir / "classify_loss.png"),
        plot_curves({"train (first eval_batches)": [(e["step"], e["train_accuracy"]) for e in val],
                     "val (first eval_batches)": [(e["step"], e["val_accuracy"]) for e in val]},
                    "accuracy", plots_dir / "classify_accuracy.png"),
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
