"""DVC as the pipeline runs it: the stages of dvc.yaml, the environment of the `dvc` child
processes, the default remote, `dvc pull`/`dvc push` (a remote's failure is a warning, in
words), and `dvc repro` streamed to the log, with what it says about each stage noted as it
goes (`ReproOutcome`) and the line that says why it failed (`best_error`).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from gptforge.errors import BadInput, Stopped
from gptforge.runtime.child_output import ChildOutput
from gptforge.runtime.signals import forwarded_to

log = logging.getLogger("gptforge")

DVC_FILE = "dvc.yaml"

# What `dvc repro` prints about each stage (dvc/stage/run.py, stage/__init__.py, stage/cache.py).
_RUNNING = re.compile(r"^Running stage '([^']+)':")
_SKIPPED = re.compile(r"^Stage '([^']+)' didn't change, skipping")
_RESTORED = re.compile(r"^Stage '([^']+)' is cached - skipping run")
_LOCKED = re.compile(r"^Updating lock file")
_ERROR = re.compile(r"^(?:gptforge: error: |ERROR: )(.*)")
_OUR_ERROR = "gptforge: error: "


def dvc_stages(root: Path = Path(".")) -> dict[str, dict]:
    """The stages of dvc.yaml, in order: name -> its definition (read once per run)."""
    path = root / DVC_FILE
    if not path.is_file():
        raise BadInput(f"{path} not found: run the pipeline from the repository root")
    try:
        stages = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("stages") or {}
    except yaml.YAMLError as e:
        raise BadInput(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    return dict(stages)


def check_stage_names(names: Sequence[str], known: Sequence[str] | Mapping[str, Any]) -> None:
    """Each name a stage of dvc.yaml, or GROUP@KEY of a foreach stage (evaluate@instruct: DVC
    itself says whether the params give GROUP that KEY)."""
    import difflib

    for name in names:
        group, at, _ = name.partition("@")
        if at and isinstance(known, Mapping) and "foreach" in (known.get(group) or {}):
            continue
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise BadInput(f"unknown stage '{name}'{hint}; stages in {DVC_FILE}: {', '.join(known)}")


def stage_metrics_files(spec: Mapping[str, Any], root: Path = Path(".")) -> list[Path]:
    """The metrics files a stage's dvc.yaml definition declares."""
    return [root / (next(iter(entry)) if isinstance(entry, dict) else entry) for entry in spec.get("metrics") or []]


def dvc_command(*args: str) -> list[str]:
    # `python -m dvc` from this interpreter: the venv's dvc, whatever PATH a worker has.
    return [sys.executable, "-m", "dvc", *args]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of `dvc` and the stage commands it runs: this interpreter's scripts
    first on PATH (dvc.yaml's `gptforge ...` commands), analytics off, plus `extra`."""
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "DVC_NO_ANALYTICS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.update({k: v for k, v in (extra or {}).items() if v is not None})
    return env


def default_remote(env: Mapping[str, str]) -> str | None:
    out = subprocess.run(dvc_command("remote", "default"), capture_output=True, text=True, env=dict(env), timeout=120)
    name = out.stdout.strip()
    return name if out.returncode == 0 and name else None


def _dvc_transfer(action: str, remote: str, env: Mapping[str, str]) -> str:
    """`dvc pull`/`dvc push`; returns what happened, in words. Never raises for the remote."""
    args = [action, "--remote", remote] + (["--allow-missing"] if action == "pull" else [])
    log.info("dvc %s (remote %s)", action, remote)
    out = subprocess.run(dvc_command(*args), capture_output=True, text=True, env=dict(env))
    if out.returncode == 0:
        # DVC reports files it could not find (a remote that is empty, or, for an HTTP remote,
        # unreachable) as a warning and succeeds: pass it on.
        warnings = [
            line.strip()[len("WARNING: ") :]
            for line in (out.stderr + out.stdout).splitlines()
            if line.strip().startswith("WARNING: ")
        ]
        if warnings:
            log.warning("dvc %s (remote %s): %s", action, remote, warnings[0])
            return f"done with a warning: {warnings[0]}"
        last = [line for line in out.stdout.splitlines() if line.strip()]
        return f"done ({last[-1].strip()})" if last else "done"
    reason = _last_error(out.stderr + out.stdout) or f"exit code {out.returncode}"
    verb = "ran locally without pulling" if action == "pull" else "did not push"
    log.warning(
        "dvc %s %s remote %s failed: %s; %s", action, "from" if action == "pull" else "to", remote, reason, verb
    )
    return f"failed: {reason} ({verb})"


def dvc_pull(remote: str, env: Mapping[str, str]) -> str:
    return _dvc_transfer("pull", remote, env)


def dvc_push(remote: str, env: Mapping[str, str]) -> str:
    return _dvc_transfer("push", remote, env)


def _last_error(text: str) -> str | None:
    return best_error([line.strip() for line in text.splitlines() if _ERROR.match(line.strip())])


def best_error(lines: Sequence[str]) -> str | None:
    """The line that says why: a stage's own `gptforge: error:` line over DVC's `ERROR: failed
    to reproduce ...`, the last of either."""
    ours = [line for line in lines if line.startswith(_OUR_ERROR)]
    pick = (ours or list(lines))[-1:]
    return _ERROR.match(pick[0]).group(1).strip() if pick else None


@dataclass
class ReproOutcome:
    returncode: int
    events: list[tuple[float, str, str]]  # (monotonic time, kind, stage)
    errors: list[str]
    end: float


def dvc_repro(stages: Sequence[str], env: Mapping[str, str], force: bool = False) -> ReproOutcome:
    """Run `dvc repro`, streaming its output to the log, and note what it says about each stage."""
    args = ["repro", *(["--force"] if force else []), *stages]
    log.info("dvc %s", " ".join(args))
    # Its own process group: Ctrl-C or SIGTERM (a worker cancelling the run, `docker stop`) is
    # forwarded to dvc and the stage it runs, so a training stage checkpoints before it stops.
    proc = subprocess.Popen(
        dvc_command(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    events: list[tuple[float, str, str]] = []
    errors: list[str] = []

    def note(line: str) -> None:
        now = time.monotonic()
        for kind, pattern in (("running", _RUNNING), ("skipped", _SKIPPED), ("restored", _RESTORED)):
            if m := pattern.match(line):
                events.append((now, kind, m.group(1)))
        if _LOCKED.match(line):
            events.append((now, "locked", ""))
        if _ERROR.match(line):
            errors.append(line)

    # Shown as it comes (progress bars redraw in place, as under `dvc repro`); whole lines go to
    # the flow run's log in Prefect's UI.
    output = ChildOutput(on_line=note)
    with forwarded_to(proc) as received:
        assert proc.stdout is not None
        output.drain(proc.stdout)  # until dvc and the stage it runs have both exited
        returncode = proc.wait()
    if received:
        name = signal.Signals(received[0]).name
        raise Stopped(
            received[0],
            f"pipeline stopped by {name}: dvc repro and its stage were stopped (a training "
            "stage saves a checkpoint first); run it again to continue",
        )
    return ReproOutcome(returncode, events, errors, time.monotonic())
