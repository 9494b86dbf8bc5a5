"""Starting a working folder's recorder (flows/recorder.py): through the recorder host when one
runs, else by starting the host.

A recorder pays ~3 s of CPU for its imports (MLflow's SQL store, Prefect's client) before its
first record. The host (`python -m flows.recorder_host SOCKET`) is one
process per user, interpreter and recorder code that has paid them once and forks a recorder
for a folder on request, in ~0.1 s; it leaves when none of its recorders runs and none was
asked for in the recorders' idle time. A folder still has its own recorder process, lock,
state and log, as before: only the imports are shared.

The way there: connect to the host's Unix socket (`host_socket()`), send one JSON line
`{"root": FOLDER, "env": ENVIRONMENT}`, read `{"pid": N}` back. No host, a stale socket or an
answer that does not come within seconds: start a host in the folder (it forks the folder's
recorder first, then serves others). `GPTFORGE_RECORDER_HOST=0` starts the plain recorder,
`python -m flows.recorder`, as the only process that pays its imports.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from gptforge.runtime.journal import RECORDER_DIR

HOST_ENV = "GPTFORGE_RECORDER_HOST"
ASK_SECONDS = 5.0
MAX_SOCKET_PATH = 107  # bytes in sockaddr_un's sun_path, less its final NUL


def host_socket() -> Path:
    """The host's socket: per user (its cache folder), interpreter and recorder code (the
    sizes and times of the recorder's sources), so that a host never forks code older than
    the checkout's; a stale host is never asked again and leaves when idle.
    OSError when the path is too long for a socket (a deep XDG_CACHE_HOME): no host then."""
    sources = []
    for package in ("flows", "gptforge.runtime"):
        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            sources += sorted(Path(folder).glob("*.py"))
    stamp = [sys.executable] + [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sources]
    key = hashlib.sha1("\n".join(stamp).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptforge"
    path = cache / f"recorder-host-{key}.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise OSError(f"{path}: too long for a Unix socket")
    return path


def start_recorder(root: Path) -> None:
    """The folder's recorder, started detached (its own session, no terminal), so that it
    outlives this process and a Ctrl-C here does not reach it."""
    path = None
    if os.environ.get(HOST_ENV, "1") != "0":
        with contextlib.suppress(OSError):
            path = host_socket()
    if path is None:
        _spawn(root, ["flows.recorder"])
    elif not _ask_host(path, root):
        _spawn(root, ["flows.recorder_host", str(path)])


def _ask_host(path: Path, root: Path) -> bool:
    """Whether the host forked the folder's recorder."""
    request = json.dumps({"root": str(root.resolve()), "env": dict(os.environ)}) + "\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(ASK_SECONDS)
            s.connect(str(path))
            s.sendall(request.encode())
            answer = s.makefile("rb").readline()
        return bool(json.loads(answer).get("pid"))
    except (OSError, ValueError, AttributeError):
        return False


def _spawn(root: Path, args: list[str]) -> None:
    with open(root / RECORDER_DIR / "recorder.out", "ab") as out:
        subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
