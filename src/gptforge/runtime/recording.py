"""A stage process's records through its journal: the writer's side of `gptforge.runtime.journal`.

`recorded(...)` wraps one stage run: it opens the journal (the `open` record says where the
records go: the MLflow store and experiment, the Prefect API, the pipeline's runs to nest
under), makes sure the recorder runs in this folder (gptforge.runtime.recorder_launch starts one,
detached, when none holds the folder's lock), sends the `gptforge` logger's lines to the journal,
and ends with the `close` record. Inside it:

- `tracking.start_run` gives a `JournalRun` (the stage's MLflow run and any run nested in it,
  as `run_*` records) instead of talking to MLflow;
- `JournalSteps` runs each recipe step as the plain `Steps` do (retries included) and records
  it as a Prefect task run (`step_*` records), so the Prefect UI shows the same flow run with
  its task runs and logs as when the stage ran inside Prefect's engine.

`GPTFORGE_WAIT_FOR_RECORDS=SECONDS` makes a stage that ends (not one that is stopped) wait up to
that long for the recorder to deliver its journal before the command returns, for scripts
that read MLflow or Prefect right after it.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

from gptforge.runtime.journal import RECORDER_DIR, RECORDS_DIR, Journal, new_key, process_start
from gptforge.runtime.recorder_launch import start_recorder
from gptforge.runtime.steps import Retry, Steps

log = logging.getLogger("gptforge")
T = TypeVar("T")

# The pipeline's Prefect flow run, handed to the stages `dvc repro` starts under it.
PIPELINE_FLOW_ENV = "GPTFORGE_PIPELINE_FLOW_RUN_ID"
PIPELINE_JOURNAL_ENV = "GPTFORGE_PIPELINE_JOURNAL"  # the key of a typed pipeline's journal (its flow run)
# A launcher's journal, handed to its torchrun workers: rank 0 records the stage's MLflow run in it.
JOURNAL_ENV = "GPTFORGE_JOURNAL"
WAIT_ENV = "GPTFORGE_WAIT_FOR_RECORDS"

_current: Journal | None = None  # the journal that MLflow runs go to (None: tracking talks to MLflow)
_runs: list["JournalRun"] = []  # the open runs, innermost last: a new run nests under the last
_step: contextvars.ContextVar[str | None] = contextvars.ContextVar("gptforge_step", default=None)


def runs_journal() -> Journal | None:
    """The journal that `tracking.start_run` records into, or None."""
    return _current


# ---------------------------------------------------------------------------------------------
# MLflow runs as records


class JournalRun:
    """A stage's MLflow run (or one nested in it) as journal records; the interface of
    `tracking.NullRun`. It has no MLflow run id: the recorder makes the run."""

    run_id = None
    uri = None

    def __init__(self, journal: Journal, key: str) -> None:
        self.journal, self.key, self.failed = journal, key, False

    def log_params(self, params: Mapping[str, Any]) -> None:
        from gptforge.runtime.mlflow_values import clean_params

        if clean := clean_params(params):
            self.journal.write("params", run=self.key, params=clean)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from gptforge.runtime.mlflow_values import clean_metrics

        if clean := clean_metrics(metrics):
            self.journal.write("metrics", run=self.key, metrics=clean, step=step, timestamp=int(time.time() * 1000))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        path = Path(path)
        if not path.exists():
            return
        is_dir = path.is_dir()
        self.journal.write(
            "artifact",
            run=self.key,
            path=self.journal.keep_file(path),
            is_dir=is_dir,
            artifact_path=artifact_path or (path.name if is_dir else None),
        )

    def log_text(self, text: str, name: str) -> None:
        self.journal.write("text", run=self.key, name=name, text=text)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if clean := {k: str(v) for k, v in tags.items() if v is not None}:
            self.journal.write("tags", run=self.key, tags=clean)

    def log_hf_model(self, folder: str | os.PathLike, name: str = "model", **flavor_kwargs: Any) -> str | None:
        """Logged by the recorder from `folder` (MLflow's transformers flavor); no URI here."""
        self.journal.write(
            "hf_model", run=self.key, folder=str(Path(folder).resolve()), name=name, flavor_kwargs=flavor_kwargs
        )
        return None

    def mark_failed(self) -> None:
        self.failed = True

    def flush(self, timeout: float | None = None) -> bool:
        return True


_run_keys = itertools.count(1)


@contextlib.contextmanager
def journal_run(
    journal: Journal, *, name: str, params: Mapping[str, Any] | None, tags: Mapping[str, Any], system_metrics: bool
) -> Iterator[JournalRun]:
    """One MLflow run as records: the stage's own ("main"), or nested under the innermost open one."""
    from gptforge.runtime.signals import stop_cause

    key = "main" if not _runs else f"run-{next(_run_keys)}"
    journal.write(
        "run_start",
        run=key,
        name=name,
        parent=_runs[-1].key if _runs else None,
        tags={k: str(v) for k, v in tags.items() if v is not None},
    )
    run = JournalRun(journal, key)
    _runs.append(run)
    monitor = None
    if system_metrics:
        from gptforge.runtime.run_context import start_system_metrics

        monitor = start_system_metrics(run)
    status = "FINISHED"
    try:
        if params:
            run.log_params(params)
        yield run
    except BaseException as e:
        status = "KILLED" if stop_cause(e) is not None else "FAILED"
        raise
    finally:
        if monitor is not None:
            monitor.finish()
        _runs.remove(run)
        journal.write("run_end", run=key, status="FAILED" if run.failed and status == "FINISHED" else status)


# ---------------------------------------------------------------------------------------------
# Prefect task runs as records


class JournalSteps(Steps):
    """Each step runs as with the plain `Steps` (retries and all) and is recorded as a task run."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self._keys = itertools.count(1)

    def __call__(self, fn: Callable[..., T], /, *args: Any, retry: Retry | None = None, **kwargs: Any) -> T:
        from gptforge.runtime.signals import stop_cause

        key = f"step-{next(self._keys)}"
        self.journal.write("step_start", step=key, name=fn.__name__.replace("_", "-"))
        token = _step.set(key)
        try:
            result = super().__call__(fn, *args, retry=retry, **kwargs)
        except BaseException as e:
            state = "CRASHED" if stop_cause(e) is not None else "FAILED"
            self.journal.write("step_end", step=key, state=state, message=f"{type(e).__name__}: {e}")
            raise
        finally:
            _step.reset(token)
        self.journal.write("step_end", step=key, state="COMPLETED", message=None)
        return result

    def retrying(self, fn: Callable, error: Exception, attempt: int, retries: int, delay: float) -> None:
        super().retrying(fn, error, attempt, retries, delay)
        self.journal.write(
            "step_retry", step=_step.get(), attempt=attempt, delay=delay, message=f"{type(error).__name__}: {error}"
        )


class _ToJournal(logging.Handler):
    """The `gptforge` logger's lines, for the flow run's (or the current task run's) logs."""

    def __init__(self, journal: Journal) -> None:
        super().__init__(logging.INFO)
        self.journal = journal

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.journal.write(
                "log", step=_step.get(), level=record.levelno, logger=record.name, message=record.getMessage()
            )
        except Exception:  # noqa: BLE001 - a log line never fails the stage
            self.handleError(record)


# ---------------------------------------------------------------------------------------------
# A recorded stage run


def mlflow_target(experiment: str) -> dict[str, Any]:
    from gptforge.runtime.mlflow_values import PARENT_ENV, artifact_location, tracking_uri

    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///") :].split("?", 1)[0]).resolve())
    return {
        "enabled": True,
        "uri": uri,
        "experiment": experiment,
        "artifact_location": artifact_location(uri),
        "parent_run_id": os.environ.get(PARENT_ENV) or None,
    }


@contextlib.contextmanager
def recorded(
    *,
    stage: str,
    flow_name: str,
    summary: str,
    parameters: Mapping[str, Any],
    prefect: bool,
    mlflow: bool,
    experiment: str | None = None,
    folder: str | os.PathLike = RECORDS_DIR,
) -> Iterator[JournalSteps | None]:
    """Around one stage run: its journal open, the recorder running, its log lines recorded.
    Yields the steps to run the recipe with (task runs) when Prefect records it, else None.
    `experiment` is the MLflow experiment of a run with `mlflow`."""
    global _current
    from gptforge.errors import GptforgeError
    from gptforge.runtime.signals import stop_cause, stop_signal

    journal = Journal(folder, new_key(stage))
    journal.write(
        "open",
        stage=stage,
        flow_name=flow_name,
        summary=summary,
        parameters=dict(parameters),
        pid=os.getpid(),
        pid_start=process_start(os.getpid()),
        cwd=os.getcwd(),
        prefect={
            "enabled": prefect,
            "api_url": os.environ.get("PREFECT_API_URL") or None,
            "parent_flow_run_id": os.environ.get(PIPELINE_FLOW_ENV) or None,
            "parent_journal": os.environ.get(PIPELINE_JOURNAL_ENV) or None,
        },
        mlflow=mlflow_target(experiment) if mlflow else {"enabled": False},
    )
    ensure_recorder(Path(folder).parent.parent)
    handler = _ToJournal(journal) if prefect else None
    if handler is not None:
        log.addHandler(handler)
    previous, _current = _current, (journal if mlflow else None)
    old_env = os.environ.get(JOURNAL_ENV)
    if mlflow:
        os.environ[JOURNAL_ENV] = str(journal.path.resolve())
    state, message, code, stopped = "COMPLETED", None, 0, False
    try:
        yield JournalSteps(journal) if prefect else None
    except BaseException as e:
        stop = stop_cause(e)
        stopped = stop is not None or isinstance(e, KeyboardInterrupt)
        state = "CRASHED" if stopped else "FAILED"
        message = " ".join(f"{type(e).__name__}: {e}".split())
        signum = stop_signal(stop) if stop is not None else None
        code = (128 + signum if signum else 130) if stopped else (e.exit_code if isinstance(e, GptforgeError) else 1)
        raise
    finally:
        _current = previous
        if old_env is None:
            os.environ.pop(JOURNAL_ENV, None)
        else:
            os.environ[JOURNAL_ENV] = old_env
        if handler is not None:
            log.removeHandler(handler)
        journal.write("close", state=state, message=message, exit_code=code)
        journal.close()
        if not stopped:
            wait = float(os.environ.get(WAIT_ENV) or 0)
            if wait > 0 and not wait_delivered([journal.path], wait):
                log.warning(
                    "the recorder has not delivered %s within %g s; it goes on in the background", journal.path, wait
                )


def own_prefect_url(root: str | os.PathLike = ".") -> str | None:
    """The API URL of the recorder's own Prefect server in `root` when it has one up (no wait)."""
    import json

    with contextlib.suppress(OSError, ValueError):
        return json.loads((Path(root) / RECORDER_DIR / "state.json").read_text()).get("prefect_api_url") or None
    return None


@contextlib.contextmanager
def attached() -> Iterator[None]:
    """In a torchrun worker: rank 0 records the stage's MLflow run in its launcher's journal."""
    global _current
    path = os.environ.get(JOURNAL_ENV)
    if not path or int(os.environ.get("RANK", "0")) != 0 or not Path(path).is_file():
        yield
        return
    journal = Journal(Path(path).parent, Path(path).stem)
    previous, _current = _current, journal
    try:
        yield
    finally:
        _current = previous
        journal.close()


# ---------------------------------------------------------------------------------------------
# The recorder process


def recorder_running(root: str | os.PathLike = ".") -> bool:
    """Whether a recorder holds this folder's lock (it holds it for its whole life)."""
    lock = Path(root) / RECORDER_DIR / "lock"
    if not lock.exists():
        return False
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def ensure_recorder(root: str | os.PathLike = ".") -> None:
    """Start the recorder for this folder unless one runs (gptforge.runtime.recorder_launch:
    forked by the recorder host, or a process of its own). Two stages starting one at the same
    moment is fine: the second recorder finds the lock taken and exits."""
    root = Path(root)
    if recorder_running(root):
        return
    (root / RECORDER_DIR).mkdir(parents=True, exist_ok=True)
    start_recorder(root)


def wait_delivered(paths: list[Path], timeout: float) -> bool:
    """Until the recorder has delivered these journals (they leave the records folder)."""
    deadline = time.monotonic() + timeout
    while any(Path(p).exists() for p in paths):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def pending(root: str | os.PathLike = ".") -> list[Path]:
    """The journals of this folder not delivered yet, but for the journal of the pipeline this
    process runs in or under (GPTFORGE_PIPELINE_JOURNAL): it stays open while its stages run."""
    pipeline = os.environ.get(PIPELINE_JOURNAL_ENV)
    return [p for p in sorted((Path(root) / RECORDS_DIR).glob("*.jsonl")) if p.stem != pipeline]


def answers(api_url: str, timeout: float = 3.0) -> bool:
    """Whether the Prefect API at `api_url` answers its health check within `timeout`."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - refused, timed out, an error status: it does not answer
        return False


def flow_run_of(journal: Journal, timeout: float) -> dict[str, str]:
    """The tags that name a journal's Prefect flow run (`prefect.flow_run_id`, `..._name`), once
    the recorder has made it (bounded wait; {} when it has not), for a stage whose MLflow run is
    made in the process and so cannot be tagged by the recorder."""
    import json

    state = journal.folder / f"{journal.key}.state.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            made = json.loads(state.read_text())
            if made.get("flow_run_id"):
                return {"prefect.flow_run_id": made["flow_run_id"], "prefect.flow_run_name": made.get("flow_run_name")}
        time.sleep(0.05)
    return {}
