"""The processes and servers the tests start, and waiting on them.

`free_port` and `wait_http` for a server on 127.0.0.1; `prefect_home` a PREFECT_HOME whose
database is already migrated; `started` runs a command in its own process group and kills what
it left, `stop_process` ends a server's group; `wait_until` and `logged` wait for a condition and
fail if the process ended first; `Paused` holds a run at a step (gptforge.runtime.pause);
`processes_in` and `records_delivered` check what a stopped run left in its folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from cli_support import BIN


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


# The folder every xdist worker of this run shares: set by conftest.py's `_shared_tmp` fixture.
_SHARED_TMP: list[Path] = []


def prefect_home(folder: Path) -> Path:
    """`folder` as a PREFECT_HOME whose database has every migration applied: a copy of one made
    once per run for all workers (`prefect server database upgrade`), since migrations are ~6 s
    of a fresh server's ~9 s start. A fresh clone's first start (migrations included) is what
    benchmarks/bench_startup.py and bench_make_run.py time."""
    root = _SHARED_TMP[0]
    template = root / "prefect-template" / "prefect.db"
    with open(root / "prefect-template.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            work = root / "prefect-template.tmp"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            env = {**os.environ, "PREFECT_HOME": str(work)}
            env.pop("PREFECT_API_URL", None)
            subprocess.run(
                [str(BIN / "prefect"), "server", "database", "upgrade", "-y"],
                env=env,
                check=True,
                capture_output=True,
                timeout=300,
            )
            work.rename(template.parent)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, folder / "prefect.db")
    return folder


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def processes_in(folder: Path) -> list[str]:
    """The command lines of the processes (other than this one) whose working directory is
    `folder`, but for the folder's recorder and its children: it outlives the stages by design
    (runtime/recording.py) and leaves when idle."""
    import psutil

    found, recorders = [], set()
    for p in psutil.process_iter(["pid", "cwd", "cmdline"]):
        try:
            if {"flows.recorder", "flows.recorder_host"} & set(p.info["cmdline"] or []):
                recorders.add(p.pid)
                recorders.update(c.pid for c in p.children(recursive=True))
            elif p.info["cwd"] and Path(p.info["cwd"]).resolve() == folder.resolve() and p.pid != os.getpid():
                found.append((p.pid, " ".join(p.info["cmdline"] or [])))
        except (psutil.Error, OSError):
            pass
    return [cmd for pid, cmd in found if pid not in recorders]


def records_delivered(folder: Path, within: float = 120.0) -> None:
    """Until the recorder has delivered every journal of `folder` (a stopped stage does not wait
    for it; GPTFORGE_WAIT_FOR_RECORDS makes the others do)."""
    deadline = time.monotonic() + within
    records = folder / ".gptforge" / "records"
    while list(records.glob("*.jsonl")):
        log = folder / ".gptforge" / "recorder" / "recorder.log"
        assert time.monotonic() < deadline, (
            f"journals not delivered within {within:.0f} s: "
            f"{(log.read_text() if log.exists() else '(no recorder log)')[-3000:]}"
        )
        time.sleep(0.1)


def wait_until(condition, proc: subprocess.Popen, log: Path, what: str, within: float = 300.0, alive=None) -> None:
    """Until `condition()` holds; fails if `proc` (or what `alive()` watches) ends first, showing
    the end of `log`. `within` is a bound against a hang only (a command starting under load:
    imports, Prefect, MLflow)."""
    deadline = time.monotonic() + within
    alive = alive or (lambda: proc.poll() is None)
    while not condition():
        assert alive(), f"ended (exit {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not {what} within {within:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def logged(log: Path, text: str):
    return lambda: text in log.read_text()


@contextlib.contextmanager
def started(args: list[str], cwd: Path, env: dict, log: Path) -> Iterator[subprocess.Popen]:
    """`args` running in its own process group, output to `log` (a paused run is not read from
    while it waits); on the way out whatever it started that still runs is killed (its group,
    and processes it put in groups of their own: dvc under the pipeline, torchrun's workers) and
    the command reaped, so a failed test leaves no run behind, paused or not."""
    import psutil

    from gptforge.runtime.signals import group_alive

    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Paused:
    """A run (pretraining or the serve engine) held after step `step` (gptforge.runtime.pause): `env()`
    goes into the run's environment, `wait(proc)` returns once the loop is paused there (or
    fails if the process ended first), `release()` lets it go on. Tests act on a paused run
    instead of racing the machine's speed."""

    def __init__(self, folder: Path, step: int) -> None:
        self.path, self.step = Path(folder) / f"paused-at-{step}", step

    def env(self) -> dict[str, str]:
        return {"GPTFORGE_PAUSE_AT_STEP": str(self.step), "GPTFORGE_PAUSE_FILE": str(self.path)}

    def wait(self, proc: subprocess.Popen, timeout: float = 600, output=lambda: "") -> None:
        # A bound against a hang only: a run under load may need minutes to reach its step.
        deadline = time.monotonic() + timeout
        while not self.path.is_file():
            assert proc.poll() is None, f"ended (exit {proc.returncode}) before step {self.step}:\n{output()[-3000:]}"
            assert time.monotonic() < deadline, f"not paused at step {self.step} within {timeout:.0f} s"
            time.sleep(0.05)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

    def release_once_taken(self, proc: subprocess.Popen, log: Path, within: float = 30.0, alive=None) -> None:
        """After a stop signal sent to the paused run: once its loop has taken it (the handler
        logs "stopping after this step"), release it, so it stops after the next step. `within`:
        the stop bound users expect; `alive` for a run that may outlive `proc` (a stage under dvc)."""
        wait_until(logged(log, "stopping after this step"), proc, log, "taking the signal", within, alive)
        self.release()
