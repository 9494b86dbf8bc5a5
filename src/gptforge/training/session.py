"""What the pretraining loop works on, and its checkpoints: `Session` (built by
`gptforge.training.loop.setup`, advanced by `train_loop`) and the protocol that makes a resume
exact: the fingerprint of the settings and data a checkpoint was made with, the checkpoint to
continue from (`pretrain.resume`), and saving the session as a step folder (weights, optimizer
and grad-scaler state, the data position, the step and every process's RNG states). The step
folder itself (whole or absent, checksums, loading) is gptforge.training.checkpoint's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptforge.config.schema import LLAMA_DEFAULTS, Config
from gptforge.errors import BadInput
from gptforge.modeling.gpt import GPT
from gptforge.modeling.weights import save_model, write_model_config
from gptforge.training import checkpoint as ckpt
from gptforge.training import sharding
from gptforge.training.loader import ShardLoader
from gptforge.training.runtime import Runtime

log = logging.getLogger("gptforge")

# Settings that change what the training computes: a checkpoint made under other values is
# not this run's and must not be resumed (a different lr or max_steps changes every update).
MUON_KEYS = ("optimizer", "muon_lr", "muon_momentum", "muon_weight_decay")
FINGERPRINT_KEYS = (
    "seed",
    "init_from",
    "batch_size",
    "batch_tokens",
    "max_steps",
    "lr",
    "min_lr",
    "warmup_steps",
    "weight_decay",
    "betas",
    "grad_clip",
    "precision",
)


@dataclass
class Session:
    """What the training loop works on: built by `setup`, advanced by `train_loop`."""

    cfg: Config
    rt: Runtime
    enc: Any
    grad_accum: int
    train_loader: ShardLoader
    val_loader: ShardLoader
    fingerprint: str
    hellaswag: list | None
    model: Any  # what runs the batches: the model, compiled and/or DDP-wrapped
    raw_model: GPT  # what gets saved (under fsdp: the sharded model itself, see `plain_model`)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    out_dir: Path
    step: int = 0
    last_ckpt: Path | None = None
    train_loss: float = float("nan")
    hellaswag_result: dict | None = None
    history: list = field(default_factory=list)  # rows of plots/pretrain.csv
    step_times: list = field(default_factory=list)
    train_seconds: float = 0.0  # the optimizer steps' wall time in this process (evaluations not counted)
    sharded: bool = False  # pretrain.strategy fsdp on several processes

    def plain_model(self, everywhere: bool = True) -> GPT | None:
        """The model as an ordinary GPT with whole weights: under fsdp a copy gathered from the
        shards (a collective: every process calls it; `everywhere` False: on process 0 only, the
        others get None), else the model itself."""
        if not self.sharded:
            return self.raw_model
        return sharding.unsharded_copy(self.raw_model, self.rt.device, everywhere=everywhere)


# ---------------------------------------------------------------------------------------------
# Which checkpoint a run continues from


def fingerprint(cfg: Config, manifest: dict, world: int) -> str:
    keys = {k: getattr(cfg.pretrain, k) for k in FINGERPRINT_KEYS}
    if cfg.pretrain.strategy != "ddp":  # (ddp runs keep the fingerprints they had before strategies)
        keys["strategy"] = cfg.pretrain.strategy
    if cfg.pretrain.optimizer != "adamw":  # (and adamw runs the ones they had before muon)
        keys.update({k: getattr(cfg.pretrain, k) for k in MUON_KEYS})
    blob = json.dumps(
        {
            "model": _model_keys(cfg),
            "pretrain": keys,
            "world": world,
            "shards": [s["sha256"] for s in manifest["shards"]],
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _model_keys(cfg: Config) -> dict:
    """The model section as the fingerprint reads it: a gpt2 run's as it was before the llama keys
    existed (so its checkpoints resume across that change), every key for llama."""
    model = cfg.model.model_dump(mode="json")
    if cfg.model.arch == "gpt2":
        for key in ("arch", *LLAMA_DEFAULTS):
            model.pop(key)
        model["bias"] = True if model["bias"] is None else model["bias"]
    return model


def find_resume(cfg: Config, out_dir: Path, fp: str) -> Path | None:
    """The checkpoint to continue from, or None to start over (`pretrain.resume`)."""
    resume = cfg.pretrain.resume
    if resume == "never":
        return None
    if resume != "auto":
        folder = Path(resume)
        reason = ckpt.verify(folder) if folder.is_dir() else f"{folder} is not a folder"
        if reason:
            raise BadInput(f"pretrain.resume: cannot resume from {folder}: {reason}")
        return folder
    folder = ckpt.newest_good(out_dir)
    if folder is None:
        return None
    made_by = ckpt.load_state(folder).get("fingerprint")
    if made_by != fp:
        log.warning("not resuming from %s: it was made with other model/pretrain params or data", folder)
        return None
    return folder


def check_resumable(folder: Path, sharded: bool) -> None:
    """A sharded checkpoint resumes under fsdp only, a whole one under ddp/zero1 only."""
    has_shards = (folder / sharding.SHARDS_DIR).is_dir()
    if has_shards != sharded:
        made, now = ("fsdp", "ddp/zero1") if has_shards else ("ddp/zero1", "fsdp")
        raise BadInput(
            f"pretrain.resume: {folder} was written under strategy {made} and this run is {now}: "
            f"resume it under {made}, or start from its weights with pretrain.init_from"
        )


# ---------------------------------------------------------------------------------------------
# Saving


def _rng_states(s: Session) -> dict:
    """Process 0's RNG states, and every process's when there are several (a collective): each
    resumes its own dropout stream."""
    mine = ckpt.capture_rng()
    if not s.rt.ddp:
        return {"rng": mine}
    every = [None] * s.rt.world_size
    dist.all_gather_object(every, mine)
    return {"rng": every[0], "rng_by_rank": every}


def save_checkpoint(s: Session) -> Path | None:
    """The step folder (see gptforge.training.checkpoint). Called on every process: under ddp and
    zero1 process 0 writes it alone; under fsdp every process writes its shards into it first.
    Returns the folder on process 0, None on the others."""
    rng = _rng_states(s)
    if not s.rt.master and not s.sharded:
        return None
    state = {
        "step": s.step,
        "scaler": s.scaler.state_dict(),
        "loader": s.train_loader.state_dict(),
        **rng,
        "fingerprint": s.fingerprint,
    }
    keep_last = s.cfg.pretrain.keep_last
    if not s.sharded:
        state["optimizer"] = s.optimizer.state_dict()
        return ckpt.save_checkpoint(
            s.out_dir, s.step, write_model=lambda d: save_model(s.raw_model, d), state=state, keep_last=keep_last
        )
    # Every process writes its shards to one hidden folder beside the step folders; process 0 then
    # moves it into the step folder it builds, which appears whole (checksums included) or not at all.
    shards = s.out_dir / f".shards_step_{s.step:08d}"
    if s.rt.master:
        for leftover in s.out_dir.glob(".shards_step_*"):  # a kill's, between the shards and the rename
            shutil.rmtree(leftover, ignore_errors=True)
    dist.barrier()
    sharding.save_sharded(shards, s.raw_model, s.optimizer)
    dist.barrier()
    folder = None
    if s.rt.master:

        def write_model(d: Path) -> None:
            write_model_config(s.raw_model, d)
            os.replace(shards, d / sharding.SHARDS_DIR)

        folder = ckpt.save_checkpoint(s.out_dir, s.step, write_model=write_model, state=state, keep_last=keep_last)
    dist.barrier()
    return folder
