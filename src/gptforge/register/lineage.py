"""Where a registered model version comes from: the hash of its weights folder, the DVC hashes of
the stage that made it (its outs and its data deps, from dvc.lock), the MLflow run of that stage
(and through its tags the Prefect flow run and the git commit), and the metrics it was promoted
on. `version_tags` puts them together as the string tags of a model version, and `description`
says how to reproduce it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from gptforge.errors import BadInput

log = logging.getLogger("gptforge")

DATA_PREFIXES = ("data/", "checkpoints/")  # deps that are data or weights, not code or params


def folder_hash(folder: str | os.PathLike) -> str:
    """sha256 (hex) over the sorted relative paths and the bytes of every file under `folder`:
    the same files give the same hash wherever and whenever they were written."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"weights folder not found: {folder}")
    digest = hashlib.sha256()
    for path in sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.relative_to(folder).as_posix()):
        file_digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                file_digest.update(chunk)
        digest.update(path.relative_to(folder).as_posix().encode("utf-8") + b"\0" + file_digest.digest())
    return digest.hexdigest()


def dvc_lock_hashes(stage: str, lock_path: str | os.PathLike = "dvc.lock") -> dict[str, dict[str, str]]:
    """{"outs": {path: md5}, "deps": {path: md5}} of `stage` in dvc.lock, deps limited to data and
    weights (DATA_PREFIXES); {} when there is no lock file, no such stage, or it cannot be read."""
    path = Path(lock_path)
    if not path.is_file():
        return {}
    try:
        lock = yaml.safe_load(path.read_text(encoding="utf-8"))
        entry = lock["stages"][stage]
    except (KeyError, TypeError):
        return {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        log.warning("%s: not readable, no DVC hashes (%s)", path, type(e).__name__)
        return {}
    if not isinstance(entry, dict):
        return {}

    def hashes(items: Any, data_only: bool) -> dict[str, str]:
        out = {}
        for item in items if isinstance(items, list) else []:
            # DVC 3 writes `hash: md5` beside `md5: <value>`; DVC 2 only `md5`.
            value = item.get(item.get("hash") or "md5") if isinstance(item, dict) else None
            if isinstance(value, str) and (not data_only or str(item.get("path", "")).startswith(DATA_PREFIXES)):
                out[str(item["path"])] = value
        return out

    return {"outs": hashes(entry.get("outs"), False), "deps": hashes(entry.get("deps"), True)}


def training_run(client, experiment_name: str, stage: str) -> tuple[str, dict[str, str]] | None:
    """(run id, tags) of the newest FINISHED run of `experiment_name` tagged `dvc.stage` = `stage`
    (tracking.start_run tags every stage run so); None when there is none."""
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    runs = client.search_runs(
        [experiment.experiment_id],
        f"tags.`dvc.stage` = '{stage}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return (runs[0].info.run_id, dict(runs[0].data.tags)) if runs else None


def version_tags(
    *,
    stage: str,
    weights_hash: str | None = None,
    commit: str | None = None,
    lock: Mapping[str, Mapping[str, str]] | None = None,
    run: tuple[str, Mapping[str, str]] | None = None,
    metrics: Mapping[str, float] | None = None,
) -> dict[str, str]:
    """The tags of a model version, all strings, absent values left out: `weights_hash` (from
    folder_hash), `lock` (from dvc_lock_hashes), `run` (from training_run; its `git.commit` and
    `prefect.flow_run_id` tags), `commit` (wins over the run's) and `metrics` (metric key ->
    value, tagged `metric.<key>` with `str(float)`, which round-trips exactly)."""
    run_id, run_tags = run if run is not None else (None, {})
    lock = lock or {}
    tags = {
        "gptforge.weights_hash": weights_hash,
        "git.commit": commit or run_tags.get("git.commit"),
        "dvc.stage": stage,
        "dvc.outs": json.dumps(dict(lock["outs"]), sort_keys=True) if lock.get("outs") else None,
        "dvc.deps": json.dumps(dict(lock["deps"]), sort_keys=True) if lock.get("deps") else None,
        "prefect.flow_run_id": run_tags.get("prefect.flow_run_id"),
        "mlflow.training_run_id": run_id,
        **{f"metric.{key}": str(float(value)) for key, value in (metrics or {}).items()},
    }
    return {key: str(value) for key, value in tags.items() if value is not None and value != ""}


def description(stage: str, commit: str | None) -> str:
    """How to reproduce a version: the DVC stage at its git commit."""
    if not commit:
        return (
            f"Made by DVC stage `{stage}` at an unknown git commit. Reproduce: `dvc repro {stage}` "
            "(the data and weights hashes are in the tags)."
        )
    return (
        f"Made by DVC stage `{stage}` at git commit `{commit}`. Reproduce: `git checkout {commit} && "
        f"dvc repro {stage}` (the data and weights hashes are in the tags)."
    )
