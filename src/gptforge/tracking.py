"""MLflow tracking: one MLflow run per stage run. The only module that imports mlflow.

With no `MLFLOW_TRACKING_URI` the store is embedded: `sqlite:///mlflow.db` in the working
directory, artifacts under `mlartifacts/` (any `sqlite:///PATH` store: `mlartifacts/` beside the
database file). `tracking.enabled: false` (or mlflow not being
installed, as on a bare GPU box) gives a `NullRun` whose methods do nothing, so recipes call
`run.log_metrics(...)` unconditionally.

Nesting: when `GPTFORGE_PARENT_RUN_ID` is set (the pipeline sets it for its stages), the stage
run is created as a child of that run. `GPTFORGE_RUN_TAGS` (a JSON object) adds tags to the run:
the torchrun launcher hands its Prefect flow run id to rank 0 that way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

import gptforge

log = logging.getLogger("gptforge")

DEFAULT_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACTS = "mlartifacts"
PARENT_ENV = "GPTFORGE_PARENT_RUN_ID"
TAGS_ENV = "GPTFORGE_RUN_TAGS"
# A secret-looking param name has a `_`/`-`-separated word ending in one of these (`hf_token`,
# `data.api_key`, `apitoken`) but not counts like `max_tokens`.
_SECRET = re.compile(r"(?:token|key|secret|password|passwd|credentials?)$", re.IGNORECASE)
_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-./: ]")


class NullRun:
    """Tracking switched off: same interface, no effect."""

    run_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None: ...

    def log_text(self, text: str, name: str) -> None: ...

    def set_tags(self, tags: Mapping[str, Any]) -> None: ...

    def log_hf_model(self, folder: str | os.PathLike, name: str = "model", **flavor_kwargs: Any) -> str | None:
        """Log a Hugging Face causal-LM folder as an MLflow model (see MlflowRun); here nothing."""
        return None

    def mark_failed(self) -> None:
        """End as FAILED although the body returns (a pipeline reports its failed stage first)."""
        self.failed = True


class MlflowRun(NullRun):
    def __init__(self, mlflow, run) -> None:
        self._mlflow = mlflow
        self.run_id = run.info.run_id
        self.failed = False

    def log_params(self, params: Mapping[str, Any]) -> None:
        clean = {k: ("***" if is_secret(k) else _param_value(v)) for k, v in params.items()}
        self._mlflow.log_params(clean)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        clean = {metric_name(k): float(v) for k, v in metrics.items() if _is_number(v)}
        if clean:
            self._mlflow.log_metrics(clean, step=step)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self._mlflow.log_artifacts(str(path), artifact_path=artifact_path or path.name)
        elif path.is_file():
            self._mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def log_text(self, text: str, name: str) -> None:
        self._mlflow.log_text(text, name)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._mlflow.set_tags({k: str(v) for k, v in tags.items() if v is not None})

    def log_hf_model(self, folder: str | os.PathLike, name: str = "model", **flavor_kwargs: Any) -> str | None:
        """Log a Hugging Face causal-LM folder (save_pretrained's files and its tokenizer) as an
        MLflow model `name` of this run, with MLflow's transformers flavor, task text-generation:
        `mlflow.transformers.load_model(uri)` gives a text-generation pipeline back, and
        `mlflow.pyfunc.load_model(uri)` a model that serves it. Returns the model's URI, or None
        when the flavor cannot log it: a warning says why and the run goes on (a stage's result
        does not hang on its copy in MLflow).

        The model and tokenizer are loaded from the folder (on the CPU) and handed to the flavor:
        its path-only form does not work with transformers 5 (MLflow 3.17). The pip requirements
        are written here, the installed transformers/torch/accelerate versions, because the
        flavor's default list names torchvision, which this stack does not install, and its
        inference would load the model again in a subprocess. The model card is the folder's
        README.md when it has one (the flavor would otherwise look the path up on the hub).
        `flavor_kwargs` go to `mlflow.transformers.log_model` as they are (`input_example`).
        """
        folder = Path(folder)
        try:
            import huggingface_hub

            from gptforge.hf_causal import load_causal_lm

            model, tokenizer = load_causal_lm(str(folder), param="model")
            readme = folder / "README.md"
            card = (huggingface_hub.ModelCard.load(readme) if readme.is_file() else
                    huggingface_hub.ModelCard(f"# {folder.name}\n\nA Hugging Face causal LM logged by gptforge "
                                              f"{gptforge.__version__} from {folder}.\n"))
            info = self._mlflow.transformers.log_model(
                transformers_model={"model": model, "tokenizer": tokenizer}, name=name, task="text-generation",
                pip_requirements=pinned_requirements("transformers", "torch", "accelerate"), model_card=card, **flavor_kwargs)
        except Exception as e:  # noqa: BLE001 - any failure of the flavor: warn, never fail the stage
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            log.warning("MLflow: %s not logged as a transformers model (%.300s)", folder, reason)
            return None
        return info.model_uri


def pinned_requirements(*packages: str) -> list[str]:
    """`pkg==version` pip requirements of the installed `packages` (local version labels such as
    +cpu dropped; a package that is not installed is left out), for logged MLflow models."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for pkg in packages:
        try:
            pins.append(f"{pkg}=={version(pkg).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return pins


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


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """HEAD of the working tree; in the worker image (no .git) the commit it was built from."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("GPTFORGE_GIT_COMMIT") or None
    return out.stdout.strip() or None


def device_name() -> str:
    """The device the run computes on. A stage that has not loaded torch (the data stages)
    runs on the CPU: importing torch (seconds) only to name a GPU it does not use is waste."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "cpu"
    try:
        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.get_device_name(0)}"
    except Exception:  # broken CUDA: tags are best effort
        pass
    return "cpu"


def _import_mlflow():
    # Alembic prints its migrations at INFO on every fresh database; they are noise on a CLI.
    for name in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import mlflow

    return mlflow


@contextlib.contextmanager
def start_run(
    *,
    enabled: bool,
    experiment: str,
    stage: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
    system_metrics: bool = False,
) -> Iterator[NullRun]:
    """One MLflow run for one stage run; FAILED if the body raises, KILLED on Ctrl-C.
    `system_metrics` samples CPU, memory (and GPU, with nvidia-ml-py) in the background."""
    if not enabled:
        yield NullRun()
        return
    try:
        mlflow = _import_mlflow()
    except ImportError:
        log.warning("mlflow is not installed: this run is not tracked")
        yield NullRun()
        return
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        location = artifact_location(uri)
        with contextlib.suppress(Exception):  # another process may create it at the same moment
            mlflow.create_experiment(experiment, artifact_location=location)
    mlflow.set_experiment(experiment)

    commit = git_commit()
    all_tags = {
        "gptforge.version": gptforge.__version__,
        "gptforge.stage": stage,
        "dvc.stage": os.environ.get("DVC_STAGE"),
        "git.commit": commit,
        "mlflow.source.git.commit": commit,
        "device": device_name(),
        **env_tags(),
        **(tags or {}),
    }
    parent = os.environ.get(PARENT_ENV) or None
    active = mlflow.start_run(run_name=stage, parent_run_id=parent, nested=parent is not None,
                              log_system_metrics=system_metrics or None)
    run = MlflowRun(mlflow, active)
    status = "FINISHED"
    try:
        run.set_tags(all_tags)
        if params:
            run.log_params(params)
        yield run
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        mlflow.end_run(status="FAILED" if run.failed and status == "FINISHED" else status)


def run_url(run_id: str | None, experiment_id: str | None = None) -> str | None:
    """The MLflow UI page of a run, when the store is a tracking server (http/https). Without
    `experiment_id` it is looked up (one request)."""
    uri = tracking_uri()
    if not run_id or not uri.startswith(("http://", "https://")):
        return None
    if experiment_id is None:
        try:
            from mlflow.tracking import MlflowClient

            experiment_id = MlflowClient(uri).get_run(run_id).info.experiment_id
        except Exception:  # a link is a convenience: never fail a run over it
            return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def child_runs(parent_run_id: str) -> dict[str, tuple[str, str | None]]:
    """The runs nested under `parent_run_id`, by their `gptforge.stage` tag: stage -> (run id,
    UI link). The newest run of a stage wins (a stage re-run inside one pipeline)."""
    try:
        mlflow = _import_mlflow()
        client = mlflow.tracking.MlflowClient(tracking_uri())
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, f"tags.mlflow.parentRunId = '{parent_run_id}'",
                                  order_by=["attributes.start_time ASC"], max_results=1000)
    except Exception as e:  # tracking off, mlflow missing, or its store unreachable
        log.debug("no child runs of %s: %s", parent_run_id, e)
        return {}
    return {r.data.tags.get("gptforge.stage", r.info.run_name): (r.info.run_id, run_url(r.info.run_id, r.info.experiment_id))
            for r in runs}


def env_tags() -> dict[str, Any]:
    """Tags handed down by a launching process in `GPTFORGE_RUN_TAGS`; a malformed value is
    named in a warning and ignored (tags never fail a run)."""
    raw = os.environ.get(TAGS_ENV)
    if not raw:
        return {}
    try:
        tags = json.loads(raw)
    except ValueError:
        tags = None
    if not isinstance(tags, dict):
        log.warning("%s is not a JSON object, ignored: %.200s", TAGS_ENV, raw)
        return {}
    return tags


def publish_metrics(run: NullRun, metrics: Mapping[str, float], path: str | os.PathLike) -> None:
    """A stage's final metrics: the DVC metrics file (flat JSON) and the same in its MLflow run."""
    from gptforge.io import write_json

    write_json(path, dict(metrics))
    run.log_metrics(metrics)
    run.log_artifact(path)
