"""`gptforge models list|promote`: the MLflow Model Registry as the stage `register` leaves it,
read and moved from the command line, against the tracking URI of `mlflow_values.tracking_uri()`.

`list_models` gives one row per model version, newest first per model (the models of
`registry.names` first, in their order, then any other), with its aliases, creation time, gate
and key metrics: the gate's metrics of `registry.promote`, then those of KEY_METRICS, named
without `metric.`, the metrics file and the model's key (`metric.evaluate.instruct.hellaswag.
acc_norm` of gptforge-instruct is `hellaswag.acc_norm`); every tag is in the MLflow UI.
`promote` moves an alias (`champion` by default) to a version. A NAME is a registered name or a
key of `registry.names` (`classify`). An unknown name or version is BadInput; a tracking server
that cannot be reached is SourceUnreachable, after 2 retries instead of MLflow's 7 (about 4
minutes) unless MLFLOW_HTTP_REQUEST_MAX_RETRIES says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator

from gptforge.errors import BadInput, SourceUnreachable
from gptforge.runtime import mlflow_values, tracking

# Shortened metric names shown after the gate's own, in this order, when a version has them.
KEY_METRICS = ("test_accuracy", "f1", "val_loss", "hellaswag.acc_norm", "mmlu.acc")
HOW_TO_REGISTER = "`gptforge register` or `dvc repro register` registers the pipeline's models"
COLUMNS = ("NAME", "VERSION", "ALIASES", "CREATED", "GATE", "METRICS")


def _client(uri: str):
    """An MlflowClient for `uri`, or None for a SQLite store whose file does not exist (reading
    must not create an empty database)."""
    if uri.startswith("sqlite:///"):
        db = uri[len("sqlite:///") :].split("?", 1)[0]
        if db and db != ":memory:" and not Path(db).is_file():
            return None
    for name, value in (
        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"),
        ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "30"),
    ):
        os.environ.setdefault(name, value)
    mlflow = tracking._import_mlflow()
    return mlflow.tracking.MlflowClient(tracking_uri=uri)  # the registry: MLFLOW_REGISTRY_URI, else this


@contextlib.contextmanager
def _registry_errors(uri: str) -> Iterator[None]:
    """MLflow's errors as ours: unreachable server -> SourceUnreachable, unknown or invalid
    name, version or alias -> BadInput."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as e:
        cause, chain = e, []
        while cause is not None:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        if (
            any(isinstance(c, (requests.ConnectionError, requests.Timeout)) for c in chain)
            or "timeout exception" in e.message
        ):
            raise SourceUnreachable(
                f"the MLflow tracking server {uri} cannot be reached: start it, or set "
                f"MLFLOW_TRACKING_URI to one that runs ({type(chain[-1]).__name__})"
            ) from e
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise BadInput(e.message) from e
        raise


def _resolve(cfg, name: str) -> str:
    return cfg.registry.names.get(name, name)


def _model(client, name: str, uri: str):
    """The registered model `name`; BadInput naming the registered ones when there is none."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    known = sorted(m.name for m in _paged(client.search_registered_models, max_results=100))
    raise BadInput(
        f"no registered model {name!r} in {uri}; registered: {', '.join(known) or 'none'} ({HOW_TO_REGISTER})"
    )


def _metrics(tags: dict[str, str], model_key: str | None, gate_keys) -> str:
    """The version's key metrics as `name=value` (4 significant digits), gate metrics first."""
    short = {}
    for tag, value in tags.items():
        if not tag.startswith("metric."):
            continue
        rest = tag[len("metric.") :]
        key = rest.split(".", 1)[1] if "." in rest else rest  # without the metrics file
        if model_key and key.startswith(f"{model_key}."):
            key = key[len(model_key) + 1 :]  # evaluate.json's `<model>.` prefix
        short[rest] = (key, value)
    wanted = [rest for rest in gate_keys if rest in short]
    wanted += [rest for k in KEY_METRICS for rest, (key, _) in short.items() if key == k and rest not in wanted]
    cells = []
    for rest in wanted:
        key, value = short[rest]
        with contextlib.suppress(ValueError):
            value = f"{float(value):.4g}"
        cells.append(f"{key}={value}")
    return " ".join(cells)


def _paged(search, **kwargs) -> list:
    items, token = [], None
    while True:
        page = search(page_token=token, **kwargs)
        items.extend(page)
        token = page.token
        if not token:
            return items


def list_models(cfg, name: str | None = None) -> list[tuple[str, ...]]:
    """Rows of COLUMNS for every version of every registered model (or of `name` only)."""
    uri = mlflow_values.tracking_uri()
    client = _client(uri)
    if client is None:
        if name is not None:
            raise BadInput(f"no registered model {_resolve(cfg, name)!r}: {uri} does not exist yet; {HOW_TO_REGISTER}")
        return []
    keys = {registered: key for key, registered in cfg.registry.names.items()}
    with _registry_errors(uri):
        if name is not None:
            models = [_model(client, _resolve(cfg, name), uri)]
        else:
            order = list(keys)
            models = sorted(
                _paged(client.search_registered_models, max_results=100),
                key=lambda m: (order.index(m.name) if m.name in order else len(order), m.name),
            )
        rows = []
        for model in models:
            by_version: dict[str, list[str]] = {}
            for alias, version in sorted((model.aliases or {}).items()):
                by_version.setdefault(str(version), []).append(alias)
            key = keys.get(model.name)
            gate_keys = list(cfg.registry.promote.get(key, {})) if key else []
            versions = client.search_model_versions(f"name = '{model.name}'")
            for v in sorted(versions, key=lambda v: int(v.version), reverse=True):
                created = time.strftime("%Y-%m-%d %H:%M", time.localtime(v.creation_timestamp / 1000))
                rows.append(
                    (
                        model.name,
                        str(v.version),
                        ",".join(by_version.get(str(v.version), [])) or "-",
                        created,
                        v.tags.get("gptforge.gate", "-"),
                        _metrics(v.tags, key, gate_keys) or "-",
                    )
                )
    return rows


def format_table(rows: list[tuple[str, ...]]) -> str:
    """COLUMNS and rows, every column but the last padded to its widest cell."""
    table = [COLUMNS, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in table)


def no_models_line(name: str | None = None) -> str:
    what = f"{name} has no versions" if name else "no registered models"
    return f"{what} in {mlflow_values.tracking_uri()}: {HOW_TO_REGISTER}"


def promote(cfg, name: str, version: str, alias: str = "champion") -> str:
    """Give `version` of `name` the alias; the line saying what changed."""
    name = _resolve(cfg, name)
    if not version.isdigit() or int(version) < 1:
        raise BadInput(f"VERSION must be a version number (1, 2, ...), got {version!r}")
    version = str(int(version))  # 02 -> 2
    uri = mlflow_values.tracking_uri()
    client = _client(uri)
    if client is None:
        raise BadInput(f"no registered model {name!r}: {uri} does not exist yet; {HOW_TO_REGISTER}")
    with _registry_errors(uri):
        model = _model(client, name, uri)
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        if int(version) not in versions:
            raise BadInput(
                f"{name} has no version {version}; its versions: "
                f"{', '.join(map(str, versions)) or 'none'} (gptforge models list --name {name})"
            )
        before = (model.aliases or {}).get(alias)
        client.set_registered_model_alias(name, alias, version)
    if before is None:
        was = f"no version held @{alias} before"
    elif str(before) == version:
        was = f"it held @{alias} already"
    else:
        was = f"before: version {before}"
    return f"{name} version {version} is now @{alias} ({was})"
