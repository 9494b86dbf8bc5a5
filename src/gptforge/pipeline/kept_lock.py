"""dvc.lock kept in a folder that outlives the workspace, for workspaces that last one run.

A flow-run container starts from the image's workspace and is removed when its run ends, and
dvc.lock, where DVC records what each stage ran with, would go with it: the next run's DVC could
then restore from its run cache only the stages that cache can hold, and would run the others
(those with `persist: true` or `cache: false` outputs) again. With GPTFORGE_DVC_LOCK_DIR set (the
image sets /state, a volume of the compose file and of the pool templates), the pipeline starts
from the dvc.lock kept there and writes its own back when `dvc repro` ends, finished or not (DVC
updates the lock stage by stage). A symlink would not do: DVC refuses a dvc.lock that is one.
Unset, nothing changes: in a clone, dvc.lock lives beside dvc.yaml under Git.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from gptforge.errors import BadInput
from gptforge.io import atomic_file

LOCK_DIR_ENV = "GPTFORGE_DVC_LOCK_DIR"


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
        with atomic_file(lock, "wb") as f, open(kept, "rb") as src:
            shutil.copyfileobj(src, f)
    try:
        yield
    finally:
        if lock.is_file():
            with atomic_file(kept, "wb") as f, open(lock, "rb") as src:
                shutil.copyfileobj(src, f)
