"""Where MLflow records go and in what form MLflow takes them: the tracking URI (by default
`sqlite:///mlflow.db` in the working folder, artifacts in `mlartifacts/` beside it), the variable
that nests a stage run under the pipeline's, and params, metrics and names cleaned to what MLflow
accepts. Shared by runs made in the process (`tracking`) and through the journal (`recording`);
imports nothing heavy."""

from __future__ import annotations

import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, Mapping

DEFAULT_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACTS = "mlartifacts"
PARENT_ENV = "GPTFORGE_PARENT_RUN_ID"
# A secret-looking param name has a `_`/`-`-separated word ending in one of these (`hf_token`,
# `data.api_key`, `apitoken`) but not counts like `max_tokens`.
_SECRET = re.compile(r"(?:token|key|secret|password|passwd|credentials?)$", re.IGNORECASE)
_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-./: ]")


def metric_name(name: str) -> str:
    """MLflow allows letters, digits, `_ - . / :` and spaces: lm-eval's `acc,none` -> `acc_none`."""
    return _METRIC_NAME.sub("_", name)


def is_secret(name: str) -> bool:
    """Whether a (dotted) param name looks like it holds a credential; its value is logged as `***`."""
    return any(_SECRET.search(word) for word in re.split(r"[_\-]", name.rsplit(".", 1)[-1]))


def _is_number(v: Any) -> bool:
    # numbers.Real also admits NumPy scalars (np.float32 is no float subclass); bools are not metrics.
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _param_value(v: Any) -> str:
    s = "null" if v is None else str(v)
    return s if len(s) <= 6000 else s[:5997] + "..."


def clean_params(params: Mapping[str, Any]) -> dict[str, str]:
    """Params as MLflow keeps them: strings of at most 6000 characters, secrets as `***`."""
    return {k: ("***" if is_secret(k) else _param_value(v)) for k, v in params.items()}


def clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers among `metrics`, under names MLflow accepts."""
    return {metric_name(k): float(v) for k, v in metrics.items() if _is_number(v)}


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: `mlartifacts/` beside a SQLite database.

    Any `sqlite:///PATH` store (relative paths resolve against the working directory, as
    SQLAlchemy resolves them) gets an absolute `file://` URI; for other stores (an MLflow
    server) None, so the server's own artifact root applies.
    """
    if not uri.startswith("sqlite:///"):
        return None
    db = uri[len("sqlite:///") :].split("?", 1)[0]
    if not db or db == ":memory:":
        return None
    return (Path(db).resolve().parent / DEFAULT_ARTIFACTS).as_uri()
