"""A warm start for the `gptforge` commands tests run: one fork server per pytest worker.

A stage command that a test runs does seconds of work after seconds of imports: torch (1.5 s
here), its compiler stack (1.1 s more, which torch.optim imports when an optimizer is made),
transformers, peft, trl, datasets and rouge-score (4 s more for the trl stages). Measured in the quickstart's
repository on 2 cores: `gptforge finetune rl` 8.4 s of CPU as a subprocess, 2.2 s as a fork of a
process that has those imported; `pretrain` 3.4 -> 0.4 s; `finetune classify` 3.5 -> 0.5 s.

The server is a fresh Python process (`python cli_zygote.py`) that imports those libraries
and nothing of gptforge, runs no test and has no thread but its main one and pyarrow's jemalloc
background thread (jemalloc takes its locks around a fork: PyTorch's DataLoader forks workers
from processes that have imported datasets every day), then forks one child per command.
The child is a process of its own, as `subprocess.run` would make it: its working folder, its
environment (os.environ replaced before gptforge is imported), stdout and stderr to files,
stdin from /dev/null, Python's default signal handlers, its exit status (minus the signal
number when a signal ended it) and, at its end, what a Python process does at exit (non-daemon
threads joined, its own atexit handlers). gptforge itself is imported in the child, so what it
reads from the environment at import is the command's.

What a fork cannot give is an import under the command's environment: a command whose
environment differs from the server's in a variable those libraries read at import (HF_*,
TORCH*, OMP_*, PYTHON*, ...) runs as a plain subprocess, and so does any command when
GPTFORGE_TEST_FORK=0. Tests that check the process itself (start-up imports, signals, a server)
start it with subprocess, as before. A server that has other threads than its main one and
pyarrow's jemalloc thread (OpenBLAS starts a pool unless OMP_NUM_THREADS=1, which conftest sets
under xdist, as `make test` runs) does not fork at all: every command then runs fresh.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Variables that the preloaded libraries read at import: a command that sets them differently
# from the server's environment runs as a subprocess instead.
IMPORT_TIME_PREFIXES = (
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "DATASETS",
    "TORCH",
    "PYTORCH",
    "TRITON",
    "CUDA",
    "OMP_",
    "MKL_",
    "KMP_",
    "PYTHON",
    "LD_",
    "MPL",
    "MATPLOTLIB",
    "XDG_",
    "TRL_",
    "PEFT_",
    "ACCELERATE_",
    "WANDB_",
    "NO_COLOR",
)
PRELOADED = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "transformers",
    "peft",
    "trl",
    "datasets",
    "rouge_score.rouge_scorer",
    "matplotlib.pyplot",
    "safetensors.torch",
    "tiktoken",
)


def import_time_differences(env: dict[str, str], base: dict[str, str]) -> list[str]:
    """The variables read at import that `env` sets differently from `base`."""
    keys = set(env) | set(base)
    return sorted(k for k in keys if k.upper().startswith(IMPORT_TIME_PREFIXES) and env.get(k) != base.get(k))


class ForkServer:
    """The client side: starts the server on first use and runs commands through it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.pending = b""  # what the server wrote past the last message read
        self.disabled = ""  # why the server refused to fork (threads it had), if it did

    def _start(self) -> None:
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            bufsize=0,
        )
        self.pending = b""
        ready = self._read(timeout=300)
        assert ready is not None and "ready" in ready, ready
        if not ready["ready"]:  # a server it is not safe to fork: every command runs fresh
            self.disabled = ready["why"]
            self.proc.wait()

    def _read(self, timeout: float | None) -> dict | None:
        """The server's next message, or None when `timeout` passed first."""
        import time

        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            readable, _, _ = select.select([fd], [], [], left)
            if not readable:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the CLI fork server (tests/cli_zygote.py) exited with {self.proc.wait()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def usable_for(self, env: dict[str, str]) -> bool:
        if os.environ.get("GPTFORGE_TEST_FORK", "1") == "0" or self.disabled:
            return False
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        return not self.disabled and not import_time_differences(env, self.env)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="gptforge-fork-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            started = self._read(timeout=60)
            assert started and "pid" in started, started
            ended = self._read(timeout=timeout)
            if ended is None:  # as subprocess.run: kill the command, then raise
                os.kill(started["pid"], signal.SIGKILL)
                self._read(timeout=60)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(errors="replace"))
            read = lambda p: p.read_text(encoding="utf-8", errors="replace") if p.exists() else ""  # noqa: E731
            return subprocess.CompletedProcess(argv, ended["returncode"], read(out), read(err))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


_SERVER = ForkServer()


def run_forked(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """`argv` (the command line, the `gptforge` script first) run through the fork server, or
    None when the command must be a fresh process (its environment, or GPTFORGE_TEST_FORK=0)."""
    if not _SERVER.usable_for(env):
        return None
    return _SERVER.run(argv, cwd, env, timeout)


def close() -> None:
    _SERVER.close()


# ---------------------------------------------------------------------------------------------
# The server (run as a script)


def _child(request: dict) -> None:
    """In the forked child: become the command, run it, exit as a Python process would."""
    import atexit
    import io
    import threading
    import traceback

    code = 1
    try:
        atexit._clear()  # the server's handlers are not the command's
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)  # only 0, 1 and 2 reach what the command starts
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
        )
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(sys.argv[0])  # as the console script's interpreter has it
        try:
            from gptforge.cli import entry

            entry()
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # as at interpreter exit: non-daemon threads first, then atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve() -> None:
    """Read one JSON request per line, fork a child for it, report its pid and then its end."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    leaked = {"prefect", "mlflow", "gptforge"} & {m.split(".")[0] for m in sys.modules}
    assert not leaked, f"the fork server must not import {leaked}: they read the environment at import"
    reply = sys.stdout
    tasks = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    others = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
    others = [name for name in others if name != "jemalloc_bg_thd"]
    if others:  # e.g. OpenBLAS's pool when OMP_NUM_THREADS is not 1 (pytest without xdist)
        why = f"the fork server has threads {others} besides its main one and jemalloc's"
        reply.write(json.dumps({"ready": False, "why": why}) + "\n")
        reply.flush()
        return
    import gc

    gc.freeze()  # the imported objects leave the collector's view: a child's collections do not copy their pages
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status, usage = os.wait4(pid, 0)
        cpu = usage.ru_utime + usage.ru_stime
        reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status), "cpu_seconds": cpu}) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve()
