"""The recorder: one long-lived process per working folder that turns the stages' journals into
MLflow runs and Prefect flow and task runs (`python -m flows.recorder`, in the working folder,
or forked there by the recorder host, flows/recorder_host.py).

Why: importing MLflow and Prefect, opening MLflow's SQLite store and registering a Prefect flow
run cost each stage process 2-9 s before its first line of work. A stage now only appends what
it has to record to a journal (`gptforge.runtime.journal`, whose docstring is the format) and
goes on; this process, started by the first stage that needs it and gone once idle, pays those
costs once and makes the records, journal by journal, oldest first, each in the order written.

Delivery is at least once: each journal's cursor (the byte offset and the records applied past
it) and the ids made so far are saved beside it (`KEY.state.json`) after every request, so a
recorder killed and started again goes on where it stopped; a record whose request reached the
server just before the kill may be applied again (flow runs, task runs and MLflow runs are not
made twice, see records_prefect and gptforge.runtime.records_mlflow; a log line or a metric may
be). A kill of the recorder costs nothing else: the journals stay on disk until delivered, and
the next stage that needs a recorder starts one. A journal is delivered when its `.jsonl` has
left `.gptforge/records/` (moved to `delivered/`, the newest 50 kept): after its `close`, or
once its writer is gone without one (a killed stage: its runs end KILLED / Crashed).

A server that cannot be reached (refused, timed out, 5xx, SQLite locked) holds only its own
journal, retried with a backoff of 1, 2, 4 ... 30 s, while the others go on; a record refused
for good (a 4xx, an invalid value) is logged in `.gptforge/recorder/recorder.log` and skipped.
Journals with Prefect on and no API URL go to the recorder's own Prefect server, started on
their first need or when `.gptforge/recorder/want-prefect` exists (its URL then in state.json).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import logging.handlers
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from flows.records_prefect import OwnServer
from gptforge.runtime.journal import RECORDER_DIR, RECORDS_DIR, Skip, Waiting, process_start, read_records

log = logging.getLogger("gptforge.recorder")

IDLE_ENV = "GPTFORGE_RECORDER_IDLE_SECONDS"
IDLE_SECONDS = 300.0
SERVER_TIMEOUT_ENV = "GPTFORGE_RECORDER_SERVER_TIMEOUT"
POLL_SECONDS = 0.2
MAX_BACKOFF = 30.0
KEEP_DELIVERED = 50
TURN_SECONDS = 1.0  # one journal's share of a pass, so that a long backlog does not hold the others
LOG_BYTES = 4 << 20
NO_OPEN_SECONDS = 3600.0  # a journal with no `open` (or no pid in it) this long unchanged is abandoned
KILLED_MESSAGE = "the stage process ended without closing its records: killed"
MLFLOW_KINDS = {"run_start", "params", "metrics", "tags", "artifact", "text", "hf_model", "run_end"}
PREFECT_KINDS = {"step_start", "step_retry", "step_end", "log", "artifact_md"}
BATCHED = {"params", "metrics", "tags"}
GROUP_MAX = 500


def transient(e: BaseException) -> bool:
    """Whether applying again may succeed: the server unreachable or timing out, a 5xx, 408 or
    429, a SQLite store locked, a full disk. Anything else fails the same way again. The whole
    cause/context chain is looked at (MLflow and Prefect wrap what the transport raised)."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    httpx = sys.modules.get("httpx")
    for x in chain:
        if isinstance(x, (ConnectionError, TimeoutError, Waiting)):
            return True
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "database is locked" in str(x):
            return True
        if httpx is not None and isinstance(x, httpx.TransportError):
            return True
        status = getattr(getattr(x, "response", None), "status_code", None)
        if httpx is not None and isinstance(x, httpx.HTTPStatusError) and isinstance(status, int):
            return status >= 500 or status in (408, 429)
    if "mlflow" in sys.modules:
        from gptforge.runtime.tracking import retryable

        return retryable(chain[0])
    return False


def write_json(path: Path, data: dict) -> None:
    """Atomically (a temporary file beside it, then a rename) but without gptforge.io's fsync: the
    cursor is written after every request, and losing its last write costs a repeat, not a record."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, default=str), encoding="utf-8")
    os.replace(tmp, path)


def writer_alive(pid, pid_start) -> bool:
    """Whether the journal's writer still runs: pid `pid`, started at `pid_start` (a later
    process that got the same pid is not it), and not a zombie."""
    if not pid:
        return True
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError, ValueError):
        return False
    if stat[0] in ("Z", "X"):
        return False
    started = process_start(int(pid))
    return started is not None and (pid_start is None or abs(started - float(pid_start)) < 0.5)


def read_journal(path: Path, offset: int) -> tuple[list[dict], int]:
    """`read_records`, except that a line that is not JSON (a damaged file) is logged and passed
    over instead of stopping the journal for good."""
    return read_records(
        path,
        offset,
        on_bad_line=lambda line: log.warning(
            "journal %s: a line that is not JSON passed over: %.200r", path.name, line
        ),
    )


class Delivery:
    """One journal: its cursor and ids (`state`, saved beside it), its pending records, backoff."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.key = path.name[: -len(".jsonl")]
        self.files = path.with_name(f"{self.key}.files")
        self.state_path = path.with_name(f"{self.key}.state.json")
        fresh = {
            "key": self.key,
            "offset": 0,
            "done": 0,
            "open": None,
            "runs": {},
            "ended_runs": [],
            "tasks": {},
            "ended_steps": [],
            "closed": False,
        }
        try:
            self.state = {**fresh, **json.loads(self.state_path.read_text(encoding="utf-8"))}
        except FileNotFoundError:
            self.state = fresh
        except ValueError:
            log.warning("journal %s: its state file is damaged: delivered again from the start", self.key)
            self.state = fresh
        self.batch: list[dict] = []  # the records read from state["offset"] on
        self.batch_end = self.state["offset"]
        self.failures = 0
        self.next_try = 0.0
        self.skipped = 0

    def save(self) -> None:
        write_json(self.state_path, self.state)

    def pending(self) -> list[dict]:
        return self.batch[self.state["done"] :]

    def read(self) -> bool:
        """Read what the writer appended; True when there is something to apply."""
        if self.pending():
            return True
        try:
            if self.path.stat().st_size <= self.state["offset"]:
                return False
        except FileNotFoundError:
            return False
        records, self.batch_end = read_journal(self.path, self.state["offset"])
        self.batch = [r for r in records if isinstance(r, dict)]
        return bool(self.pending())

    def applied(self, n: int) -> None:
        self.state["done"] += n
        if self.state["done"] >= len(self.batch):
            self.state["offset"], self.state["done"], self.batch = self.batch_end, 0, []
        self.save()

    def skip(self, record: dict, e: BaseException) -> None:
        self.skipped += 1
        if self.skipped <= 20:
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            log.warning("journal %s: %s record skipped (refused for good): %s", self.key, record.get("kind"), reason)
        elif self.skipped == 21:
            log.warning("journal %s: more records skipped (not logged one by one)", self.key)


class Recorder:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.records = root / RECORDS_DIR
        self.folder = root / RECORDER_DIR
        self.delivered = self.records / "delivered"
        self.idle_seconds = _seconds(IDLE_ENV, IDLE_SECONDS)
        self.server = OwnServer(self.folder, _seconds(SERVER_TIMEOUT_ENV, 90.0), self._server_url)
        self.deliveries: dict[str, Delivery] = {}
        self.mlflow = None
        self.prefect = None
        self.stopping = threading.Event()
        self.started = time.time()
        self.last_activity = time.monotonic()
        self._last_sweep = 0.0
        self.holding = False  # the folder's lock

    # ------------------------------------------------------------------ life

    def run(self) -> int:
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = open(self.folder / "lock", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0  # another recorder serves this folder
        self.holding = True
        _setup_logging(self.folder / "recorder.log")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        self._write_state(None)
        log.info("recorder %d started in %s", os.getpid(), self.root)
        try:
            while True:
                while not self.stopping.is_set():
                    busy = self.step()
                    if self.idle():
                        log.info("idle for %.0f s with nothing pending: exiting", self.idle_seconds)
                        break
                    self.stopping.wait(0 if busy else POLL_SECONDS)
                if self.stopping.is_set() or not self._hand_back(lock):
                    break
        except Exception:
            log.exception("recorder failed")
            raise
        finally:
            self.server.stop()
            if self.prefect is not None:
                self.prefect.close()
            if self.holding:
                with contextlib.suppress(FileNotFoundError):
                    (self.folder / "state.json").unlink()
            log.info("recorder %d exits", os.getpid())
            lock.close()
        return 0

    def _hand_back(self, lock) -> bool:
        """Idle: let go of the folder, then look once more. A stage that wrote its journal while
        the lock was still held took it for a running recorder and started none: its journal
        is served here (the lock taken again), unless another recorder has the folder now.
        (The stage side: write the journal first, then look at the lock.)"""
        with contextlib.suppress(FileNotFoundError):
            (self.folder / "state.json").unlink()
        self.holding = False
        fcntl.flock(lock, fcntl.LOCK_UN)
        if not (any(self.records.glob("*.jsonl")) or self.want_prefect()):
            return False
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        self.holding = True
        self._write_state(self.server.url)
        self.last_activity = time.monotonic()
        log.info("a journal came while exiting: going on")
        return True

    def _write_state(self, url: str | None) -> None:
        if self.holding:
            write_json(
                self.folder / "state.json", {"pid": os.getpid(), "started": self.started, "prefect_api_url": url}
            )

    def _server_url(self, url: str | None) -> None:
        self._write_state(url)

    def want_prefect(self) -> bool:
        """`want-prefect` asks for the server; with a pid in it (JSON `{"pid": N, "pid_start": S}`)
        only while that process runs; without one, a file touched in the last idle period."""
        path = self.folder / "want-prefect"
        try:
            text = path.read_text(encoding="utf-8").strip()
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return False
        try:
            asker = json.loads(text) if text else {}
        except ValueError:
            asker = {}
        if isinstance(asker, dict) and asker.get("pid"):
            return writer_alive(asker.get("pid"), asker.get("pid_start"))
        return time.time() - mtime < self.idle_seconds

    def idle(self) -> bool:
        if any(self.records.glob("*.jsonl")) or self.want_prefect():
            self.last_activity = time.monotonic()
            return False
        return time.monotonic() - self.last_activity >= self.idle_seconds

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """One pass over the journals, oldest first; True when one has more to apply at once."""
        if self.want_prefect():
            self.server.want()
        self.server.poll()
        busy = False
        paths = sorted(self.records.glob("*.jsonl"))
        for path in paths:
            if self.stopping.is_set():
                break
            d = self.deliveries.get(path.name)
            if d is None:
                d = self.deliveries[path.name] = Delivery(path)
            if time.monotonic() < d.next_try:
                continue
            try:
                busy |= self.pump(d)
            except Waiting:
                pass
            except Exception as e:  # noqa: BLE001 - a server away (transient) or a bug: retried
                d.failures += 1
                delay = min(MAX_BACKOFF, 2.0 ** (d.failures - 1))
                d.next_try = time.monotonic() + delay
                away = transient(e)
                log.warning(
                    "journal %s: %s (%s); retried in %.0f s",
                    d.key,
                    "unreachable" if away else "failed",
                    _describe(e),
                    delay,
                    exc_info=not away,
                )
                self._drop_clients(d)
        names = {p.name for p in paths}
        for name in [n for n in self.deliveries if n not in names]:
            del self.deliveries[name]
        if time.monotonic() - self._last_sweep > 60:
            self._last_sweep = time.monotonic()
            self.sweep()
        return busy

    def pump(self, d: Delivery) -> bool:
        """Apply what `d` has, for at most TURN_SECONDS (True: more is left); deliver it when it is
        closed or abandoned. Raises on a failure worth retrying (the cursor stays on the record
        that failed)."""
        if self._drain(d, time.monotonic() + TURN_SECONDS):
            return True
        if not d.state["closed"] and self._abandoned(d):
            if self._drain(d, None):  # the writer is gone: all it wrote before it went, then its end
                return True
            if not d.state["closed"]:
                log.warning(
                    "journal %s: its writer (pid %s) is gone without a close: ending it as killed",
                    d.key,
                    (d.state["open"] or {}).get("pid"),
                )
                at = max(_mtime(d.path), d.state.get("last_time") or 0.0)
                self._close(d, {"kind": "close", "state": "CRASHED", "message": KILLED_MESSAGE, "time": at})
                d.save()
        if d.state["closed"]:
            self.deliver(d)
        return False

    def _drain(self, d: Delivery, deadline: float | None) -> bool:
        """Apply the pending records of `d`; True when stopped by `deadline` or a stop request."""
        while d.read():
            self.last_activity = time.monotonic()
            while d.pending():
                if self.stopping.is_set() or (deadline is not None and time.monotonic() > deadline):
                    return True
                group = _group(d.pending())
                self.apply(d, group)
                d.failures = 0
                d.applied(len(group))
        return False

    def apply(self, d: Delivery, group: list[dict]) -> None:
        """Apply one group; a group refused for good is applied again record by record, and a
        record refused for good is skipped (logged)."""
        try:
            self._apply(d, group)
        except Exception as e:
            if transient(e):
                raise
            if len(group) == 1:
                d.skip(group[0], e)
                return
            for record in group:
                try:
                    self._apply(d, [record])
                except Exception as one:
                    if transient(one):
                        raise
                    d.skip(record, one)

    def _apply(self, d: Delivery, group: list[dict]) -> None:
        first = group[0]
        kind = first.get("kind")
        state = d.state
        if state["closed"]:
            return  # nothing comes after `close`
        state["last_time"] = max(state.get("last_time") or 0.0, float(group[-1].get("time") or 0.0))
        if kind == "open":
            if state["open"] is None:
                state["open"] = first
                d.save()
            if _prefect_on(state):
                self._prefect().apply(d, self._prefect_url(state), group)
        elif state["open"] is None:
            raise Skip(f"{kind} record before the journal's open")
        elif kind == "close":
            self._close(d, first)
        elif kind in MLFLOW_KINDS:
            if _mlflow_on(state):
                self._mlflow().apply(d, group)
        elif kind in PREFECT_KINDS:
            if _prefect_on(state):
                self._prefect().apply(d, self._prefect_url(state), group)
        else:
            raise Skip(f"unknown record kind {kind!r}")

    def _close(self, d: Delivery, record: dict) -> None:
        """The journal's end: MLflow runs still open ended, then the Prefect side settled."""
        state = d.state
        name, message = record.get("state") or "COMPLETED", record.get("message")
        at = float(record.get("time") or time.time())
        parts = []
        if state["open"] is not None and _mlflow_on(state) and state["runs"]:
            parts.append(lambda: self._mlflow().finish(d, name, at))
        if state["open"] is not None and _prefect_on(state):
            parts.append(lambda: self._prefect().finish(d, self._prefect_url(state), name, message))
        for part in parts:  # a side refused for good does not keep the journal open
            try:
                part()
            except Exception as e:
                if transient(e):
                    raise
                d.skip(record, e)
        state["closed"] = True

    # ------------------------------------------------------------------ the sinks

    def _mlflow(self):
        if self.mlflow is None:
            from gptforge.runtime.records_mlflow import MlflowSink

            self.mlflow = MlflowSink(transient)
        return self.mlflow

    def _prefect(self):
        if self.prefect is None:
            from flows.records_prefect import PrefectSink

            self.prefect = PrefectSink()
        return self.prefect

    def _prefect_url(self, state: dict) -> str:
        url = (state["open"].get("prefect") or {}).get("api_url")
        if url:
            return url
        self.server.want()
        if self.server.url is None:
            raise Waiting("the recorder's own Prefect server is starting")
        return self.server.url

    def _drop_clients(self, d: Delivery) -> None:
        """After a failure, the journal's Prefect client starts afresh next time."""
        if self.prefect is not None and d.state["open"] is not None and _prefect_on(d.state):
            url = (d.state["open"].get("prefect") or {}).get("api_url") or self.server.url
            if url:
                self.prefect.drop(url)

    # ------------------------------------------------------------------ the end of a journal

    def _abandoned(self, d: Delivery) -> bool:
        opened = d.state["open"]
        if opened is None or not opened.get("pid"):
            return time.time() - _mtime(d.path) > NO_OPEN_SECONDS
        return not writer_alive(opened.get("pid"), opened.get("pid_start"))

    def deliver(self, d: Delivery) -> None:
        """Delivered: the .jsonl moved to delivered/ (the moment that counts), then its files
        and state removed; the newest KEEP_DELIVERED journals kept there."""
        self.delivered.mkdir(parents=True, exist_ok=True)
        os.replace(d.path, self.delivered / d.path.name)
        shutil.rmtree(d.files, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            d.state_path.unlink()
        self.deliveries.pop(d.path.name, None)
        self.last_activity = time.monotonic()
        log.info("journal %s delivered", d.key)
        for old in sorted(self.delivered.glob("*.jsonl"))[:-KEEP_DELIVERED]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()

    def sweep(self) -> None:
        """Files and states left by a recorder killed between moving a journal and removing
        them (their journal is in delivered/), or with no journal for an hour."""
        for path in list(self.records.glob("*.state.json")) + list(self.records.glob("*.files")):
            key = path.name[: -len(".state.json")] if path.name.endswith(".state.json") else path.name[: -len(".files")]
            if (self.records / f"{key}.jsonl").exists():
                continue
            if (self.delivered / f"{key}.jsonl").exists() or time.time() - _mtime(path) > NO_OPEN_SECONDS:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()


def _group(records: list[dict]) -> list[dict]:
    """The next group to send together: consecutive params/metrics/tags of one run, or
    consecutive log lines; anything else alone."""
    first = records[0]
    kind = first.get("kind")
    if kind not in BATCHED and kind != "log":
        return [first]
    group = [first]
    for record in records[1:GROUP_MAX]:
        if kind == "log" and record.get("kind") == "log":
            group.append(record)
        elif kind in BATCHED and record.get("kind") in BATCHED and record.get("run") == first.get("run"):
            group.append(record)
        else:
            break
    return group


def _mlflow_on(state: dict) -> bool:
    conf = state["open"].get("mlflow") or {}
    return bool(conf.get("enabled") and conf.get("uri"))


def _prefect_on(state: dict) -> bool:
    return bool((state["open"].get("prefect") or {}).get("enabled"))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name) or default)
    except ValueError:
        return default
    return value if value >= 0 else default


def _describe(e: BaseException) -> str:
    from gptforge.runtime.tracking import describe_failure

    return describe_failure(e)


def _setup_logging(path: Path) -> None:
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_BYTES, backupCount=1, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("gptforge")  # the recorder's lines and tracking's warnings
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main() -> int:
    return Recorder(Path.cwd()).run()


if __name__ == "__main__":
    sys.exit(main())
