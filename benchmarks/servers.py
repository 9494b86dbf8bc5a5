"""The servers a serving benchmark measures, each alone on the machine: `gptforge serve` (a
checkpoint or a Hugging Face folder by NAME=PATH, optionally under cProfile, one profile per
thread), `transformers serve --continuous-batching` and llama.cpp's `llama_cpp.server` (a GGUF
file, from .venv-llama-cpp: benchmarks/llama_cpp_env.sh), each started in a session of its own,
waited for until it answers and stopped together with whatever it started; the CPU seconds of a
server's threads; `serving` (one server for a `with` block) and `run_session` (measures run
against one server, a failure recorded instead of ending the run); `note`, progress on stderr.
Used by bench_serve, bench_serve_model, bench_serve_llama_cpp and bench_synthesize."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]

MODEL_NAME = "tiny"  # the name a gptforge server gives its checkpoint unless told: bench_serve's tiny GPT

# Runs `gptforge serve` with a cProfile profiler in every thread (--profile): each thread's stats
# are dumped into the folder when the server process exits.
PROFILE_WRAPPER = r"""
import atexit, cProfile, os, sys, threading
out = sys.argv.pop(1)
profiles = []
_run = threading.Thread.run
def run(self):
    p = cProfile.Profile()
    profiles.append((self.name, p))
    p.enable()
    try:
        _run(self)
    finally:
        p.disable()
threading.Thread.run = run
main = cProfile.Profile()
profiles.append(("main", main))
def dump():
    for i, (name, p) in enumerate(profiles):
        try:
            p.create_stats()
            p.dump_stats(os.path.join(out, f"{i:02d}_{''.join(c if c.isalnum() else '_' for c in name)}.prof"))
        except Exception as e:
            print(f"profile {name}: {e}", file=sys.stderr)
atexit.register(dump)
from gptforge.cli import main as cli_main
sys.argv[0] = "gptforge"
main.enable()
try:
    code = cli_main()
finally:
    main.disable()
sys.exit(code)
"""


def note(msg: str) -> None:
    """Progress on stderr (stdout carries the JSON)."""
    print(f"bench_serve [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ServerFailed(SystemExit):
    """A server that exited or never answered /health (a SystemExit for the scripts that import
    wait_healthy; the measures here catch it, report it and go on)."""


@contextlib.contextmanager
def recorded_failure(out: dict, key: str):
    """A failed server or measure is recorded under `key`, and the others go on."""
    try:
        yield
    except (Exception, ServerFailed) as e:  # noqa: BLE001
        out[key] = {"error": f"{type(e).__name__}: {e}"[:600]}
        note(f"{key} failed: {out[key]['error'][:300]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gptforge_command() -> list[str]:
    script = Path(sys.executable).with_name("gptforge")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "gptforge.cli"]


def server_env(args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    env.pop("GPTFORGE_API_KEY", None)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the server's own thread count unless asked
        env.pop(key, None)
    if getattr(args, "server_threads", None):
        env["OMP_NUM_THREADS"] = str(args.server_threads)
    return env


def _dies_with_us(sig: int):
    """A preexec_fn: the child gets `sig` when this process dies (Linux's PR_SET_PDEATHSIG), so
    that a bench killed outright (a test's timeout) leaves no server running; elsewhere nothing."""

    def preexec() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    return preexec if sys.platform.startswith("linux") else None


def start_server(
    ckpt: Path,
    port: int,
    args,
    log_path: Path,
    *,
    name: str = MODEL_NAME,
    extra: tuple[str, ...] = (),
    profile: bool = True,
) -> subprocess.Popen:
    serve_args = [
        "serve",
        f"{name}={ckpt}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-batch",
        str(args.max_batch),
    ]
    if getattr(args, "prefill_chunk", None):
        serve_args += ["--prefill-chunk", str(args.prefill_chunk)]
    serve_args += list(extra)
    if args.tokenizer_path:
        serve_args += ["-S", f"tokenizer.path={args.tokenizer_path}"]
    if args.profile and profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-c", PROFILE_WRAPPER, str(Path(args.profile).resolve()), *serve_args]
    else:
        cmd = [*gptforge_command(), *serve_args]
    log = open(log_path, "wb")
    # The server's working directory is the temporary folder: no params.yaml or checkpoints of
    # the repository are read; the settings come from the command line.
    # SIGTERM when this process dies: the server shuts down as on SIGINT, and stops its engine.
    return subprocess.Popen(
        cmd,
        cwd=log_path.parent,
        env=server_env(args),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_dies_with_us(signal.SIGTERM),
    )


def transformers_command() -> list[str]:
    script = Path(sys.executable).with_name("transformers")
    return (
        [str(script)]
        if script.is_file()
        else [
            sys.executable,
            "-c",
            "import sys; from transformers.cli.transformers import main; sys.argv[0] = "
            "'transformers'; sys.exit(main())",
        ]
    )


def start_transformers_server(
    folder: Path, port: int, args, log_path: Path, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    """`transformers serve FOLDER --continuous-batching`: the folder is the forced model (loaded at
    start, requests must name it by the same path), offline."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cmd = [
        *transformers_command(),
        "serve",
        str(folder),
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        device,
        *extra,
    ]
    env = {**server_env(args), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    log = open(log_path, "wb")
    # SIGKILL when this process dies: its continuous-batching thread can keep it alive after SIGINT.
    return subprocess.Popen(
        cmd,
        cwd=log_path.parent,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_dies_with_us(signal.SIGKILL),
    )


LLAMA_CPP_VENV = Path(os.environ.get("LLAMA_CPP_VENV", ROOT / ".venv-llama-cpp"))


def start_llama_cpp_server(gguf: Path, port: int, args, log_path: Path, name: str) -> subprocess.Popen:
    """`python -m llama_cpp.server` on one GGUF file, as many threads as cores (llama.cpp's own
    count: its default is the physical cores), the model answering to `name`."""
    python = LLAMA_CPP_VENV / "bin/python"
    if not python.is_file():
        raise ServerFailed(f"{python} not found: build it with benchmarks/llama_cpp_env.sh (about 8 minutes)")
    threads = str(os.cpu_count() or 1)
    cmd = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", name]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_threads", threads, "--n_threads_batch", threads]
    cmd += ["--n_ctx", str(getattr(args, "n_ctx", 2048))]
    log = open(log_path, "wb")
    return subprocess.Popen(
        cmd,
        cwd=log_path.parent,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_dies_with_us(signal.SIGKILL),
    )


def log_tail(log_path: Path, n: int = 2000) -> str:
    try:
        return log_path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def last_line(log_path: Path) -> str:
    """The log's last line that says something (progress bars and blank lines skipped)."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", log_tail(log_path, 20000)) if ln.strip()]
    lines = [ln for ln in lines if not re.search(r"\d+%\|", ln)] or lines
    return lines[-1][:400] if lines else "(empty log)"


def wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, timeout: float, path: str = "/health") -> dict:
    """The server's answer on `path` once it is healthy: /health saying ok, or (llama.cpp's
    server, which has no /health) /v1/models listing a model."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"bench_serve: the server exited with {proc.returncode}:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                body = json.loads(r.read())
            if body.get("status") == "ok" or body.get("data"):
                return body
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.2)
    raise ServerFailed(f"bench_serve: no healthy /health within {timeout:.0f} s:\n{log_tail(log_path)}")


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGINT (uvicorn shuts down on it, and --profile dumps its stats), SIGKILL to the server's
    process group after `grace` s; then whatever it started and left behind in its group (an
    engine process) is given 5 s and killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait(10)
    deadline = time.monotonic() + 5.0
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(proc.pid):
        _kill_group(proc.pid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _kill_group(pgid: int) -> None:
    """The server was started in a session of its own (start_new_session): its process group
    is its pid, and holds only it and what it started."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of the server: `main` (the event loop, HTTP)
    and the others by thread id (Python's thread names do not reach the OS), then the threads of
    the processes it started (an engine process: `child PID main`, `child PID tid T`)."""
    try:
        proc = psutil.Process(pid)
        out = {("main" if t.id == pid else f"tid {t.id}"): t.user_time + t.system_time for t in proc.threads()}
        children = proc.children(recursive=True)
    except psutil.Error:
        return {}
    for child in children:
        try:
            for t in child.threads():
                out[f"child {child.pid} " + ("main" if t.id == child.pid else f"tid {t.id}")] = (
                    t.user_time + t.system_time
                )
        except psutil.Error:
            pass
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    names = set(before) | set(after)
    return {
        n: round(after.get(n, 0.0) - before.get(n, 0.0), 3)
        for n in sorted(names)
        if after.get(n, 0.0) - before.get(n, 0.0) > 0.0005
    }


@contextlib.contextmanager
def serving(
    kind: str,
    path: Path,
    args,
    tmp: Path,
    label: str,
    *,
    name: str | None = None,
    extra: tuple[str, ...] = (),
    profile: bool = False,
):
    """One server alone on the machine for the `with` block: `gptforge` (NAME=PATH),
    `transformers` (the folder) or `llama_cpp` (a GGUF file, answering to NAME). Yields what the
    measures need: port, pid, the model field of the requests, the log, the startup time."""
    port, log_path = free_port(), tmp / f"{label}.log"
    t0 = time.perf_counter()
    if kind == "gptforge":
        proc = start_server(path, port, args, log_path, name=name, extra=extra, profile=profile)
    elif kind == "llama_cpp":
        proc = start_llama_cpp_server(path, port, args, log_path, name or "model")
    else:
        proc = start_transformers_server(path, port, args, log_path, extra=extra)
    note(f"{label}: starting {' '.join(map(str, proc.args[-12:]))}")
    try:
        try:
            health_path = "/v1/models" if kind == "llama_cpp" else "/health"
            health = wait_healthy(proc, port, log_path, args.startup_timeout, health_path)
        except ServerFailed:
            why = f"exited with {proc.returncode}" if proc.poll() is not None else "no healthy /health"
            raise ServerFailed(f"{label}: the server did not start ({why}): {last_line(log_path)}") from None
        yield types.SimpleNamespace(
            kind=kind,
            label=label,
            port=port,
            pid=proc.pid,
            log=log_path,
            model=name if kind in ("gptforge", "llama_cpp") else str(path),
            health=health,
            startup_s=round(time.perf_counter() - t0, 2),
            flags=[
                *(["--prefill-chunk", str(args.prefill_chunk)] if kind == "gptforge" and args.prefill_chunk else []),
                *extra,
            ],
        )
    finally:
        stop_server(proc, grace=30.0 if kind == "gptforge" else 10.0)


def run_session(open_session, jobs: list[tuple[str, object]], out: dict) -> None:
    """Start a server (`open_session()`, a context manager), run `jobs` ((key, fn(session)) in
    order) against it, each guarded: an error is recorded under its key and the next goes on. A
    server that does not start gives its error to every job."""
    if not jobs:
        return
    try:
        with open_session() as s:
            for key, fn in jobs:
                note(f"{s.label}: {key}")
                try:
                    out[key] = fn(s)
                except (Exception, ServerFailed) as e:  # noqa: BLE001 (reported, the others go on)
                    out[key] = {"error": f"{type(e).__name__}: {e}"[:1000]}
                    note(f"{s.label}: {key} failed: {out[key]['error'][:300]}")
    except (Exception, ServerFailed) as e:  # noqa: BLE001
        msg = str(e) if isinstance(e, ServerFailed) else f"{type(e).__name__}: {e}"
        note(msg[:400])
        for key, _ in jobs:
            out.setdefault(key, {"error": msg[:1000]})
