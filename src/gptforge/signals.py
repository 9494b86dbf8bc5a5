"""Stop a long loop cleanly on SIGINT/SIGTERM: finish the step, save, then stop.

A worker being drained, `docker stop`, a Prefect cancellation and Ctrl-C all send one of the
two. Killing training mid-step would lose everything since the last checkpoint; instead the
handler only records the request, and the loop checkpoints at the end of the step it is in and
raises `Stopped`. A second signal stops at once (the usual KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from typing import Iterator

log = logging.getLogger("gptforge")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
        log.warning("%s received: stopping after this step, with a checkpoint (send it again to stop at once)",
                    signal.Signals(signum).name)

    for sig in SIGNALS:
        signal.signal(sig, handler)
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def forwarded_to(proc: subprocess.Popen) -> Iterator[list[int]]:
    """While `proc` (started with `start_new_session=True`) runs, SIGINT/SIGTERM sent to us go to
    its whole process group, so a stage under `dvc repro` or the workers under torchrun stop
    cleanly (a training loop checkpoints first) instead of being orphaned. The yielded list
    records the signals received. On the way out, a group still running (we failed while it
    ran) is sent SIGTERM and waited for: no job is left behind."""
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers live there only
        for sig in SIGNALS:
            previous[sig] = signal.signal(sig, forward)
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
