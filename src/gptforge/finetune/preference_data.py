"""Preference pairs: a split of `gptforge prepare preference`'s records read and checked, and its
pairs encoded as the instruct stage encodes a record (`templates.encode`), with the pairs that
cannot train dropped and counted. Shared by the DPO stage (preference.py) and the reward-model
stage (reward.py)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from gptforge.data.sources import read_records
from gptforge.errors import BadInput
from gptforge.finetune.templates import Example, encode

log = logging.getLogger("gptforge")


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
        if not (
            isinstance(rec, dict)
            and all(isinstance(rec.get(k), str) for k in ("instruction", "chosen", "rejected"))
            and isinstance(rec.get("input") or "", str)
        ):
            raise BadInput(
                f'preference data: {path} record {number} is not an object with string "instruction", '
                '"chosen" and "rejected"'
            )
        records.append(
            {
                "instruction": rec["instruction"],
                "input": rec.get("input") or "",
                "chosen": rec["chosen"],
                "rejected": rec["rejected"],
            }
        )
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
            out.rows.append(
                {
                    "prompt_ids": prompt,
                    "chosen_ids": chosen,
                    "rejected_ids": rejected,
                    "length": len(prompt) + max(len(chosen), len(rejected)),
                }
            )
            out.kept.append(i)
    return out


def encode_splits(
    records: dict[str, Sequence[dict]], template: str, enc, max_length: int, *, stage: str, param: str
) -> dict[str, Pairs]:
    """`encode_pairs` for every split: BadInput when a split keeps no pair at `param`.max_length,
    a warning (naming `stage`) for the pairs dropped. Shared by the DPO and reward-model stages."""
    pairs = {name: encode_pairs(recs, template, enc, max_length) for name, recs in records.items()}
    for name, p in pairs.items():
        if not p.rows:
            raise BadInput(
                f"preference data: none of the {len(records[name])} {name} pairs is usable at "
                f"{param}.max_length={max_length} ({p.skipped_too_long} prompts fill it, {p.identical} "
                "pairs are identical once cut to it)"
            )
    skipped, identical = (sum(getattr(p, k) for p in pairs.values()) for k in ("skipped_too_long", "identical"))
    if skipped or identical:
        log.warning(
            "%s: skipped %d pair(s) whose prompt fills max_length %d and dropped %d whose chosen and "
            "rejected are identical once cut to it",
            stage,
            skipped,
            max_length,
            identical,
        )
    return pairs
