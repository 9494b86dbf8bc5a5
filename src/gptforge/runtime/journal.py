"""A stage's records (its MLflow run, its Prefect flow run) written to a journal on disk first.

Why: importing MLflow and Prefect, opening MLflow's SQLite store and registering a Prefect flow
run cost a stage process 2-9 s before its first line of work (benchmarks/bench_startup.py),
more than most data stages take for the work itself. A stage now appends what it has to record
to a journal, one JSON object per line, and goes on; the recorder (`flows/recorder.py`, one
process per working folder, started on first need and gone when idle) reads the journals and
makes the MLflow runs and the Prefect flow and task runs from them. Nothing is held in memory:
a line is in the file (the OS's page cache) once `write` returns, so a SIGKILL of the stage
loses nothing it wrote, and a recorder or a server that goes away delivers later, from the file.

Layout, under the working folder (`RECORDS_DIR`):

    .gptforge/records/KEY.jsonl      the journal of one stage run (KEY: time, stage, random)
    .gptforge/records/KEY.files/     the artifacts it logged, copied when logged (so a later change
                                     of the file is not seen; weights are hard-linked: `keep_file`)
    .gptforge/recorder/              the recorder's lock, state (its Prefect API URL) and log

The records (`kind`, `time` as Unix seconds, and the fields below). Lines are appended in the
order things happened; a last line without its newline was cut by a kill and is not a record.

- `open`: `stage`, `flow_name` (Prefect's flow name, `prepare-classify`), `summary`,
  `parameters` (the flow run's: `params`, `overrides`), `pid` and `pid_start` (the writer's
  process and its start time in seconds since boot: a journal whose writer is gone without a
  `close` ended in a kill), `cwd`, and
  `prefect`: `enabled`, `api_url` (None: the recorder's own local server), `parent_flow_run_id`
  (the pipeline's flow run, when the pipeline started the stage), and
  `mlflow`: `enabled`, `uri` (a `sqlite:///` URI is absolute), `experiment`, `artifact_location`
  (for a new experiment; None: the store's default), `parent_run_id` (the pipeline's MLflow run).
- MLflow (each names its `run`: "main" for the stage's run, other keys for runs the stage nests
  under it; `run_start` comes first for each):
  `run_start`: `run`, `name`, `parent` (None: the stage's run, a child of `mlflow.parent_run_id`
  when set; else the key of the run it nests under), `tags`;
  `params`: `run`, `params` (name -> string); `metrics`: `run`, `metrics` (name -> number),
  `step` (int or None), `timestamp` (ms); `tags`: `run`, `tags`;
  `artifact`: `run`, `path` (relative to the journal's `.files/` folder), `artifact_path`;
  `text`: `run`, `name`, `text`; `hf_model`: `run`, `folder` (absolute), `name`, `flavor_kwargs`;
  `run_end`: `run`, `status` (FINISHED, FAILED, KILLED).
- Prefect: `step_start`: `step` (a key unique in the journal), `name` (the task's name);
  `step_retry`: `step`, `attempt`, `delay`, `message`; `step_end`: `step`, `state` (COMPLETED,
  FAILED, CRASHED), `message`; `log`: `step` (None: the flow run's own), `level`, `logger`,
  `message`; `artifact_md`: `key`, `markdown`, `description`.
- `close`: `state` (COMPLETED, FAILED, CRASHED: a stop), `message`, `exit_code`. The last record.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

RECORDS_DIR = Path(".gptforge") / "records"
RECORDER_DIR = Path(".gptforge") / "recorder"
LINK_ABOVE = 8 * 2**20


class Skip(Exception):
    """A record that can never be applied (its run or flow run was never made, an unknown kind,
    a value a server refuses for good): the recorder logs it and goes on with the next."""


class Waiting(Exception):
    """A record that cannot be applied yet (the recorder's own Prefect server is starting, a
    parent journal's flow run is not made yet): the recorder tries again on its next pass."""


def process_start(pid: int) -> float | None:
    """When process `pid` started, in seconds since boot (Linux /proc), to tell it from a later
    process that got the same pid; None where /proc has no answer."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def new_key(stage: str) -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{stage}-{uuid.uuid4().hex[:8]}"


class Journal:
    """Appends records to `.gptforge/records/KEY.jsonl`, one `write` per line (O_APPEND), from
    any thread. Never raises on a record it cannot encode: values are made JSON-safe."""

    def __init__(self, folder: str | os.PathLike, key: str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.key = key
        self.path = self.folder / f"{key}.jsonl"
        self.files = self.folder / f"{key}.files"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        self.closed = False

    def write(self, kind: str, **fields: Any) -> None:
        line = (
            json.dumps({"kind": kind, "time": time.time(), **fields}, default=str, allow_nan=False, ensure_ascii=False)
            + "\n"
        )
        data = line.encode("utf-8")
        with self._lock:
            if self.closed:
                return
            while data:
                data = data[os.write(self._fd, data) :]

    def keep_file(self, path: str | os.PathLike) -> str:
        """A copy of `path` (file or folder) in the journal's files folder, as it is now;
        returns its path relative to that folder. Files up to `LINK_ABOVE` bytes are copied;
        larger ones (weights, which gptforge writes once into a temporary folder and renames
        into place, never rewriting them) are hard-linked where the file system allows, so a
        checkpoint costs no second copy on disk."""
        import shutil

        src = Path(path)
        rel = f"{uuid.uuid4().hex[:8]}/{src.name}"
        dst = self.files / rel
        dst.parent.mkdir(parents=True, exist_ok=True)

        def link_or_copy(a: str, b: str) -> None:
            if os.path.getsize(a) > LINK_ABOVE:
                try:
                    os.link(a, b)
                    return
                except OSError:
                    pass
            shutil.copy2(a, b)

        if src.is_dir():
            shutil.copytree(src, dst, copy_function=link_or_copy)
        else:
            link_or_copy(str(src), str(dst))
        return rel

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                os.close(self._fd)


def read_records(
    path: str | os.PathLike, offset: int = 0, on_bad_line: Callable[[bytes], None] | None = None
) -> tuple[list[dict], int]:
    """The complete records of a journal from byte `offset` on, and the offset after the last
    complete one (a cut last line is left for later, or for never). A line that is not JSON (a
    damaged file) raises ValueError, or goes to `on_bad_line` and is passed over."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if on_bad_line is None:
                raise
            on_bad_line(line)
    return records, offset + end
