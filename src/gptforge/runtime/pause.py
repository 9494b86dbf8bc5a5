"""A pause point in a loop that runs for a long time (pretraining, the serve engine), for tests
and for a person who wants to act mid-run.

With `GPTFORGE_PAUSE_AT_STEP=N` and `GPTFORGE_PAUSE_FILE=PATH` in its environment, the loop
holds once, after its Nth step: it writes PATH ("paused at step N, pid P", whole or absent) and
waits until PATH is removed. A test that must act while work is under way (send a stop signal,
SIGKILL the run, take its tracking server away, fill the serve engine's queue) waits for the
file instead of racing the machine's speed, then removes it.

- Pretraining holds after step N and its checkpoint, if one was due. Signals behave as anywhere
  in the loop: the first SIGINT/SIGTERM is recorded and acted on at the end of the step after
  the release; a second one stops at once, in the pause. Under DDP only rank 0 holds; the
  other ranks wait for it in their next collective.
- The serve engine's scheduling thread holds after its Nth step (each served model's engine at
  its own) while the HTTP side goes on answering; the server's shutdown waits for the release.

Unset, a step costs one comparison.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from gptforge.io import atomic_file

log = logging.getLogger("gptforge")

STEP_ENV = "GPTFORGE_PAUSE_AT_STEP"
FILE_ENV = "GPTFORGE_PAUSE_FILE"


class PausePoint:
    def __init__(self, step: int | None, path: Path | None) -> None:
        self.step, self.path = step, path

    @classmethod
    def from_env(cls, master: bool = True) -> "PausePoint":
        """The pause the environment asks for (none unless both variables are set, on rank 0)."""
        step, path = os.environ.get(STEP_ENV), os.environ.get(FILE_ENV)
        if not (master and step and path):
            return cls(None, None)
        try:
            return cls(int(step), Path(path))
        except ValueError:
            log.warning("%s=%r is not a step number: no pause", STEP_ENV, step)
            return cls(None, None)

    def after(self, step: int) -> None:
        """Called with the number of steps done; pauses once, after step `self.step`."""
        if step != self.step or self.path is None:
            return
        with atomic_file(self.path) as f:  # whole or absent: a reader never sees half a line
            f.write(f"paused at step {step}, pid {os.getpid()}\n")
        log.info("paused after step %d until %s is removed", step, self.path)
        while self.path.exists():
            time.sleep(0.02)
        log.info("resumed after step %d", step)
