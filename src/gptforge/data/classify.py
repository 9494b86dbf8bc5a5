"""`prepare classify`: the SMS Spam Collection -> balanced `{train,val,test}.jsonl` (`text`, `label`).

Follows Raschka's LLMs-from-scratch chapter 6: undersample ham to the number of spam messages
(seeded), shuffle, then cut 70/10/20 (`data.classify.splits`). Labels: ham 0, spam 1.

Accepted sources (`data.classify.source`): the UCI zip (URL or local), the `SMSSpamCollection`
file itself (no suffix, `.tsv` or `.txt`: `ham|spam<TAB>message` per line), a folder holding
it, or `.csv`/`.jsonl`/`.json`/`.parquet` records with `text` and `label` (`ham`/`spam` or 0/1).
Malformed lines are skipped and counted; above `max_bad_fraction` of them the stage refuses
the file, since that many means a wrong file rather than a few odd lines.
"""

from __future__ import annotations

import logging
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from gptforge.config.schema import Config
from gptforge.data.sources import is_hf, materialize, read_records, safe_extract_zip, shuffle_split, write_splits
from gptforge.errors import BadInput
from gptforge.io import data_suffix, open_data
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics

log = logging.getLogger("gptforge")

PARAM = "data.classify.source"
SMS_FILE = "SMSSpamCollection"
SMS_SUFFIXES = {"", ".tsv", ".txt"}
RECORD_SUFFIXES = {".csv", ".jsonl", ".json", ".parquet"}
LABELS = {"ham": 0, "spam": 1}
CLASS_NAMES = {v: k for k, v in LABELS.items()}


@dataclass
class Labelled:
    """Examples read from a file, and what was skipped on the way."""

    examples: list[dict] = field(default_factory=list)  # {"text": str, "label": 0 | 1}
    total: int = 0  # non-blank lines (or records) seen
    bad: int = 0
    first_bad: int | None = None  # 1-based line (or record) number
    unit: str = "line"

    def skip(self, number: int) -> None:
        self.bad += 1
        if self.first_bad is None:
            self.first_bad = number


def prepare_classify(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    out_dir: str | os.PathLike = "data/classify",
    metrics_path: str | os.PathLike = "metrics/prepare_classify.json",
    raw_dir: str | os.PathLike = "data/raw",
) -> dict:
    c = cfg.data.classify
    if is_hf(c.source):
        raise BadInput(
            f"{PARAM}: hub datasets are not supported here, got {c.source}; "
            "use the UCI zip URL or a local SMSSpamCollection, .csv or .jsonl file"
        )
    path = materialize(c.source, param=PARAM, sha256=c.sha256, download=cfg.data.download, steps=steps, raw_dir=raw_dir)
    path = steps(find_sms_file, path, raw_dir=raw_dir)
    labelled = steps(read_labelled, path)
    check_labelled(labelled, path, max_bad_fraction=c.max_bad_fraction)
    splits = steps(balance_and_split, labelled.examples, fractions=c.splits, balance=c.balance, seed=c.seed)
    steps(write_splits, splits, out_dir)

    metrics: dict[str, int] = {"total_lines": labelled.total, "bad_lines": labelled.bad}
    for name, examples in splits.items():
        counts = Counter(e["label"] for e in examples)
        metrics[f"{name}_ham"] = counts[0]
        metrics[f"{name}_spam"] = counts[1]
    metrics.update({name: len(examples) for name, examples in splits.items()})
    publish_metrics(run, metrics, metrics_path)
    log.info(
        "classify data: %d train, %d val, %d test -> %s", metrics["train"], metrics["val"], metrics["test"], out_dir
    )
    return metrics


def find_sms_file(path: str | os.PathLike, *, raw_dir: str | os.PathLike = "data/raw") -> Path:
    """The file to read: a zip is extracted under `raw_dir` first, a folder searched."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".zip":
        folder = Path(raw_dir) / (path.stem + ".extracted")
        files = safe_extract_zip(path, folder)
        return _sms_in(files, path)
    if path.is_dir():
        return _sms_in([p for p in path.rglob("*") if p.is_file()], path)
    suffix = data_suffix(path)
    if suffix not in SMS_SUFFIXES | RECORD_SUFFIXES:
        raise BadInput(
            f"{PARAM} {path}: unsupported file type {suffix!r}; expected the UCI zip, "
            f"{SMS_FILE} (.tsv/.txt), .csv, .jsonl, .json or .parquet"
        )
    return path


def _sms_in(files: list[Path], where: Path) -> Path:
    found = sorted(p for p in files if p.name in (SMS_FILE, SMS_FILE + ".gz"))
    if not found:
        names = ", ".join(sorted(p.name for p in files)[:10]) or "nothing"
        raise BadInput(f"{PARAM} {where}: no {SMS_FILE} file in it (found: {names})")
    return found[0]


def read_labelled(path: str | os.PathLike) -> Labelled:
    path = Path(path)
    if data_suffix(path) in RECORD_SUFFIXES:
        return labelled_records(read_records(path, param=PARAM))
    return read_sms(path)


def read_sms(path: str | os.PathLike) -> Labelled:
    """UCI format: `ham` or `spam`, a TAB, the message; one message per line (gzip: `.gz`)."""
    out = Labelled(unit="line")
    try:
        with open_data(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                line = _decode(raw).rstrip("\r\n")
                if not line.strip():
                    continue  # blank lines (a trailing newline) are not messages
                out.total += 1
                label, tab, text = line.partition("\t")
                if not tab or label.strip() not in LABELS or not text.strip():
                    out.skip(number)
                    continue
                out.examples.append({"text": text, "label": LABELS[label.strip()]})
    except (OSError, EOFError) as e:  # a damaged .gz (gzip.BadGzipFile is an OSError)
        raise BadInput(f"{PARAM} {path}: cannot read it ({' '.join(str(e).split())})") from None
    return out


def _decode(raw: bytes) -> str:
    # The UCI file is UTF-8 except for a few Latin-1 lines: decide per line, not per file.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def labelled_records(records: Sequence[Any]) -> Labelled:
    """`text` + `label` records (`ham`/`spam`, 0/1 or "0"/"1"); anything else is malformed."""
    out = Labelled(unit="record")
    for number, record in enumerate(records, 1):
        out.total += 1
        text = record.get("text") if isinstance(record, dict) else None
        label = parse_label(record.get("label")) if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip() or label is None:
            out.skip(number)
            continue
        out.examples.append({"text": text, "label": label})
    return out


def parse_label(value: Any) -> int | None:
    if isinstance(value, bool):  # True == 1 in Python, but a boolean is not a class label
        return None
    if isinstance(value, (int, float)) and value in (0, 1):
        return int(value)
    if isinstance(value, str):
        value = value.strip().lower()
        return LABELS.get(value, {"0": 0, "1": 1}.get(value))
    return None


def check_labelled(labelled: Labelled, path: str | os.PathLike, *, max_bad_fraction: float) -> None:
    unit = labelled.unit
    if labelled.total == 0:
        raise BadInput(f"{PARAM} {path}: no {unit}s to read (empty file)")
    fraction = labelled.bad / labelled.total
    if fraction > max_bad_fraction:
        expected = (
            "'ham' or 'spam', a TAB, then the message"
            if unit == "line"
            else "a non-empty 'text' and a 'label' of ham/spam or 0/1"
        )
        raise BadInput(
            f"{labelled.bad} of {labelled.total} {unit}s malformed ({fraction:.1%}) in {path}, above "
            f"data.classify.max_bad_fraction={max_bad_fraction:g} (first bad {unit}: {labelled.first_bad}; "
            f"expected {expected})"
        )
    if labelled.bad:
        log.warning(
            "skipped %d malformed %ss of %d in %s (first: %s %d)",
            labelled.bad,
            unit,
            labelled.total,
            path,
            unit,
            labelled.first_bad,
        )
    counts = Counter(e["label"] for e in labelled.examples)
    if len(counts) < 2:
        only = ", ".join(f"{CLASS_NAMES[k]} ({n})" for k, n in counts.items()) or "none"
        raise BadInput(f"{PARAM} {path}: needs both ham and spam examples, found only {only}")


def balance_and_split(
    examples: Sequence[dict], *, fractions: Sequence[float], balance: bool, seed: int
) -> dict[str, list[dict]]:
    """Undersample the majority class to the minority's size (seeded), then shuffle and split."""
    if balance:
        by_label: dict[int, list[dict]] = {0: [], 1: []}
        for e in examples:
            by_label[e["label"]].append(e)
        minority, majority = sorted(by_label.values(), key=len)
        examples = random.Random(seed).sample(majority, len(minority)) + minority
    splits = shuffle_split(examples, fractions, seed)
    if not splits["train"]:
        raise BadInput(f"{PARAM}: {len(examples)} examples are too few for data.classify.splits={list(fractions)}")
    for name in ("val", "test"):
        if not splits[name]:
            log.warning("classify data: the %s split is empty (%d examples in all)", name, len(examples))
    return splits
