"""The recorder host: one process per user, interpreter and recorder code that imports what a
recorder needs once and forks a working folder's recorder on request (`python -m
flows.recorder_host SOCKET`, started by gptforge.runtime.recorder_launch, whose docstring
gives the why and the protocol).

Measured on a 2-core machine: a recorder started as its own interpreter spends ~3.4 s of CPU
before its first record (MLflow's SQL store 2.0 s, Prefect's client 0.9 s); forked from here,
it skips them. Started in the folder whose recorder it was started for, it forks that one
first, then serves requests on its Unix socket; the one holding the socket's lock is the host,
and a second one started at the same moment runs its folder's recorder itself, as the plain
recorder would. Each child is what the plain recorder is: its own session, the folder as its
working directory, the asking stage's environment (Prefect's settings read again from it),
stdout and stderr to the folder's `recorder.out`. The host leaves once none of its children
runs and nothing was asked for in the recorders' idle time (GPTFORGE_RECORDER_IDLE_SECONDS).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from flows.recorder import IDLE_ENV, IDLE_SECONDS, Recorder
from gptforge.runtime.journal import RECORDER_DIR

# What a recorder imports on its way (its sinks import them lazily): loaded here, before any
# fork. A module that is not installed is skipped: the recorder meets the same error itself.
PRELOAD = (
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.tracking.sqlalchemy_workspace_store",
    "mlflow.tracking",
    "sqlalchemy.dialects.sqlite",
    "alembic.command",
    "alembic.config",
    "gptforge.runtime.records_mlflow",
    "gptforge.runtime.tracking",
    "prefect",
    "prefect.flows",
    "prefect.tasks",
    "prefect.states",
    "prefect.client.orchestration",
    "prefect.client.schemas.actions",
    "prefect.client.schemas.objects",
    "prefect.client.schemas.filters",
    "flows.records_prefect",
)


def serve(path: Path) -> int:
    first, asked = Path.cwd(), dict(os.environ)
    try:
        lock, listener = _listen(path)
    except OSError as e:  # another host serves this key, or no socket here: be this folder's recorder
        print(f"{time.strftime('%H:%M:%S')} not a recorder host ({e}): the recorder of {first} only", flush=True)
        return Recorder(first).run()
    _log_to(path.parent / "recorder-host.log")  # one log for every key's host: lines carry the pid
    # No thread may run at a fork but the one forking: numpy's OpenBLAS and pyarrow's jemalloc
    # (through MLflow's imports) start one each at load unless told not to.
    os.environ.update(OPENBLAS_NUM_THREADS="1", JE_ARROW_MALLOC_CONF="background_thread:false")
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # A child's garbage collections would walk (and so copy, page by page) every object the
    # host made: frozen, they are not collected and stay shared.
    gc.freeze()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:
        print(f"{time.strftime('%H:%M:%S')} {threads} threads after the imports: forking anyway", flush=True)
    os.chdir("/")  # the host pins no working folder
    idle = _idle_seconds(asked)
    children = {_fork(first, asked, (listener, lock))}
    last = time.monotonic()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    print(f"{time.strftime('%H:%M:%S')} recorder host {os.getpid()} serving {path}", flush=True)
    try:
        while not stopping:
            children = {pid for pid in children if not _reaped(pid)}
            if not children and time.monotonic() - last > idle:
                break
            try:
                conn, _ = listener.accept()
            except (socket.timeout, InterruptedError):
                continue
            with conn:
                last = time.monotonic()
                try:
                    conn.settimeout(5)
                    request = json.loads(conn.makefile("rb").readline())
                    env = {str(k): str(v) for k, v in request["env"].items()}
                    pid = _fork(Path(request["root"]), env, (listener, lock, conn))
                    children.add(pid)
                    idle = max(idle, _idle_seconds(env))
                    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
                except (OSError, ValueError, KeyError, AttributeError) as e:
                    print(
                        f"{time.strftime('%H:%M:%S')} recorder host {os.getpid()}: a request failed: {e!r}", flush=True
                    )
    finally:
        # Socket and lock go with the host (a checkout's every change of code gets a new key):
        # a host starting meanwhile either holds the old lock file and fails to lock it (and
        # records its folder itself) or makes a new one.
        for made in (path, path.with_suffix(".lock")):
            with contextlib.suppress(FileNotFoundError):
                made.unlink()
        listener.close()
        lock.close()
        print(f"{time.strftime('%H:%M:%S')} recorder host {os.getpid()} exits", flush=True)
    return 0


def _listen(path: Path):
    """The host's lock (held for its life: the host of this key is whoever holds it) and its
    listening socket; OSError when the lock is taken or the socket cannot be made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(path.with_suffix(".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a host that died left it; the lock says none serves it now
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
            os.chmod(path, 0o600)
            listener.listen(64)
        except OSError:
            listener.close()
            raise
    except OSError:
        lock.close()
        raise
    listener.settimeout(0.5)
    return lock, listener


def _fork(root: Path, env: dict[str, str], close: tuple) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for f in close:  # the host's socket and lock are not the recorder's to hold
            f.close()
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(root)
        os.environ.clear()
        os.environ.update(env)
        (root / RECORDER_DIR).mkdir(parents=True, exist_ok=True)
        _log_to(root / RECORDER_DIR / "recorder.out", 0o644)
        if "prefect.context" in sys.modules:  # its settings were read from the host's environment
            sys.modules["prefect.context"].refresh_global_settings_context()
        code = Recorder(root).run()
    except BaseException:  # noqa: BLE001 - the child never returns into the host's loop
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid


def _idle_seconds(env: dict) -> float:
    try:
        return float(env.get(IDLE_ENV, IDLE_SECONDS))
    except ValueError:
        return IDLE_SECONDS


def _log_to(path: Path, mode: int = 0o600) -> None:
    """stdin from /dev/null; stdout and stderr appended to `path`."""
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1])))
