"""Pretraining on several processes: the pretrain stage launches itself under torchrun.

When `pretrain.nproc_per_node * pretrain.nnodes` is above 1 and this process is not already a
torchrun worker (torchrun sets `WORLD_SIZE`), the stage does not train in this process. It runs

    python -m torch.distributed.run --nproc_per_node N (--standalone | --nnodes M --rdzv_...)
        -m gptforge.cli pretrain --params SNAPSHOT

and waits. Each worker runs the ordinary stage (DDP in `gptforge.train`, without Prefect); global
rank 0 opens the stage's one MLflow run and writes the checkpoints, metrics and plots. This
process opens no MLflow run: it hands its tags (the Prefect flow run id) to rank 0 through
`GPTFORGE_RUN_TAGS`, shows the workers' output as it comes, forwards Ctrl-C and SIGTERM to
torchrun (which stops its workers), and returns the metrics rank 0 wrote.

SNAPSHOT is the config this process resolved and validated (params file + `-S` overrides),
written to a temporary file for the job's duration: every worker trains with exactly that.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from gptforge.config import Config, dump_yaml
from gptforge.errors import BadInput, StageFailed
from gptforge.signals import forwarded_to
from gptforge.tracking import TAGS_ENV, env_tags

log = logging.getLogger("gptforge")

PROGRESS_EVERY = 30.0  # seconds between progress-bar lines sent to the log handlers (Prefect's UI)
# Anywhere in a line: another rank's unterminated output (a message printed at interpreter exit,
# say) can run into the start of a worker's log line.
_LOG_LINE = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) gptforge: (.*)$")
_ERROR_PREFIX = "gptforge: error: "


def needs_launch(cfg: Config) -> bool:
    """More than one process asked for, and this process is not one of torchrun's workers."""
    return cfg.pretrain.world_size > 1 and "WORLD_SIZE" not in os.environ


def torchrun_command(cfg: Config, params_file: str | os.PathLike | None,
                     overrides: Sequence[str] = ()) -> list[str]:
    """The torchrun command line that runs `gptforge pretrain` on this node's processes."""
    p = cfg.pretrain
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(p.nproc_per_node)]
    if p.nnodes == 1:
        cmd.append("--standalone")  # a rendezvous on this machine, on a free port
    else:
        cmd += ["--nnodes", str(p.nnodes), "--rdzv_backend", p.rdzv_backend, "--rdzv_endpoint", p.rdzv_endpoint,
                "--rdzv_id", p.rdzv_id]
    cmd += ["--max_restarts", str(p.max_restarts), "-m", "gptforge.cli", "pretrain"]
    if params_file is not None:
        cmd += ["--params", str(params_file)]
    for override in overrides:
        cmd += ["-S", override]
    return cmd


def worker_env(tags: Mapping[str, Any] | None = None) -> dict[str, str]:
    """This process's environment (MLflow URI, parent run, DVC stage...) for the workers, plus:
    no Prefect (this process is the flow run) and the tags for rank 0's MLflow run."""
    env = dict(os.environ)
    env["GPTFORGE_PREFECT"] = "0"
    merged = {**env_tags(), **{k: v for k, v in (tags or {}).items() if v is not None}}
    if merged:
        env[TAGS_ENV] = json.dumps(merged, default=str)
    return env


def check_devices(cfg: Config) -> None:
    """One GPU per process: more processes than this node's GPUs fail here, not in every worker."""
    import torch

    p = cfg.pretrain
    if p.device != "cpu" and torch.cuda.is_available() and p.nproc_per_node > torch.cuda.device_count():
        raise BadInput(f"pretrain.nproc_per_node ({p.nproc_per_node}) is above the {torch.cuda.device_count()} "
                       "CUDA device(s) of this machine (one process per GPU)")


def launch_pretrain(cfg: Config, *, tags: Mapping[str, Any] | None = None,
                    metrics_path: str | os.PathLike = "metrics/pretrain.json") -> dict:
    """Run the pretrain stage under torchrun on this node and wait; the metrics of rank 0.

    Raises StageFailed with torchrun's exit code (and the last worker's one-line error) when
    the job fails. Returns {} on a node where rank 0 did not run (multi-node without a shared
    working directory): the metrics file is on rank 0's node.
    """
    check_devices(cfg)
    metrics_path = Path(metrics_path)
    before = _identity(metrics_path)
    p = cfg.pretrain
    with tempfile.TemporaryDirectory(prefix="gptforge-torchrun-") as tmp:
        snapshot = Path(tmp) / "params.yaml"
        snapshot.write_text(dump_yaml(cfg), encoding="utf-8")
        cmd = torchrun_command(cfg, snapshot)
        log.info("launching %d processes (%d node%s x %d): %s", p.world_size, p.nnodes, "s" if p.nnodes > 1 else "",
                 p.nproc_per_node, shlex.join(cmd))
        rc, signum, last_error = _run(cmd, worker_env(tags))
    if signum is not None:
        signal.raise_signal(signum)  # this process's own handler now: KeyboardInterrupt, Prefect's, or exit
        raise StageFailed(f"pretrain under torchrun stopped by {signal.Signals(signum).name}")
    if rc != 0:
        said = f": a worker said: {last_error}" if last_error else "; the workers' output above says why"
        raise StageFailed(f"pretrain under torchrun failed (exit code {rc}){said}")
    if _identity(metrics_path) in (None, before):
        log.info("%s was not written on this node: global rank 0 ran on another one", metrics_path)
        return {}
    return json.loads(metrics_path.read_text(encoding="utf-8"))


def _identity(path: Path) -> tuple[int, int] | None:
    """Which version of a file this is (rank 0 replaces it atomically: a new inode), or None.
    Compared before and after the job, so a stale file from an earlier run is not taken."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _run(cmd: list[str], env: dict[str, str]) -> tuple[int, int | None, str | None]:
    """Run torchrun in its own process group, stream its output, forward SIGINT/SIGTERM to it.
    Returns its exit code, the signal that stopped us (if any) and the last worker error line."""
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    # torchrun answers SIGINT/SIGTERM by stopping its workers and exiting; we keep reading until
    # it has, then act on the signal ourselves.
    with forwarded_to(proc) as received:
        output = _Output()
        try:
            assert proc.stdout is not None
            while chunk := os.read(proc.stdout.fileno(), 65536):
                output.feed(chunk)
            output.close()
            rc = proc.wait()
        finally:
            proc.stdout.close()
    return rc, (received[0] if received else None), output.last_error


class _Output:
    """The workers' output (torchrun's and every rank's, merged).

    Written through to this process's stderr as it comes, so the terminal and `dvc repro` show
    it as if the workers ran here (rank 0's progress bar included). Each complete line also
    goes, as a log record, to the `gptforge` logger's handlers other than consoles: in a Prefect
    flow run that is Prefect's API handler, so the flow run's logs in the UI show the workers'
    log lines and, every PROGRESS_EVERY seconds, rank 0's progress bar.
    """

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.pending = ""  # the current line: a progress bar redraws it after each "\r"
        self.last_progress = time.monotonic()
        self.last_error: str | None = None

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
        level, message = logging.INFO, line
        start = line.find(_ERROR_PREFIX)
        m = _LOG_LINE.search(line)
        if m and (start < 0 or m.start() < start):  # a worker's gptforge log line: its level, not its prefix
            start, level, message = m.start(), logging.getLevelName(m.group(1)), m.group(2)
        elif start >= 0:
            level, message = logging.ERROR, line[start + len(_ERROR_PREFIX):]
            self.last_error = message
        else:
            start = 0
        if start:  # another rank's unterminated output ran into this line: its own record first
            self._line(line[:start])
        _to_log_handlers(level, message)


def _last_redraw(line: str) -> str:
    parts = [part for part in line.split("\r") if part.strip()]
    return parts[-1] if parts else ""


def _to_log_handlers(level: int, message: str) -> None:
    if not message or not log.isEnabledFor(level):
        return
    record = log.makeRecord(log.name, level, "torchrun", 0, "%s", (message,), None)
    for handler in log.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            continue  # a console: it has shown the raw output already
        if record.levelno >= handler.level:
            handler.handle(record)
