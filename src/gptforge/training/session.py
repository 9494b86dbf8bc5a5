"""What the pretraining loop works on: `Session` (built by `gptforge.training.loop.setup`,
advanced by `train_loop`) and its `fingerprint`, the settings and data a checkpoint was made with
(a checkpoint made under others is not this run's to resume). Saving a session and resuming one
is gptforge.training.checkpoint's protocol.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gptforge.config.schema import LLAMA_DEFAULTS, Config
from gptforge.modeling.gpt import GPT
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
