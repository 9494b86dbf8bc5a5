"""The promotion gate: a registered model version is promoted only when its metrics meet the
conditions of `registry.promote.<model>`, e.g. `{classify.test_accuracy: ">= 0.95"}`. A metric is
named as DVC names it, `<metrics file>.<key in it>`: the file is the longest dotted prefix `A`
for which `<metrics_dir>/A.json` exists (or `A` with its dots as folders: `evaluate.instruct` is
also `metrics/evaluate/instruct.json`, which evaluate@instruct writes), the rest is a key of that
(flat) JSON object, so `evaluate.instruct.hellaswag.acc_norm` is
`metrics/evaluate/instruct.json["hellaswag.acc_norm"]`, or `metrics/evaluate.json["instruct.hellaswag.acc_norm"]`
where there is no such file.
A malformed condition is the user's error (BadInput); a missing file or key fails the gate with
a reason, as an unmet condition does.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from gptforge.errors import BadInput

OPERATORS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}
_CONDITION = re.compile(r"\s*(>=|<=|==|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*")


class MissingMetric(LookupError):
    """A metric whose file or key does not exist; its message is the gate's reason."""


@dataclass
class GateResult:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    values: dict[str, float] = field(default_factory=dict)


def parse_condition(text: str, param: str = "registry.promote") -> tuple[str, float]:
    """(operator, number) of a condition like ">= 0.95" (spaces optional); BadInput naming `param`
    for anything else."""
    match = _CONDITION.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise BadInput(
            f"{param}: {text!r} is not a condition; expected an operator (>=, >, <=, <, ==) "
            'and a number, e.g. ">= 0.95"'
        )
    return match.group(1), float(match.group(2))


def read_metric(key: str, metrics_dir: str | os.PathLike = "metrics") -> float:
    """The value of metric `key` (`<file>.<key in it>`, longest file prefix wins); MissingMetric
    when no file, no such key, or not a finite number."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        candidates = [Path(metrics_dir) / (sep.join(parts[:cut]) + ".json") for sep in (".", "/")]
        path = next((p for p in candidates if p.is_file()), candidates[0])
        if path.is_file():
            break
    else:
        raise MissingMetric(
            f"no metrics file for {key} (looked for {Path(metrics_dir) / parts[0]}.json and longer prefixes)"
        )
    name = ".".join(parts[cut:])
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MissingMetric(f"{path} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(metrics, dict) or name not in metrics:
        raise MissingMetric(f"{path} has no {name}")
    value = metrics[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MissingMetric(f"{path}: {name} is {value!r}, not a finite number")
    return float(value)


def check(model: str, conditions: Mapping[str, str] | None, metrics_dir: str | os.PathLike = "metrics") -> GateResult:
    """Whether `model` meets every condition (metric key -> condition text); every condition is
    parsed first, so a malformed one stops the stage before anything is read."""
    if not conditions:
        return GateResult(True, ["no conditions"])
    parsed = {key: parse_condition(text, f"registry.promote.{model}.{key}") for key, text in conditions.items()}
    result = GateResult(True)
    for key, (op, threshold) in parsed.items():
        try:
            value = read_metric(key, metrics_dir)
        except MissingMetric as e:
            result.passed = False
            result.reasons.append(str(e))
            continue
        result.values[key] = value
        ok = OPERATORS[op](value, threshold)
        written = conditions[key].strip()[len(op) :].strip()  # the threshold as the user wrote it
        result.reasons.append(f"{key} {value:.4f} {op} {written}: {'ok' if ok else 'not met'}")
        result.passed = result.passed and ok
    return result
