"""One run at a time: advisory locks for the pipeline and for each stage.

Two trainers writing the same checkpoint folder, or two pipelines rewriting params.yaml under
each other, corrupt results without failing. A run holds an exclusive `flock` on
`.gptforge/locks/<name>.lock` in the working directory for its whole duration; the lock file
says who holds it. The kernel drops the lock when the holder dies (even by SIGKILL), so a
crashed run never blocks the next one. DVC's own lock (`.dvc/tmp/lock`, also an flock) is
probed the same way before the pipeline changes anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from gptforge.errors import GptforgeError

LOCK_DIR = Path(".gptforge") / "locks"
DVC_LOCK = Path(".dvc") / "tmp" / "lock"


_HELD: set[Path] = set()  # held by this process: holding again is a no-op (CLI, then its flow)


class Busy(GptforgeError):
    """Another run holds the lock: nothing was changed."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f" (pid {info.get('pid')} on {info.get('host')}, since {since}: {info.get('command', '?')})"


@contextlib.contextmanager
def hold(name: str, what: str, root: Path = Path(".")) -> Iterator[Path]:
    """Hold `.gptforge/locks/<name>.lock` or raise Busy naming its holder."""
    path = (root / LOCK_DIR / f"{name}.lock").resolve()
    if path in _HELD:
        yield path
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(
                f"{what} is already running in {root.resolve()}{_holder(path)}; "
                "wait for it to finish (or stop it) and run again"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "since": time.time(),
                    "command": " ".join(Path(sys.argv[0]).name.split() + sys.argv[1:]),
                }
            ).encode(),
        )
        _HELD.add(path)
        try:
            yield path
        finally:
            _HELD.discard(path)
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, but alive
        return True
    return True


def check_dvc_idle(root: Path = Path(".")) -> None:
    """Raise Busy when a DVC command runs in this repository (`dvc repro`, `dvc pull`...).

    `dvc repro` holds the repository lock (`.dvc/tmp/lock`) only around its bookkeeping; while a
    stage's command runs it holds read/write locks on the stage's files instead, listed with
    their pid in `.dvc/tmp/rwlock`. Both are checked (entries of dead processes are ignored,
    as DVC itself ignores them)."""
    rwlock = root / DVC_LOCK.parent / "rwlock"
    try:
        table = json.loads(rwlock.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        table = {}
    holders = list((table.get("write") or {}).values()) + [
        i for infos in (table.get("read") or {}).values() for i in infos
    ]
    for info in holders:
        if isinstance(info, dict) and isinstance(info.get("pid"), int) and _alive(info["pid"]):
            raise Busy(
                f"a DVC command is running in {root.resolve()} (pid {info['pid']}: {info.get('cmd', '?')}); "
                "wait for it to finish and run again"
            )
    path = root / DVC_LOCK
    if not path.exists():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = path.read_text(errors="replace").strip()
            raise Busy(
                f"a DVC command is running in {root.resolve()}"
                + (f" (pid {pid})" if pid else "")
                + "; wait for it to finish and run again"
            ) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
