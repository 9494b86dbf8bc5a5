"""`gptforge`: the command line. Every stage command runs its Prefect flow.

Exit codes: 0 success, 2 bad input (params, files, arguments), 1 failure of the run itself.
Errors are one line on stderr, the last line the command prints; `GPTFORGE_DEBUG=1` adds the
traceback. `GPTFORGE_PREFECT=0` (or Prefect not being installed, as on a bare GPU box) runs the
recipe without Prefect.

Each stage is its own process (dvc starts it), so start-up counts: this module imports only
what parsing arguments needs, and each command imports what it uses when it runs. `--help`
loads no torch, Prefect, MLflow or pydantic; the data stages never load torch.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import sys
import traceback
from typing import Sequence

import gptforge
from gptforge.cli import config, inference, models, serve, stages
from gptforge.cli.parsing import Parser
from gptforge.errors import GptforgeError
from gptforge.runtime.allocator import keep_freed_memory
from gptforge.runtime.signals import exit_within, stop_cause, stop_signal, terminate_as_interrupt

log = logging.getLogger("gptforge")


def build_parser() -> Parser:
    parser = Parser(prog="gptforge", description="GPT-2 from raw text to an evaluated, registered model.")
    parser.add_argument("--version", action="version", version=f"gptforge {gptforge.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for group in (config, stages, inference, models, serve):
        group.add_commands(sub)
    return parser


def _setup_logging() -> None:
    # Prefect forwards these loggers to the flow run's logs in its UI.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "gptforge")
    # Telemetry cannot reach its host offline and was seen to cause "database is locked".
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # Prefect's temporary server gets 20 s to answer; its first start in a fresh PREFECT_HOME
    # (database migrations) on a busy machine was seen to take longer and fail the stage.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    # Our closing lines come after the flow run: not for its log in the UI (a warning each, else).
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    for old in [h for h in log.handlers if getattr(h, "gptforge_cli", False)]:
        log.removeHandler(old)  # main() may run more than once in a process (tests, notebooks)
    handler = logging.StreamHandler(sys.stderr)
    handler.gptforge_cli = True
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s gptforge: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    # Under torchrun the processes other than global rank 0 say only what goes wrong: their
    # progress is rank 0's, line for line.
    quiet = int(os.environ.get("RANK", "0") or 0) > 0
    log.setLevel(os.environ.get("GPTFORGE_LOG_LEVEL", "WARNING" if quiet else "INFO").upper())
    log.propagate = False


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _LineEnds:
    """sys.stderr, remembering whether what was last written ended its line, so that the
    error line starts a line of its own even after a progress bar that a signal cut off
    mid-draw (a bar closed while the signal's exception was raised inside it draws nothing)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        if text:
            self.at_line_start = text.endswith(("\n", "\r"))
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _say(line: str) -> None:
    """The command's last line, on stderr, on a line of its own."""
    _close_progress_bars()
    starts = getattr(sys.stderr, "at_line_start", True)
    print(line if starts else f"\n{line}", file=sys.stderr)


def _skip_exit_gc() -> None:
    """Let the process end without the interpreter's last garbage collections: with torch,
    MLflow and Prefect loaded they walk millions of objects for 1-4 s after the work is done
    (measured: 4.0 s -> 0.35 s). Registered first, so it runs after every other exit handler
    (Prefect's server stop, MLflow's flushes, logging's shutdown); objects are still freed by
    reference counting, only the cycle search over the heap is skipped."""
    atexit.unregister(gc.freeze)  # main() may run more than once in a process
    atexit.register(gc.freeze)


def _silence_module_teardown() -> None:
    """Keep the last line printed the command's own: once every exit handler has run, stderr
    goes to /dev/null for the interpreter's module teardown, where Triton's bindings (imported
    by torch's optimizers) print a 70-line nanobind "leaked instances" report on every exit.
    Registered first (by `main`), so it runs after every other exit handler."""
    if "triton._C.libtriton" not in sys.modules:
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def _close_progress_bars() -> None:
    """A progress bar that an error interrupted still holds its line: closed first, so the
    error line the CLI prints is a line of its own, the last one."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is None:
        return
    for bar in list(getattr(tqdm.tqdm, "_instances", ())):
        with contextlib.suppress(Exception):
            bar.close()


def entry() -> None:
    """The `gptforge` command: `main`, then an exit that takes a bounded time.

    What is left to send at exit (Prefect's events and logs, MLflow's queued metrics) is sent
    by threads and exit handlers that wait for a server: one that went away (a stopped
    temporary Prefect server, a tracking server down) was seen to hold a stopped stage for over
    4 minutes in retries, and the pipeline waiting on it. GPTFORGE_EXIT_GRACE_SECONDS (5) bound it."""
    code = main()
    seconds = float(os.environ.get("GPTFORGE_EXIT_GRACE_SECONDS", "5"))
    exit_within(
        seconds,
        code,
        f"gptforge: exiting {seconds:g} s after the command ended: what was left to send to "
        "the Prefect API or the MLflow tracking server is dropped",
    )
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    atexit.unregister(_silence_module_teardown)  # main() may run more than once in a process
    atexit.register(_silence_module_teardown)
    _skip_exit_gc()
    keep_freed_memory()  # CPU steps reuse their freed buffers instead of page-faulting them back
    terminate_as_interrupt()  # SIGTERM stops like Ctrl-C: MLflow runs end KILLED, exit 143
    stderr = sys.stderr = _LineEnds(sys.stderr)
    try:
        return _run(argv)
    finally:
        if sys.stderr is stderr:
            sys.stderr = stderr.stream


def _run(argv: Sequence[str] | None) -> int:
    _setup_logging()
    debug = bool(os.environ.get("GPTFORGE_DEBUG"))
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except GptforgeError as e:
        if debug:
            _close_progress_bars()
            traceback.print_exc()
        _say(f"gptforge: error: {_one_line(e)}")
        return e.exit_code
    except KeyboardInterrupt as e:
        # Stopped: a loop that saved its state on SIGINT/SIGTERM says where; else plain Ctrl-C.
        _say(f"gptforge: {_one_line(e) or 'interrupted'}")
        return 128 + getattr(e, "signum", 2)
    except Exception as e:  # an unexpected failure: still one line unless debugging
        stop = stop_cause(e)
        if stop is not None:  # stopped, and a library's cleanup raised on the way out
            signum = stop_signal(stop)
            _say(
                f"gptforge: stopped by {signal.Signals(signum).name} ({type(e).__name__} on the way out: "
                f"{_one_line(e)})"
            )
            return 128 + signum
        if debug:
            _close_progress_bars()
            traceback.print_exc()
        _say(f"gptforge: error: {type(e).__name__}: {_one_line(e)} (GPTFORGE_DEBUG=1 shows the traceback)")
        return 1
    except BaseException as e:
        signum = stop_signal(e)
        if signum is None:
            _close_progress_bars()
            raise
        # Prefect's SIGTERM bridge inside a flow run (TerminationSignal): the run was stopped.
        _say(f"gptforge: stopped by {signal.Signals(signum).name}")
        return 128 + signum
