"""The classify stage's examples and their scores: the jsonl splits read and checked, texts
encoded (cut to `max_length`) into right-padded batches, and a classifier's logits over them
(`predict`) scored: loss and accuracy, precision/recall/F1 of the positive class."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptforge.data.sources import read_records
from gptforge.errors import BadInput
from gptforge.finetune.distributed import gather_rows, part
from gptforge.training.runtime import Runtime

log = logging.getLogger("gptforge")

SPLITS = ("train", "val", "test")
POSITIVE = 1  # precision/recall/F1 are for "spam"


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
            raise BadInput(f'{path}: record {number}: expected an object with a string "text" and a "label"')
        label = rec.get("label")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < n_classes:
            raise BadInput(
                f"{path}: record {number}: label {label!r} is outside [0, {n_classes}) "
                f"(classify.n_classes = {n_classes})"
            )
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
    return [list(examples[i : i + batch_size]) for i in range(0, len(examples), batch_size)]


# ---------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def predict(
    model: nn.Module,
    examples: Sequence[Example],
    batch_size: int,
    pad_id: int,
    rt: Runtime,
    max_batches: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    return {
        f"{prefix}_loss": F.cross_entropy(logits, labels).item(),
        f"{prefix}_accuracy": (logits.argmax(-1) == labels).float().mean().item(),
    }


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
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "test_tp": tp,
        "test_fp": fp,
        "test_tn": tn,
        "test_fn": fn,
    }
