"""`prepare instruct`: Alpaca-style records -> `{train,val,test}.jsonl` (`instruction`, `input`, `output`).

Sources (`data.instruct.source`): Stanford Alpaca's `alpaca_data.json` URL, `hf://tatsu-lab/alpaca`
(split `data.instruct.split`), a local `.json` list / `.jsonl` / `.csv` / `.parquet` file, or
`synthetic://NAME`: the pairs stage synthesize@NAME kept (`data/synthetic/NAME/qa.jsonl`), whose
provenance keys (`source`, `chunk`, `span`, `scores`) stay in the split files.

A record needs string `instruction` and `output`; a missing or null `input` means "" (Alpaca
leaves it empty for most records). Records that break this are skipped and counted as
`invalid`, those with a blank instruction or output as `dropped_empty`; extra keys (the hub
copy has a pre-formatted `text`) are dropped. When a required field is missing from most
records the file is some other dataset, and the stage refuses it instead of writing a tiny
remainder. The rest is shuffled (seeded) and cut by `data.instruct.splits`.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from gptforge.config.schema import Config
from gptforge.data.sources import read_records, shuffle_split, source_records, write_splits
from gptforge.errors import BadInput
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics

log = logging.getLogger("gptforge")

PARAM = "data.instruct.source"
FIELDS = ("instruction", "input", "output")
REQUIRED = ("instruction", "output")
PROVENANCE = ("source", "chunk", "span", "scores")  # kept from synthetic:// records


@dataclass
class Validated:
    records: list[dict] = field(default_factory=list)
    total: int = 0
    invalid: int = 0
    dropped_empty: int = 0


def prepare_instruct(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    out_dir: str | os.PathLike = "data/instruct",
    metrics_path: str | os.PathLike = "metrics/prepare_instruct.json",
    raw_dir: str | os.PathLike = "data/raw",
    synthetic_root: str | os.PathLike = "data/synthetic",
) -> dict:
    d = cfg.data.instruct
    synthetic = d.source.startswith("synthetic://")
    if synthetic:
        records = steps(synthetic_records, d.source.removeprefix("synthetic://"), synthetic_root)
    else:
        records = source_records(
            d.source,
            param=PARAM,
            split=d.split,
            sha256=d.sha256,
            download=cfg.data.download,
            steps=steps,
            raw_dir=raw_dir,
        )
    validated = steps(validate_records, records, where=f"{PARAM} {d.source}", keep=PROVENANCE if synthetic else ())
    splits = steps(shuffle_split, validated.records, d.splits, d.seed)
    check_no_empty_split(splits, d.splits, len(validated.records))
    steps(write_splits, splits, out_dir)

    metrics = {
        "records": validated.total,
        "invalid": validated.invalid,
        "dropped_empty": validated.dropped_empty,
        **{name: len(items) for name, items in splits.items()},
    }
    publish_metrics(run, metrics, metrics_path)
    log.info(
        "instruct data: %d train, %d val, %d test -> %s", metrics["train"], metrics["val"], metrics["test"], out_dir
    )
    return metrics


def synthetic_records(name: str, root: str | os.PathLike = "data/synthetic") -> list[Any]:
    """The kept pairs of stage synthesize@NAME (`root/NAME/qa.jsonl`)."""
    from gptforge.synthesize.stage import synthetic_path

    path = synthetic_path(name, root)
    if not path.is_file() and (path.parent / "chunks.jsonl").is_file():
        raise BadInput(
            f"{PARAM}: synthetic://{name}: {path.parent} holds chunks only, no pairs "
            "(synthesized with synthesize.endpoint.url null): name an endpoint and run `gptforge "
            f"synthesize -S synthesize.only={name}` again, or train on another source"
        )
    if not path.is_file():
        raise BadInput(
            f"{PARAM}: synthetic://{name} reads {path}, which does not exist: run "
            f"`gptforge synthesize -S synthesize.only={name}` (or `dvc repro synthesize@{name}`) first"
        )
    return read_records(path, param=PARAM)


def check_no_empty_split(splits: dict[str, list], fractions: Sequence[float], n: int) -> None:
    """A split given a share that rounds to no record is refused (a test split of 0 would leave
    the fine-tuning stage nothing to score): one line naming the record count."""
    for (name, items), fraction in zip(splits.items(), fractions):
        if fraction > 0 and not items:
            raise BadInput(
                f"data.instruct.splits: {n} records leave the {name} split ({fraction:g}) empty: "
                "give it a larger share or the source more records"
            )


def validate_records(records: Sequence[Any], *, where: str, keep: Sequence[str] = ()) -> Validated:
    """Keep well-formed, non-blank records with exactly `instruction`, `input`, `output` (and the
    keys in `keep`, when a record has them).

    Messages count records from 1, as lines are counted (in a .jsonl file they are the same).
    """
    out = Validated(total=len(records))
    if not records:
        raise BadInput(f"{where}: no records")
    missing: Counter[str] = Counter()
    first_missing: dict[str, int] = {}
    first_invalid: tuple[int, str] | None = None
    for number, record in enumerate(records, 1):
        problem = _problem(record)
        if problem is not None:
            out.invalid += 1
            first_invalid = first_invalid or (number, problem)
            for key in REQUIRED:
                if not isinstance(record, dict) or key not in record:
                    missing[key] += 1
                    first_missing.setdefault(key, number)
            continue
        instruction, output = record["instruction"], record["output"]
        if not instruction.strip() or not output.strip():
            out.dropped_empty += 1
            continue
        out.records.append(
            {
                "instruction": instruction,
                "input": record.get("input") or "",
                "output": output,
                **{key: record[key] for key in keep if key in record},
            }
        )

    for key in REQUIRED:
        if missing[key] * 2 > out.total:
            raise BadInput(
                f"{where}: field '{key}' is missing in {missing[key]} of {out.total} records "
                f"(first: record {first_missing[key]}); expected objects with {', '.join(FIELDS)}"
            )
    if out.invalid == out.total:
        number, problem = first_invalid
        raise BadInput(f"{where}: all {out.total} records are invalid (first: record {number}: {problem})")
    if out.invalid:
        number, problem = first_invalid
        log.warning(
            "%s: skipped %d invalid records of %d (first: record %d: %s)",
            where,
            out.invalid,
            out.total,
            number,
            problem,
        )
    if out.dropped_empty:
        log.warning("%s: dropped %d records with an empty instruction or output", where, out.dropped_empty)
    if not out.records:
        raise BadInput(
            f"{where}: no records left after dropping {out.dropped_empty} with an empty instruction "
            f"or output and {out.invalid} invalid ones"
        )
    return out


def _problem(record: Any) -> str | None:
    """Why a record is unusable, or None."""
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, expected an object"
    for key in REQUIRED:
        if key not in record:
            return f"no '{key}'"
        if not isinstance(record[key], str):
            return f"'{key}' is {type(record[key]).__name__}, expected a string"
    value = record.get("input")
    if value is not None and not isinstance(value, str):
        return f"'input' is {type(value).__name__}, expected a string"
    return None
