"""Stopping on SIGINT/SIGTERM, at every level of a run: loop, stage, `dvc repro`, pipeline.

A worker being drained, `docker stop`, a Prefect cancellation and Ctrl-C all send one of the
two. Killing training mid-step would lose everything since the last checkpoint; instead
`stop_requested` only records the request, and the loop checkpoints at the end of the step it
is in and raises `Stopped`. A second signal stops at once (the usual KeyboardInterrupt).
Elsewhere `terminate_as_interrupt` makes SIGTERM raise like Ctrl-C, so `finally` blocks run and
runs are recorded as stopped. A process that starts others (the pipeline starts `dvc repro`,
pretrain starts torchrun) forwards what it receives to their process group and waits for all
of it (`forwarded_to`), and a stage that `dvc repro` started stops when dvc goes away without
passing the signal on (`stop_with_launcher`): no process of a run outlives it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger("gptforge")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# From the first signal to the end of a stopped process, whatever it still waits for (a
# Prefect or MLflow server that does not answer its last records): a stage saves its checkpoint
# and ends its records well within it, and the whole run is gone within the 30 s users expect.
# GPTFORGE_STOP_GRACE_SECONDS raises it for models whose checkpoint takes longer to write. A
# parent (pipeline, torchrun launcher) SIGKILLs what is left of its child's group a little later,
# so that the child's own line comes first; a second signal leaves the child SECOND_SIGNAL_GRACE.
STOP_GRACE_SECONDS = float(os.environ.get("GPTFORGE_STOP_GRACE_SECONDS", "20"))
GROUP_GRACE_SECONDS = STOP_GRACE_SECONDS + 5.0
SECOND_SIGNAL_GRACE = 3.0


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


@contextlib.contextmanager
def stop_requested() -> Iterator[StopRequest]:
    """Within the block, SIGINT/SIGTERM set the yielded request instead of interrupting.
    Outside the main thread signals cannot be caught: the request then never fires."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def handler(signum, frame):
        if request:
            raise KeyboardInterrupt  # asked twice: stop now
        request.signum = signum
        arm_stop_deadline(signum)
        log.warning(
            "%s received: stopping after this step, with a checkpoint (send it again to stop at once)",
            signal.Signals(signum).name,
        )

    for sig in SIGNALS:
        signal.signal(sig, handler)
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def forwarded_to(proc: subprocess.Popen, grace: float = GROUP_GRACE_SECONDS) -> Iterator[list[int]]:
    """While `proc` (started with `start_new_session=True`) runs, SIGINT/SIGTERM sent to us go to
    its whole process group, so a stage under `dvc repro` or the workers under torchrun stop
    cleanly (a training loop checkpoints first) instead of being orphaned. The yielded list
    records the signals received.

    On the way out, nothing of the group is left: after a signal, every process of the group
    (not only `proc`: the stage that dvc runs may outlive dvc) is waited for, up to `grace`
    seconds from the first signal (SECOND_SIGNAL_GRACE from a second one), then SIGKILLed; a
    group still running because we failed is sent SIGTERM first, with the same grace."""
    received: list[int] = []
    deadline = [float("inf")]

    def forward(signum, frame):
        received.append(signum)
        now = time.monotonic()
        deadline[0] = min(deadline[0], now + (grace if len(received) == 1 else SECOND_SIGNAL_GRACE))
        arm_stop_deadline(signum, grace + 4.0)  # the group's end, then a few seconds for our own records
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers live there only
        for sig in SIGNALS:
            previous[sig] = signal.signal(sig, forward)
    watchdog = threading.Thread(
        target=_kill_after_deadline, args=(proc, deadline), daemon=True, name="gptforge-stop-deadline"
    )
    watchdog.start()
    try:
        yield received
    finally:
        if proc.poll() is None and not received:  # we failed while it ran: stop it, with the same grace
            deadline[0] = time.monotonic() + grace
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        try:
            while proc.poll() is None or (received and group_alive(proc.pid)):
                if time.monotonic() > deadline[0]:
                    _kill_group(proc.pid)
                time.sleep(0.05)
            proc.wait()
        finally:
            deadline[0] = -1.0  # tells the watchdog to end
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _kill_after_deadline(proc: subprocess.Popen, deadline: list[float]) -> None:
    """SIGKILL `proc`'s group once its stop deadline has passed, even while the main thread is
    blocked (reading the group's output, which a hung process keeps open)."""
    while deadline[0] >= 0:
        if time.monotonic() > deadline[0]:
            log.warning("pid %d and its group did not stop within the grace period: killed", proc.pid)
            _kill_group(proc.pid)
            return
        time.sleep(0.1)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` still runs (zombies count until reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_with_launcher(poll_seconds: float = 1.0) -> None:
    """Under `dvc repro` (which sets DVC_STAGE for the commands it runs), stop this stage as if
    sent SIGTERM when dvc itself goes away.

    `kill DVC_PID` ends dvc without passing anything on: its stage went on training, orphaned,
    until it finished (seen here). A daemon thread checks every `poll_seconds` that the dvc
    process that started this one (found through the parent chain: a shell may sit between)
    still runs, and when it has gone sends this process SIGTERM, so the stage saves what it can
    and ends its records as stopped. Off dvc, or outside the main thread, it does nothing."""
    if "DVC_STAGE" not in os.environ or threading.current_thread() is not threading.main_thread():
        return
    launcher = _dvc_ancestor() or (os.getppid(), _start_time(os.getppid()))
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_seconds)
            if os.getppid() == parent and _running(*launcher):
                continue
            if _stop_deadline.is_set():  # the signal that ended dvc reached us too: already stopping
                return
            log.warning("dvc (pid %d), which started this stage, has gone: stopping as on SIGTERM", launcher[0])
            os.kill(os.getpid(), signal.SIGTERM)
            return

    threading.Thread(target=watch, name="gptforge-launcher-watch", daemon=True).start()


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None (gone, or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _start_time(pid: int) -> str | None:
    fields = _proc_stat(pid)
    return fields[19] if fields else None  # field 22 of stat: start time, tells a reused pid apart


def _running(pid: int, started: str | None) -> bool:
    fields = _proc_stat(pid)
    if fields is None:  # no /proc (not Linux): whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return started is None
    return fields[0] not in ("Z", "X") and fields[19] == started


def _dvc_ancestor(levels: int = 4) -> tuple[int, str | None] | None:
    """(pid, start time) of the nearest ancestor running dvc (`dvc ...` or `python -m dvc ...`)."""
    pid = os.getppid()
    for _ in range(levels):
        if pid <= 1:
            return None
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        names = [os.path.basename(a.decode(errors="replace")) for a in argv[:3]]
        if "dvc" in names:
            return pid, _start_time(pid)
        fields = _proc_stat(pid)
        if not fields:
            return None
        pid = int(fields[1])
    return None


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def terminate_as_interrupt() -> None:
    """SIGINT raises KeyboardInterrupt even where the parent ignored it, and SIGTERM (a worker
    cancelling the run, `docker stop`, `kill`) raises `Terminated`, a KeyboardInterrupt, instead
    of ending the process on the spot: `finally` blocks run, MLflow runs end KILLED, the CLI
    exits with 143. Either arms the stop deadline. Loops that save first (`stop_requested`) and
    Prefect's own bridge inside a flow run install their handlers over this one
    (`deadline_on_stop` wraps Prefect's). A stop raised where Python drops exceptions is sent
    again (`_redelivering`)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_term(signum, frame):
        arm_stop_deadline(signum)
        raise Terminated(signum)

    def on_int(signum, frame):
        arm_stop_deadline(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # `dvc repro` starts a stage's command with SIGINT ignored, and Python keeps an inherited
    # SIG_IGN: a stage under dvc (or the pipeline) went on to the end through Ctrl-C. Replaced.
    signal.signal(signal.SIGINT, on_int)
    if not getattr(sys.unraisablehook, "redelivers_stops", False):
        sys.unraisablehook = _redelivering(sys.unraisablehook)


def _redelivering(previous):
    """An unraisable hook that sends a swallowed stop again. A handler that raises (ours, or
    Prefect's TerminationSignal) runs wherever the main thread is, and Python drops what is
    raised inside a weakref callback or a `__del__` ("Exception ignored in ..."): the stop was
    lost, and the stage worked on until the stop deadline killed it with its runs left RUNNING
    (seen when SIGTERM met a garbage collection during the benchmark). The same signal is sent
    again, a moment later, to be raised where the program is; other unraisables go on to the
    hook that was in place."""

    def hook(unraisable) -> None:
        signum = stop_signal(unraisable.exc_value) if unraisable.exc_value is not None else None
        if signum is None:
            return previous(unraisable)
        log.debug("a stop (%s) was raised where Python drops exceptions; sending it again", signal.Signals(signum).name)
        again = threading.Timer(0.01, os.kill, args=(os.getpid(), signum))
        again.daemon = True
        again.start()

    hook.redelivers_stops = True
    return hook


_stop_deadline = threading.Event()


def arm_stop_deadline(signum: int, seconds: float | None = None) -> None:
    """From now on, this process ends within `seconds` (STOP_GRACE_SECONDS) with 128 + `signum`.

    A stopped stage reports its end to Prefect and MLflow; with a server that does not answer,
    their clients retry for a minute or more, and the stage (and a pipeline waiting for it)
    would outlive the stop by as long. A daemon timer ends the process at the deadline, saying
    what was dropped; a stop that ends in time never reaches it. Armed once per process."""
    if _stop_deadline.is_set():
        return
    _stop_deadline.set()
    seconds = STOP_GRACE_SECONDS if seconds is None else seconds
    exit_within(
        seconds,
        128 + signum,
        f"\ngptforge: stopped by {signal.Signals(signum).name}: still busy {seconds:g} s after it (a checkpoint "
        "being written, or records for a server that does not answer): exiting now, unsaved work and unsent "
        "records are dropped",
    )


def exit_within(seconds: float, code: int, message: str) -> None:
    """End the process with `code` at most `seconds` from now, whatever is still running, saying
    `message` first; a process that ends sooner never hears of it (a daemon timer)."""

    def expire() -> None:
        with contextlib.suppress(Exception):
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


@contextlib.contextmanager
def deadline_on_stop() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM arm the stop deadline, then do what the handlers in
    place did (Prefect's flow engine installs one that raises its TerminationSignal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def handler(signum, frame):
        arm_stop_deadline(signum)
        inner = previous[signum]
        if callable(inner):
            return inner(signum, frame)
        if inner == signal.SIG_IGN:
            return None
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    for sig in SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_cause(error: BaseException) -> BaseException | None:
    """The stop (a KeyboardInterrupt, ours or Ctrl-C's, or Prefect's TerminationSignal) that
    `error` is or was raised while handling, else None. A library whose cleanup fails on the
    interrupted state turns the stop into another error: a SIGTERM that lands as a Prefect task
    run starts makes Prefect's task engine raise ValueError('Task run is not set') from its
    crash handler. The run was stopped all the same, and is ended as stopped."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if stop_signal(error) is not None:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def stop_signal(error: BaseException) -> int | None:
    """The signal that stopped the run, when `error` says it was stopped: a KeyboardInterrupt
    (SIGINT, or ours with its `signum`) or Prefect's TerminationSignal (its `signal`, told by
    name, so the library needs no Prefect); None for any other error."""
    if isinstance(error, KeyboardInterrupt):
        return getattr(error, "signum", signal.SIGINT)
    if type(error).__name__ == "TerminationSignal" and isinstance(getattr(error, "signal", None), int):
        return error.signal
    return None
