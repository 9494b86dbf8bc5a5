"""Training on several processes: a training stage launches itself under torchrun.

When a training stage's `nproc_per_node * distributed.nnodes` is above 1 (`pretrain.`,
`classify.`, `instruct.` or `preference.nproc_per_node`) and this process is not already a
torchrun worker (torchrun sets `WORLD_SIZE`), the stage does not train in this process. It runs

    python -m torch.distributed.run --nproc_per_node N (--standalone | --nnodes M --rdzv_...)
        -m gptforge.cli STAGE COMMAND --params SNAPSHOT

and waits. Each worker runs the ordinary stage (DDP, ZeRO-1 or FSDP2, without Prefect); global
rank 0 opens the stage's one MLflow run and writes the checkpoints, metrics and plots. This
process opens no MLflow run: it hands its tags (the Prefect flow run id) to rank 0 through
`GPTFORGE_RUN_TAGS`, shows the workers' output as it comes, forwards Ctrl-C and SIGTERM to
torchrun (which stops its workers), and returns the metrics rank 0 wrote.

SNAPSHOT is the config this process resolved and validated (params file + `-S` overrides),
written to a temporary file for the job's duration: every worker trains with exactly that.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gptforge.config.load import dump_yaml
from gptforge.config.schema import Config
from gptforge.errors import BadInput, StageFailed
from gptforge.runtime.child_output import ChildOutput
from gptforge.runtime.run_context import TAGS_ENV, env_tags
from gptforge.runtime.signals import forwarded_to

log = logging.getLogger("gptforge")


@dataclass(frozen=True)
class TrainingStage:
    section: str  # the config section with its nproc_per_node, strategy and device
    command: tuple[str, ...]  # its `gptforge` command
    metrics: str  # the metrics file rank 0 writes


TRAINING_STAGES = {
    "pretrain": TrainingStage("pretrain", ("pretrain",), "metrics/pretrain.json"),
    "finetune_classify": TrainingStage("classify", ("finetune", "classify"), "metrics/classify.json"),
    "finetune_instruct": TrainingStage("instruct", ("finetune", "instruct"), "metrics/instruct.json"),
    "finetune_preference": TrainingStage("preference", ("finetune", "preference"), "metrics/preference.json"),
    "train_reward": TrainingStage("reward", ("finetune", "reward"), "metrics/reward.json"),
    "finetune_rl": TrainingStage("rl", ("finetune", "rl"), "metrics/rl.json"),
}


def needs_launch(cfg: Config, stage: str = "pretrain") -> bool:
    """A training stage asking for more than one process, and this process is not one of
    torchrun's workers."""
    if stage not in TRAINING_STAGES or "WORLD_SIZE" in os.environ:
        return False
    return cfg.world_size(TRAINING_STAGES[stage].section) > 1


def torchrun_command(
    cfg: Config, params_file: str | os.PathLike | None, overrides: Sequence[str] = (), stage: str = "pretrain"
) -> list[str]:
    """The torchrun command line that runs the stage's `gptforge` command on this node's processes."""
    spec, d = TRAINING_STAGES[stage], cfg.distributed
    nproc = getattr(cfg, spec.section).nproc_per_node
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if d.nnodes == 1:
        cmd.append("--standalone")  # a rendezvous on this machine, on a free port
    else:
        cmd += [
            "--nnodes",
            str(d.nnodes),
            "--rdzv_backend",
            d.rdzv_backend,
            "--rdzv_endpoint",
            d.rdzv_endpoint,
            "--rdzv_id",
            d.rdzv_id,
        ]
    cmd += ["--max_restarts", str(d.max_restarts), "-m", "gptforge.cli", *spec.command]
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


def check_devices(cfg: Config, stage: str = "pretrain") -> None:
    """One GPU per process: more processes than this node's GPUs fail here, not in every worker."""
    import torch

    section = TRAINING_STAGES[stage].section
    p = getattr(cfg, section)
    if p.device != "cpu" and torch.cuda.is_available() and p.nproc_per_node > torch.cuda.device_count():
        raise BadInput(
            f"{section}.nproc_per_node ({p.nproc_per_node}) is above the {torch.cuda.device_count()} "
            "CUDA device(s) of this machine (one process per GPU)"
        )


def launcher(stage: str) -> Callable[..., dict]:
    """`launch_stage` for one stage, named `launch_<section>`: the step (Prefect task run) a
    launching flow run shows, `launch-pretrain`, `launch-instruct`, ..."""

    def launch(
        cfg: Config, *, tags: Mapping[str, Any] | None = None, metrics_path: str | os.PathLike | None = None
    ) -> dict:
        return launch_stage(stage, cfg, tags=tags, metrics_path=metrics_path)

    launch.__name__ = launch.__qualname__ = f"launch_{TRAINING_STAGES[stage].section}"
    return launch


launch_pretrain = launcher("pretrain")


def launch_stage(
    stage: str, cfg: Config, *, tags: Mapping[str, Any] | None = None, metrics_path: str | os.PathLike | None = None
) -> dict:
    """Run a training stage under torchrun on this node and wait; the metrics of rank 0.

    Raises StageFailed with torchrun's exit code (and the last worker's one-line error) when
    the job fails. Returns {} on a node where rank 0 did not run (multi-node without a shared
    working directory): the metrics file is on rank 0's node.
    """
    check_devices(cfg, stage)
    spec = TRAINING_STAGES[stage]
    metrics_path = Path(metrics_path or spec.metrics)
    before = _identity(metrics_path)
    nnodes = cfg.distributed.nnodes
    with tempfile.TemporaryDirectory(prefix="gptforge-torchrun-") as tmp:
        snapshot = Path(tmp) / "params.yaml"
        snapshot.write_text(dump_yaml(cfg), encoding="utf-8")
        cmd = torchrun_command(cfg, snapshot, stage=stage)
        log.info(
            "launching %d processes (%d node%s x %d): %s",
            cfg.world_size(spec.section),
            nnodes,
            "s" if nnodes > 1 else "",
            getattr(cfg, spec.section).nproc_per_node,
            shlex.join(cmd),
        )
        rc, signum, last_error = _run(cmd, worker_env(tags))
    if signum is not None:
        signal.raise_signal(signum)  # this process's own handler now: KeyboardInterrupt, Prefect's, or exit
        raise StageFailed(f"{stage} under torchrun stopped by {signal.Signals(signum).name}")
    if rc != 0:
        said = f": a worker said: {last_error}" if last_error else "; the workers' output above says why"
        raise StageFailed(f"{stage} under torchrun failed (exit code {rc}){said}")
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
    proc = subprocess.Popen(
        cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    # torchrun answers SIGINT/SIGTERM by stopping its workers and exiting; we keep reading until
    # it has, then act on the signal ourselves.
    with forwarded_to(proc) as received:
        output = ChildOutput()
        assert proc.stdout is not None
        output.drain(proc.stdout)
        rc = proc.wait()
    return rc, (received[0] if received else None), output.last_error
