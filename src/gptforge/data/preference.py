"""`prepare preference`: preference pairs -> `{train,val,test}.jsonl` (`instruction`, `input`, `chosen`, `rejected`).

The stage reads a preference source (`data.preference.source`), brings each record to one form
and writes seeded train/val/test splits for preference tuning (DPO). Two formats are accepted,
detected per record:

- LLMs-from-scratch chapter 7 (`instruction`, `input`, `output`, `chosen`, `rejected`, all
  strings; a missing or null `input` means "" and `output` is ignored), as in the embedded
  `sample://instruction-data-with-preference.json.gz`;
- Hugging Face (`prompt`, `chosen`, `rejected`), as in `hf://HuggingFaceH4/ultrafeedback_binarized`
  (split `data.preference.split`): `prompt` is a string (or a one-message user list), `chosen`
  and `rejected` are strings or the whole conversation as a message list, of which exactly one
  user turn then one assistant turn is supported; the assistant's content is kept, and the
  extra keys (prompt_id, messages, scores) are dropped.

It is a stage of its own, not part of `prepare instruct`: the preference source changes without
re-running the instruction data stage and the SFT that depends on it, and the two datasets
usually differ (UltraFeedback against Alpaca). Records that are malformed (`invalid`), whose
chosen and rejected answers are the same (`identical`) or that have a blank instruction or
answer (`dropped_empty`) are dropped and counted; above `data.preference.max_bad_fraction` of
them the stage refuses the source, since that many means a wrong file rather than a few odd
records, and writes nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from gptforge.config.schema import Config
from gptforge.data.sources import shuffle_split, source_records, write_splits
from gptforge.errors import BadInput
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics

log = logging.getLogger("gptforge")

PARAM = "data.preference.source"
FIELDS = ("instruction", "input", "chosen", "rejected")
TURNS = "one user turn and one assistant turn are supported"

# What each kind of dropped record is called in messages, in the order they are reported.
KINDS = {
    "invalid": "invalid",
    "identical": "with identical chosen and rejected",
    "dropped_empty": "with a blank instruction, chosen or rejected",
}


class Unusable(ValueError):
    """Why one record cannot be used (the message names the field)."""


@dataclass
class Validated:
    records: list[dict] = field(default_factory=list)
    total: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    first: dict[str, tuple[int, str]] = field(default_factory=dict)  # kind -> (record number, reason)

    @property
    def bad(self) -> int:
        return sum(self.counts.values())

    def drop(self, kind: str, number: int, reason: str) -> None:
        self.counts[kind] += 1
        self.first.setdefault(kind, (number, reason))


def prepare_preference(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    out_dir: str | os.PathLike = "data/preference",
    metrics_path: str | os.PathLike = "metrics/prepare_preference.json",
    raw_dir: str | os.PathLike = "data/raw",
) -> dict:
    d = cfg.data.preference
    records = source_records(
        d.source, param=PARAM, split=d.split, sha256=d.sha256, download=cfg.data.download, steps=steps, raw_dir=raw_dir
    )
    validated = steps(validate_records, records, where=f"{PARAM} {d.source}", max_bad_fraction=d.max_bad_fraction)
    splits = steps(shuffle_split, validated.records, d.splits, d.seed)
    steps(write_splits, splits, out_dir)

    metrics = {"records": validated.total, **validated.counts, **{name: len(items) for name, items in splits.items()}}
    publish_metrics(run, metrics, metrics_path)
    log.info(
        "preference data: %d train, %d val, %d test -> %s", metrics["train"], metrics["val"], metrics["test"], out_dir
    )
    return metrics


def validate_records(records: Sequence[Any], *, where: str, max_bad_fraction: float) -> Validated:
    """Normalized `instruction`, `input`, `chosen`, `rejected` records; the unusable ones are
    counted by kind and dropped, or the whole source refused when there are too many.

    Messages count records from 1, as lines are counted (in a .jsonl file they are the same).
    """
    out = Validated(total=len(records))
    if not records:
        raise BadInput(f"{where}: no records")
    for number, record in enumerate(records, 1):
        try:
            pair = normalize(record)
        except Unusable as e:
            out.drop("invalid", number, str(e))
            continue
        blank = next((k for k in ("instruction", "chosen", "rejected") if not pair[k].strip()), None)
        if blank is not None:
            out.drop("dropped_empty", number, f"blank '{blank}'")
        elif pair["chosen"].strip() == pair["rejected"].strip():
            out.drop("identical", number, "chosen and rejected are identical")
        else:
            out.records.append(pair)

    if out.bad and out.bad / out.total > max_bad_fraction:
        parts = ", ".join(f"{n} {KINDS[kind]}" for kind, n in out.counts.items() if n)
        number, reason = min(out.first.values())
        raise BadInput(
            f"{where}: {out.bad} of {out.total} records are unusable ({parts}; first: record {number}: "
            f"{reason}); at most data.preference.max_bad_fraction={max_bad_fraction:g} may be"
        )
    for kind, n in out.counts.items():
        if n:
            number, reason = out.first[kind]
            what = f"record{'' if n == 1 else 's'}"
            what = f"invalid {what}" if kind == "invalid" else f"{what} {KINDS[kind]}"
            log.warning("%s: dropped %d %s of %d (first: record %d: %s)", where, n, what, out.total, number, reason)
    if not out.records:
        raise BadInput(f"{where}: no records left after dropping {out.bad} unusable ones")
    return out


def normalize(record: Any) -> dict:
    """One record in either format -> `{instruction, input, chosen, rejected}`; raises `Unusable`."""
    if not isinstance(record, dict):
        raise Unusable(f"a {type(record).__name__}, expected an object")
    if "instruction" in record:  # LLMs-from-scratch ch. 7
        instruction = record["instruction"]
        if not isinstance(instruction, str):
            raise Unusable(f"'instruction' is {type(instruction).__name__}, expected a string")
        value = record.get("input")
        if value is not None and not isinstance(value, str):
            raise Unusable(f"'input' is {type(value).__name__}, expected a string")
        text = value or ""
    elif "prompt" in record:  # Hugging Face
        instruction, text = _prompt(record["prompt"]), ""
    else:
        raise Unusable("no 'instruction' or 'prompt'")
    chosen, rejected = _answer(record, "chosen"), _answer(record, "rejected")
    return {"instruction": instruction, "input": text, "chosen": chosen, "rejected": rejected}


def _prompt(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        roles = _roles(value, "prompt")
        if roles != ["user"]:
            raise Unusable(f"prompt is {_described(roles)}; one user message is supported")
        return _content(value[0], "prompt")
    raise Unusable(f"'prompt' is {type(value).__name__}, expected a string or a list with one user message")


def _answer(record: dict, key: str) -> str:
    """`chosen`/`rejected`: a string, or [user, assistant] messages -> the assistant's content."""
    if key not in record:
        raise Unusable(f"no '{key}'")
    value = record[key]
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        roles = _roles(value, key)
        if roles != ["user", "assistant"]:
            raise Unusable(f"{key} is {_described(roles)}; {TURNS}")
        return _content(value[1], key)
    raise Unusable(f"'{key}' is {type(value).__name__}, expected a string or a list of messages")


def _roles(messages: list, key: str) -> list[Any]:
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise Unusable(f"{key} message {i} is not an object with 'role' and 'content'")
    return [m["role"] for m in messages]


def _described(roles: list[Any]) -> str:
    if len(roles) == 2:
        return f"a conversation of {' then '.join(map(str, roles))}"
    return f"a {len(roles)}-message conversation"


def _content(message: dict, key: str) -> str:
    content = message["content"]
    if not isinstance(content, str):
        raise Unusable(f"{key} {message['role']} content is {type(content).__name__}, expected a string")
    return content
