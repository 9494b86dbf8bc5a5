"""The field checks the config sections share: a source (`hf://`, `https://`, a local path, an
embedded `sample://NAME` resolved to its path), the instruct source's `synthetic://NAME`, the entry
names of a foreach stage's mapping (`NAME_PATTERN`) and the train/val/test split fractions. Used as
pydantic validators by `schema` and `data_schema`; and `only_entries`, the entry of such a mapping
that one `STAGE@NAME` of dvc.yaml runs (its section's `only`), which the stages call.
"""

from __future__ import annotations

import math
import re
from typing import Any

from gptforge import samples


def _resolve_sample(value: Any) -> Any:
    """`sample://NAME` (a file the package embeds, see gptforge.samples) -> its local path."""
    return samples.resolve(value) if samples.is_sample(value) else value


def _check_source(value: str) -> str:
    """A source is `hf://OWNER/NAME`, an `https://` URL, a local path (checked when used) or an
    embedded sample, `sample://NAME` (resolved to its path before this check)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be hf://OWNER/NAME, an https:// URL or a local path")
    if "://" in value:
        scheme = value.split("://", 1)[0].lower()
        if scheme == "hf":
            repo = value[len("hf://") :]
            if repo.count("/") != 1 or not all(repo.split("/")):
                raise ValueError(f"hf:// sources are hf://OWNER/NAME, got {value!r}")
        elif scheme != "https":
            raise ValueError(f"only https://, hf://, sample:// and local sources are accepted, got {value!r}")
    return value


def _check_instruct_source(value: str) -> str:
    """The instruct source may also be `synthetic://NAME`: the kept pairs of stage synthesize@NAME."""
    if isinstance(value, str) and value.startswith("synthetic://"):
        if not re.fullmatch(NAME_PATTERN, value[len("synthetic://") :]):
            raise ValueError(
                f"synthetic:// sources are synthetic://NAME, NAME an entry of synthesize.documents, got {value!r}"
            )
        return value
    return _check_source(value)


# No '.': DVC reads the param `base.models.NAME` (`synthesize.documents.NAME`) with the dots as nesting.
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_-]*"


def _check_names(value: dict[str, str], param: str, folder: str) -> dict[str, str]:
    """Entry names of a foreach stage's mapping (they name its output folders) and non-empty values."""
    for key, source in value.items():
        if not re.fullmatch(NAME_PATTERN, key):
            raise ValueError(
                f"name {key!r} must be letters, digits, '_' or '-' (it names the folder {folder} and "
                f"the DVC param {param}.{key}, where a '.' would nest)"
            )
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{param}.{key}: expected a non-empty string, got {source!r}")
    return value


def _check_splits(value: list[float]) -> list[float]:
    if len(value) != 3:
        raise ValueError(f"needs 3 fractions (train, val, test), got {len(value)}")
    if any(f < 0 for f in value):
        raise ValueError(f"fractions must be >= 0, got {value}")
    if not math.isclose(sum(value), 1.0, abs_tol=1e-6):
        raise ValueError(f"fractions must sum to 1, got {sum(value):g} ({value})")
    if value[0] <= 0:
        raise ValueError(f"the train fraction must be > 0, got {value}")
    return value


def only_entries(entries, only: str | None, param: str) -> list[str]:
    """The names of `entries` (a foreach stage's mapping, `param` its dotted name) one run takes:
    `only` alone (dvc.yaml's STAGE@NAME sets it), else all; BadInput when `only` names no entry."""
    if only is None:
        return list(entries)
    if only not in entries:
        from gptforge.errors import BadInput

        raise BadInput(f"{param} has no entry {only!r} (entries: {', '.join(entries) or 'none'})")
    return [only]


def check_evaluations(names: dict[str, str], evaluations: dict[str, str]) -> None:
    """registry.evaluations: one entry per registry.names entry, each the file its register@MODEL
    waits for: metrics/evaluate/NAME.json (what evaluate@NAME writes) or the model's own
    metrics/MODEL.json when nothing evaluates it. That an evaluate@NAME exists for it is the
    pipeline's check (`pipeline.run.check_evaluations_made`): a command run alone reads what is there."""
    if list(evaluations) != list(names):
        raise ValueError(
            f"registry.evaluations: expected one entry for each of registry.names, in its order "
            f"({', '.join(names) or 'none'}), got {', '.join(evaluations) or 'none'}"
        )
    for model, path in evaluations.items():
        own = f"metrics/{model}.json"
        if path != own and not re.fullmatch(r"metrics/evaluate/[^/]+\.json", path):
            raise ValueError(
                f"registry.evaluations.{model}: expected metrics/evaluate/NAME.json (an evaluate@NAME's) "
                f"or {own} (not evaluated), got {path!r}"
            )
