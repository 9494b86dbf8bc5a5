"""A child process's output, shown as it comes and sent line by line to the log handlers.

The torchrun launcher (`gptforge.training.launch`) and the pipeline's `dvc repro` (`gptforge.pipeline.dvc`)
both run children that print progress bars and gptforge log lines. The terminal should see
them as if the child ran here; Prefect's UI (a log handler on the `gptforge` logger) should get
whole lines at their own level, and a progress bar now and then rather than every redraw.
Imports only the standard library.
"""

from __future__ import annotations

import codecs
import logging
import os
import re
import sys
import time
from typing import IO, Callable

log = logging.getLogger("gptforge")

PROGRESS_EVERY = 30.0  # seconds between progress-bar lines sent to the log handlers (Prefect's UI)
# Anywhere in a line: another process's unterminated output (a message printed at interpreter
# exit, say) can run into the start of a log line.
_LOG_LINE = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) gptforge: (.*)$")
_ERROR_PREFIX = "gptforge: error: "


class ChildOutput:
    """A child's output (merged stdout and stderr), fed in chunks as it is read.

    Written through to this process's stderr as it comes, so the terminal shows it as if the
    child ran here (progress bars redraw in place). Each complete line also goes, as a log
    record, to the `gptforge` logger's handlers other than consoles: in a Prefect flow run that
    is Prefect's API handler, so the flow run's logs in the UI show the child's log lines (at
    their own level, without their prefix) and, every PROGRESS_EVERY seconds, its progress bar.
    `on_line`, when given, sees every complete line too (the last redraw of a progress bar).
    """

    def __init__(self, on_line: Callable[[str], None] | None = None) -> None:
        self.on_line = on_line
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.pending = ""  # the current line: a progress bar redraws it after each "\r"
        self.last_progress = time.monotonic()
        self.last_error: str | None = None

    def drain(self, stream: IO[bytes]) -> None:
        """Feed everything `stream` (the child's stdout pipe) yields until its end, then close
        both: the end comes when the child and every process that shares the pipe have exited."""
        try:
            while chunk := os.read(stream.fileno(), 65536):
                self.feed(chunk)
            self.close()
        finally:
            stream.close()

    def feed(self, chunk: bytes, final: bool = False) -> None:
        text = self.decoder.decode(chunk, final=final)
        sys.stderr.write(text)
        sys.stderr.flush()
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self._line(_last_redraw(line))
        if "\r" in self.pending:
            self.pending = "\r" + _last_redraw(self.pending)  # keep only the newest redraw
            if time.monotonic() - self.last_progress >= PROGRESS_EVERY:
                self.last_progress = time.monotonic()
                _to_log_handlers(logging.INFO, self.pending.strip())

    def close(self) -> None:
        self.feed(b"", final=True)
        if self.pending.strip():
            self._line(_last_redraw(self.pending))

    def _line(self, line: str) -> None:
        line = line.strip()
        if not line:
            return
        if self.on_line is not None:
            self.on_line(line)
        self._record(line)

    def _record(self, line: str) -> None:
        level, message = logging.INFO, line
        start = line.find(_ERROR_PREFIX)
        m = _LOG_LINE.search(line)
        if m and (start < 0 or m.start() < start):  # a worker's gptforge log line: its level, not its prefix
            start, level, message = m.start(), logging.getLevelName(m.group(1)), m.group(2)
        elif start >= 0:
            level, message = logging.ERROR, line[start + len(_ERROR_PREFIX) :]
            self.last_error = message
        else:
            start = 0
        if start:  # another rank's unterminated output ran into this line: its own record first
            self._record(line[:start])
        _to_log_handlers(level, message)


def _last_redraw(line: str) -> str:
    parts = [part for part in line.split("\r") if part.strip()]
    return parts[-1] if parts else ""


def _to_log_handlers(level: int, message: str) -> None:
    if not message or not log.isEnabledFor(level):
        return
    record = log.makeRecord(log.name, level, "child", 0, "%s", (message,), None)
    for handler in log.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            continue  # a console: it has shown the raw output already
        if record.levelno >= handler.level:
            handler.handle(record)
