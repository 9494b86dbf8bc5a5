"""dvc.lock kept in a folder that outlives the workspace, for workspaces that last one run.

A flow-run container starts from the image's workspace and is removed when its run ends, and
dvc.lock, where DVC records what each stage ran with, would go with it: the next run's DVC could
then restore from its run cache only the stages that cache can hold, and would run the others
(those with `persist: true` or `cache: false` outputs) again. With GPTFORGE_DVC_LOCK_DIR set (the
image sets /state, a volume of the compose file and of the pool templates), the pipeline starts
from the dvc.lock kept there and copies its own back as DVC updates it, stage by stage (a
watcher thread, once the file has stood still for a poll and parses), and once more when `dvc
repro` ends, finished or not: a container killed mid-stage keeps the stages finished before it.
A symlink would not do: DVC refuses a dvc.lock that is one. Unset, nothing changes: in a clone,
dvc.lock lives beside dvc.yaml under Git.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path
from typing import Iterator

from gptforge.errors import BadInput
from gptforge.io import atomic_file

LOCK_DIR_ENV = "GPTFORGE_DVC_LOCK_DIR"
POLL_SECONDS = 1.0


def _copy(src: Path, dst: Path) -> None:
    with atomic_file(dst, "wb") as f, open(src, "rb") as source:
        shutil.copyfileobj(source, f)


def _parses(path: Path) -> bool:
    import yaml

    try:
        return isinstance(yaml.safe_load(path.read_text(encoding="utf-8")), dict)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _watch(lock: Path, kept: Path, stop: threading.Event, poll: float, copied: tuple[int, int] | None) -> None:
    """Copy `lock` to `kept` each time it changed and then stood still for one poll (DVC writes
    it in place: a file caught mid-write is not copied)."""
    seen = None
    while not stop.wait(poll):
        now = _stat(lock)
        if now is not None and now == seen and now != copied and _parses(lock):
            _copy(lock, kept)
            copied = now
        seen = now


@contextlib.contextmanager
def kept_dvc_lock(root: Path) -> Iterator[None]:
    """Bring the kept dvc.lock into `root` before the body, keep `root`'s after it."""
    folder = os.environ.get(LOCK_DIR_ENV)
    if not folder:
        yield
        return
    if not Path(folder).is_dir() or not os.access(folder, os.W_OK):
        raise BadInput(f"{LOCK_DIR_ENV}={folder}: not a writable folder (where dvc.lock is kept between runs)")
    kept, lock = Path(folder) / "dvc.lock", root / "dvc.lock"
    if kept.is_file():
        _copy(kept, lock)
    stop = threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(lock, kept, stop, POLL_SECONDS, _stat(lock)), name="kept-dvc-lock", daemon=True
    )
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        if lock.is_file():
            _copy(lock, kept)
