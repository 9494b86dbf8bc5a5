"""MLflow tracking: one MLflow run per stage run. The only module that imports mlflow.

With no `MLFLOW_TRACKING_URI` the store is embedded: `sqlite:///mlflow.db` in the working
directory, artifacts under `mlartifacts/` (any `sqlite:///PATH` store: `mlartifacts/` beside the
database file). `tracking.enabled: false` (or mlflow not being
installed, as on a bare GPU box) gives a `NullRun` whose methods do nothing, so recipes call
`run.log_metrics(...)` unconditionally.

Outages: with an MLflow server (an http(s) `MLFLOW_TRACKING_URI`) every record of a run (params,
metrics, tags, texts, artifacts, its final status) goes through an in-order `Outbox`: a daemon
thread sends them, so the training loop never waits on the server, and what is logged while the
server restarts is sent once it is back. The run's start stays synchronous (a server that is down
then is a one-line error), and its end waits for the outbox a bounded time
(`GPTFORGE_TRACKING_FLUSH_SECONDS`, default 30; 5 s when the run was stopped), then says in one
warning what could not be recorded. A local store (SQLite) cannot restart under a run: records go
to it synchronously, and its errors surface at once, as they always did.

Nesting: when `GPTFORGE_PARENT_RUN_ID` is set (the pipeline sets it for its stages), the stage
run is created as a child of that run. `GPTFORGE_RUN_TAGS` (a JSON object) adds tags to the run:
the torchrun launcher hands its Prefect flow run id to rank 0 that way.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Mapping

import gptforge
from gptforge.runtime.mlflow_values import PARENT_ENV, artifact_location, clean_metrics, clean_params, tracking_uri
from gptforge.runtime.run_context import device_name, env_tags, git_commit, pinned_requirements, start_system_metrics

log = logging.getLogger("gptforge")

FLUSH_ENV = "GPTFORGE_TRACKING_FLUSH_SECONDS"
DEFAULT_FLUSH_SECONDS = 30.0
# A stopped run must let its process exit within 30 s of SIGTERM (docker stop, a worker draining).
KILLED_FLUSH_SECONDS = 5.0
DROPPED_TAG = "gptforge.tracking.dropped_records"
# MLflow's own HTTP retries (7, with exponential backoff: minutes) would hold every request to a
# server that is down; the outbox retries instead, so each request gives up after a few seconds.
# Set with setdefault: a value the user exported wins.
HTTP_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
_RETRY_STATUS = (408, 429)
OUTBOX_THREAD = "gptforge-mlflow"


class _NotFromOutbox(logging.Filter):
    """urllib3 warns on each of MLflow's retries ("Retrying ... after connection broken"): during an
    outage the outbox's thread would print that every few seconds. The outbox says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.threadName.startswith(OUTBOX_THREAD)


logging.getLogger("urllib3.connectionpool").addFilter(_NotFromOutbox())


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
    """A stage's MLflow run. Records go out through `_submit`: synchronously to a local store, or
    through an `Outbox` (`buffered`) to a tracking server (see the module docstring)."""

    def __init__(self, mlflow, run, uri: str | None = None, buffered: bool = False) -> None:
        self._mlflow = mlflow
        self.run_id = run.info.run_id
        self.failed = False
        self.uri = uri
        self._client = None
        self._monitor = None
        self._outbox = None
        if buffered:
            from gptforge.runtime.outbox import Outbox

            self._outbox = Outbox(
                self._send,
                retryable=retryable,
                describe=describe_failure,
                label=f"MLflow server at {uri}",
                name=f"{OUTBOX_THREAD}-{self.run_id[:8]}",
            )

    def log_params(self, params: Mapping[str, Any]) -> None:
        if clean := clean_params(params):
            self._submit("params", clean, len(clean))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        # Stamped now, not when sent: metrics kept through an outage keep their real times.
        now = int(time.time() * 1000)
        clean = [Metric(k, v, now, step or 0) for k, v in clean_metrics(metrics).items()]
        if clean:
            self._submit("metric", clean, len(clean))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        # Uploaded from its path when sent: a file changed in between goes as it is then.
        path = Path(path)
        if path.is_dir():
            self._submit("artifact", (str(path), artifact_path or path.name, True))
        elif path.is_file():
            self._submit("artifact", (str(path), artifact_path, False))

    def log_text(self, text: str, name: str) -> None:
        self._submit("text", (text, name))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        clean = {k: str(v) for k, v in tags.items() if v is not None}
        if clean:
            self._submit("tags", clean, len(clean))

    def _submit(self, kind: str, payload: Any, size: int = 1) -> None:
        if self._outbox is not None:
            self._outbox.put(kind, payload, size)
        else:
            self._send(kind, [payload])

    def _send(self, kind: str, payloads: list) -> None:
        """The MLflow requests for records of one kind (several only for metrics), for both the
        synchronous path and the outbox's thread: by run id, since MLflow's active run is local
        to the thread that started it."""
        if self._client is None:
            self._client = self._mlflow.tracking.MlflowClient(self.uri)
        client, run_id = self._client, self.run_id
        if kind == "metric":  # each payload is one log_metrics call's list
            client.log_batch(run_id, metrics=[m for metrics in payloads for m in metrics])
            return
        [payload] = payloads
        if kind in ("params", "tags"):
            from mlflow.entities import Param, RunTag

            entity = Param if kind == "params" else RunTag
            client.log_batch(run_id, **{kind: [entity(k, v) for k, v in payload.items()]})
        elif kind == "text":
            client.log_text(run_id, *payload)
        elif kind == "artifact":
            path, artifact_path, is_dir = payload
            (client.log_artifacts if is_dir else client.log_artifact)(run_id, path, artifact_path)
        elif kind == "end":
            client.set_terminated(run_id, payload)
        else:
            raise ValueError(f"unknown record kind {kind!r}")

    def end(self, status: str, timeout: float) -> None:
        """End the run with `status`: stop system metrics, then (server) leave MLflow's active
        run state at once, and send what is queued and the status within `timeout` seconds;
        what is still unsent then is named in one warning. A local store ends as it always did."""
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        if self._outbox is None:
            self._mlflow.end_run(status=status)
            return
        deadline = time.monotonic() + timeout
        _leave_active_run(self._mlflow, self.run_id)
        outbox = self._outbox
        if outbox.flush(timeout) and outbox.dropped:
            outbox.put("tags", {DROPPED_TAG: str(outbox.dropped)})
        outbox.put("end", status)
        left = outbox.close(max(0.0, deadline - time.monotonic()))
        if left:
            if outbox.failing_since is not None:
                why = (
                    f"was unreachable for the last {time.monotonic() - outbox.failing_since:.0f} s (waited "
                    f"{timeout:.0f} s; last error: {outbox.last_error})"
                )
            else:  # its request since the server went is still in MLflow's own retries: no failure seen yet
                why = f"did not answer (waited {timeout:.0f} s; a request was still in flight)"
            items = " and ".join(x for x in (_counts(left), f"its status {status}" if "end" in left else "") if x)
            dropped = f"; earlier, {_dropped_note(outbox)}" if outbox.dropped else ""
            log.warning(
                "MLflow: run %s could not record %s: the server at %s %s%s", self.run_id, items, self.uri, why, dropped
            )
        elif outbox.dropped:
            log.warning("MLflow: run %s is recorded but %s (tag %s)", self.run_id, _dropped_note(outbox), DROPPED_TAG)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (bounded; default GPTFORGE_TRACKING_FLUSH_SECONDS) until the records logged so far
        are sent. True when nothing is left; always True for a local store."""
        if self._outbox is None:
            return True
        return self._outbox.flush(flush_seconds() if timeout is None else timeout)

    def log_hf_model(self, folder: str | os.PathLike, name: str = "model", **flavor_kwargs: Any) -> str | None:
        """Log a Hugging Face causal-LM folder (save_pretrained's files and its tokenizer) as an
        MLflow model `name` of this run, with MLflow's transformers flavor, task text-generation:
        `mlflow.transformers.load_model(uri)` gives a text-generation pipeline back, and
        `mlflow.pyfunc.load_model(uri)` a model that serves it. With `task="text-classification"`
        the folder is a sequence classifier (the reward model: pass `model_config=
        {"function_to_apply": "none"}` for its raw score). Returns the model's URI, or None
        when the flavor cannot log it: a warning says why and the run goes on (a stage's result
        does not hang on its copy in MLflow).

        The model and tokenizer are loaded from the folder (on the CPU) and handed to the flavor:
        its path-only form does not work with transformers 5 (MLflow 3.17). The pip requirements
        are written here, the installed transformers/torch/accelerate versions, because the
        flavor's default list names torchvision, which this stack does not install, and its
        inference would load the model again in a subprocess. The model card is the folder's
        README.md when it has one (the flavor would otherwise look the path up on the hub).
        `flavor_kwargs` go to `mlflow.transformers.log_model` as they are (`input_example`), but a
        `signature` given as `ModelSignature.to_dict`'s dict, which a journal can carry, is read back,
        and `example_params` (a dict) joins `input_example` as the (example, params) pair MLflow
        takes, which a journal would not carry as a tuple.
        """
        folder = Path(folder)
        self.flush()  # the flavor logs through MLflow's fluent API: what was queued goes first
        try:
            import huggingface_hub

            from gptforge.modeling.hf_causal import load_causal_lm

            task = flavor_kwargs.pop("task", "text-generation")
            if isinstance(flavor_kwargs.get("signature"), dict):  # as it travels in a journal
                from mlflow.models import ModelSignature

                flavor_kwargs["signature"] = ModelSignature.from_dict(flavor_kwargs["signature"])
            if (example_params := flavor_kwargs.pop("example_params", None)) is not None:
                flavor_kwargs["input_example"] = (flavor_kwargs.get("input_example"), example_params)
            if task == "text-generation":
                model, tokenizer = load_causal_lm(str(folder), param="model")
            else:
                from transformers import AutoModelForSequenceClassification, AutoTokenizer

                model = AutoModelForSequenceClassification.from_pretrained(str(folder))
                tokenizer = AutoTokenizer.from_pretrained(str(folder))
            readme = folder / "README.md"
            card = (
                huggingface_hub.ModelCard.load(readme)
                if readme.is_file()
                else huggingface_hub.ModelCard(
                    f"# {folder.name}\n\nA Hugging Face causal LM logged by gptforge "
                    f"{gptforge.__version__} from {folder}.\n"
                )
            )
            flavor_log = logging.getLogger("mlflow.transformers")
            flavor_log.addFilter(_own_params_warning)
            try:
                info = self._mlflow.transformers.log_model(
                    transformers_model={"model": model, "tokenizer": tokenizer},
                    name=name,
                    task=task,
                    pip_requirements=pinned_requirements("transformers", "torch", "accelerate"),
                    model_card=card,
                    **flavor_kwargs,
                )
            finally:
                flavor_log.removeFilter(_own_params_warning)
        except Exception as e:  # noqa: BLE001 - any failure of the flavor: warn, never fail the stage
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            log.warning("MLflow: %s not logged as a transformers model (%.300s)", folder, reason)
            return None
        return info.model_uri


def _own_params_warning(record: logging.LogRecord) -> bool:
    """Drops the flavor's warning that the parameters of the input example override the saved
    inference configuration: when it checks the logged model on `example_params`, they are ours."""
    return not record.getMessage().startswith("params provided to the `predict` method will override")


def retryable(e: BaseException) -> bool:
    """Whether sending again may succeed: the server unreachable, a connection reset, a timeout,
    or an answer of HTTP 5xx/429/408 (restarting, overloaded). Anything else (a 4xx: a bad value,
    a deleted run; a local file gone) fails the same way again. MLflow wraps the requests error
    in an MlflowException, so the whole cause/context chain is looked at."""
    import requests

    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    network = (
        requests.ConnectionError,
        requests.Timeout,
        requests.exceptions.RetryError,
        requests.exceptions.ChunkedEncodingError,
        ConnectionError,
        TimeoutError,
    )
    if any(isinstance(x, network) for x in chain):
        return True
    for x in chain:
        status = None
        if isinstance(x, requests.HTTPError) and x.response is not None:
            status = x.response.status_code
        elif callable(getattr(x, "get_http_status_code", None)):  # an MlflowException
            status = x.get_http_status_code()
        if status is not None:
            return status >= 500 or status in _RETRY_STATUS
    return False


def describe_failure(e: BaseException) -> str:
    """A failed MLflow request in a few words: requests' messages run to hundreds of characters
    ("HTTPConnectionPool(host=..., port=...): Max retries exceeded with url: ... (Caused by
    NewConnectionError(...: [Errno 111] Connection refused))"); the errno part says it all."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    found = re.search(r"\[Errno -?\d+\] [^'\")]+|Read timed out|too many \d+ error responses", text)
    if found:
        return f"{found.group(0).strip()} ({type(e).__name__})"
    return text[:200]


def flush_seconds() -> float:
    """How long the end of a run waits for records still queued for a server (a restart)."""
    raw = os.environ.get(FLUSH_ENV)
    if not raw:
        return DEFAULT_FLUSH_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        log.warning("%s=%r is not a number of seconds >= 0: waiting %.0f s", FLUSH_ENV, raw, DEFAULT_FLUSH_SECONDS)
        return DEFAULT_FLUSH_SECONDS
    return value


_KIND_WORDS = {"metric": "metrics", "params": "params", "tags": "tags", "text": "artifacts", "artifact": "artifacts"}


def _counts(left: Mapping[str, int]) -> str:
    """{"metric": 12, "text": 1, "artifact": 2} -> "12 metrics, 3 artifacts" (the status apart)."""
    words: Counter[str] = Counter()
    for kind, n in left.items():
        if kind in _KIND_WORDS:
            words[_KIND_WORDS[kind]] += n
    order = ("metrics", "params", "tags", "artifacts")
    return ", ".join(f"{words[w]} {w if words[w] != 1 else w[:-1]}" for w in order if words[w])


def _dropped_note(outbox) -> str:
    """What the outbox dropped before the end: "1 metric rejected by the server and ..."."""
    parts = []
    if outbox.rejected:
        parts.append(f"{_counts(outbox.rejected)} rejected by the server")
    if outbox.overflowed:
        parts.append(f"{_counts(outbox.overflowed)} dropped from a full buffer ({outbox.capacity} values)")
    return " and ".join(parts)


def _leave_active_run(mlflow, run_id: str) -> None:
    """Take `run_id` off MLflow's active run stack without a request: what `mlflow.end_run`
    does (MLflow 3.17) before it calls the server. With the server down, end_run would block in
    its retries and then raise, and the run would stay active for MLflow's atexit `end_run`,
    which would block again and could overwrite the status sent through the outbox. (System
    metrics, the other thing end_run stops, are ours: see start_system_metrics.)"""
    try:
        from mlflow.tracking import fluent

        stack = fluent._active_run_stack.get()
        if stack and stack[-1].info.run_id == run_id:
            stack.pop()
            fluent.MLFLOW_RUN_ID.unset()
            fluent._last_active_run_id.set(run_id)
    except (ImportError, AttributeError) as e:  # MLflow's internals moved: the stack stays; say so
        log.warning("MLflow: could not clear the active run (%s); MLflow's own end_run may run at exit", e)


def _import_mlflow():
    # Alembic prints its migrations at INFO on every fresh database; they are noise on a CLI.
    for name in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import mlflow

    return mlflow


def run_tags(stage: str, tags: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tags of every stage run: version, stage, DVC stage, commit, device, handed-down tags."""
    commit = git_commit()
    return {
        "gptforge.version": gptforge.__version__,
        "gptforge.stage": stage,
        "dvc.stage": os.environ.get("DVC_STAGE"),
        "git.commit": commit,
        "mlflow.source.git.commit": commit,
        "device": device_name(),
        **env_tags(),
        **(tags or {}),
    }


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
    """One MLflow run for one stage run; FAILED if the body raises, KILLED on Ctrl-C or a stop
    request (SIGTERM). `system_metrics` samples CPU, memory (and GPU, with nvidia-ml-py) in the
    background. With a tracking server, records are buffered and the end waits a bounded time
    for them (see the module docstring)."""
    if not enabled:
        yield NullRun()
        return
    from gptforge.runtime.recording import journal_run, runs_journal

    journal = runs_journal()
    if journal is not None:  # a recorded stage: its runs are records, the recorder makes them
        with journal_run(
            journal, name=stage, params=params, tags=run_tags(stage, tags), system_metrics=system_metrics
        ) as run:
            yield run
        return
    try:
        mlflow = _import_mlflow()
    except ImportError:
        log.warning("mlflow is not installed: this run is not tracked")
        yield NullRun()
        return
    uri = tracking_uri()
    server = uri.startswith(("http://", "https://"))
    if server:
        for name, value in HTTP_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
    mlflow.set_tracking_uri(uri)
    try:
        if mlflow.get_experiment_by_name(experiment) is None:
            location = artifact_location(uri)
            with contextlib.suppress(Exception):  # another process may create it at the same moment
                mlflow.create_experiment(experiment, artifact_location=location)
        mlflow.set_experiment(experiment)
    except Exception as e:
        if server and retryable(e):  # down at the start: say so in one line, not a retry traceback
            from gptforge.errors import StageFailed

            raise StageFailed(
                f"MLflow tracking server at {uri} is unreachable; start it, or set "
                f"tracking.enabled=false ({describe_failure(e)})"
            ) from e
        raise

    all_tags = run_tags(stage, tags)
    parent = os.environ.get(PARENT_ENV) or None
    # System metrics by our sampler, not MLflow's (see start_system_metrics); MLflow's switch
    # (MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING) still turns them on for every stage.
    from mlflow.environment_variables import MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING

    active = mlflow.start_run(run_name=stage, parent_run_id=parent, nested=parent is not None, log_system_metrics=False)
    run = MlflowRun(mlflow, active, uri=uri, buffered=server)
    if system_metrics or MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING.get():
        run._monitor = start_system_metrics(run)
    status = "FINISHED"
    try:
        run.set_tags(all_tags)
        if params:
            run.log_params(params)
        yield run
    except BaseException as e:  # stopped (Ctrl-C, SIGTERM, Prefect's termination): KILLED; else FAILED
        from gptforge.runtime.signals import stop_cause

        status = "KILLED" if stop_cause(e) is not None else "FAILED"
        raise
    finally:
        status = "FAILED" if run.failed and status == "FINISHED" else status
        run.end(status, min(flush_seconds(), KILLED_FLUSH_SECONDS) if status == "KILLED" else flush_seconds())


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
    """The runs nested under `parent_run_id`, by their DVC stage (`dvc.stage`: prepare_base@NAME,
    finetune_instruct_variant@NAME), else their `gptforge.stage` tag: stage -> (run id, UI link).
    The newest run of a stage wins (a stage re-run inside one pipeline)."""
    try:
        mlflow = _import_mlflow()
        client = mlflow.tracking.MlflowClient(tracking_uri())
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(
            experiments,
            f"tags.mlflow.parentRunId = '{parent_run_id}'",
            order_by=["attributes.start_time ASC"],
            max_results=1000,
        )
    except Exception as e:  # tracking off, mlflow missing, or its store unreachable
        log.debug("no child runs of %s: %s", parent_run_id, e)
        return {}
    return {
        (r.data.tags.get("dvc.stage") or r.data.tags.get("gptforge.stage", r.info.run_name)): (
            r.info.run_id,
            run_url(r.info.run_id, r.info.experiment_id),
        )
        for r in runs
    }


def publish_metrics(run: NullRun, metrics: Mapping[str, float], path: str | os.PathLike) -> None:
    """A stage's final metrics: the DVC metrics file (flat JSON) and the same in its MLflow run."""
    from gptforge.io import write_json

    write_json(path, dict(metrics))
    run.log_metrics(metrics)
    run.log_artifact(path)
