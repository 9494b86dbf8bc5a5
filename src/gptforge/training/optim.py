"""AdamW as every gptforge training loop builds it (pretraining, both fine-tunings), whole on
every process or, for `pretrain.strategy: zero1`, with its states sharded (`zero1_adamw`); and
Muon with AdamW beside it for pretraining (`pretrain.optimizer: muon`, `muon_adamw`).

Weight decay on matrices and embeddings (dim >= 2) only: decaying biases and LayerNorm gains
just pulls them toward 0 without regularizing anything useful. The fused kernel (one launch
for every parameter) is used wherever this torch has it for the device: on CUDA, and on the
CPU since torch 2.4; `gptforge benchmark`'s fused_adamw variant measures what it does to the
whole training step on the device at hand. Imports torch only.
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

import torch


@functools.lru_cache(maxsize=None)
def fused_adamw_supported(device_type: str) -> bool:
    """Whether torch's fused AdamW runs on this device type (tried once on a 1-element tensor)."""
    try:
        param = torch.zeros(1, device=device_type, requires_grad=True)
        param.grad = torch.zeros_like(param)
        torch.optim.AdamW([param], fused=True).step()
        return True
    except Exception:  # a probe: no such device, no kernel for it (torch raises several kinds)
        return False


def _groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """The trainable parameters in two groups: decayed (dim >= 2) and not."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters")
    groups = [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def adamw(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    betas: Sequence[float] = (0.9, 0.999),
    device_type: str,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad, decay on dim >= 2 only; `fused` None: the
    fused kernel where supported. Raises ValueError when nothing is trainable."""
    if fused is None:
        fused = fused_adamw_supported(device_type)
    return torch.optim.AdamW(_groups(params, weight_decay), lr=lr, betas=tuple(betas), fused=fused)


def zero1_adamw(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    betas: Sequence[float] = (0.9, 0.999),
    device_type: str,
    fused: bool | None = None,
):
    """`adamw` with its states split across the processes of the default process group (ZeRO
    stage 1, torch's `ZeroRedundancyOptimizer`): each process keeps the moments of its share of
    the parameters, steps those, and broadcasts them to the others. The gradients are whole on
    every process (DDP's all-reduce), so clipping sees the same norm as under DDP.

    Its `state_dict()` is the consolidated state of all processes, and only after
    `consolidate_state_dict(to=0)` ran on every process (a collective), on process 0; its
    `load_state_dict` takes such a consolidated state and keeps this process's share."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if fused is None:
        fused = fused_adamw_supported(device_type)
    return ZeroRedundancyOptimizer(
        _groups(params, weight_decay), optimizer_class=torch.optim.AdamW, lr=lr, betas=tuple(betas), fused=fused
    )


def hidden_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable 2-D weights that are neither an embedding nor the output head: the blocks'
    linear layers, what Muon trains (embeddings and the head are lookups and a classifier, not
    maps between hidden states; modded-nanogpt keeps them on Adam)."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "lm_head", None)
    if head is not None:
        lookups.add(id(head.weight))
    return [p for p in model.parameters() if p.requires_grad and p.dim() == 2 and id(p) not in lookups]


class MuonAdamW:
    """torch's Muon (momentum orthogonalized by Newton-Schulz) for the hidden matrices and AdamW
    for every other parameter (embeddings, head, norms, biases), as modded-nanogpt's speedrun
    trains, behind the one optimizer interface the loop uses: `param_groups` (both optimizers'
    groups, each with `lr_scale`: the loop sets a group's lr to the schedule's lr times it),
    `zero_grad`, `step`, and a `state_dict` holding both."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self):
        return {**self.muon.state, **self.adamw.state}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> None:
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def muon_adamw(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: Sequence[float],
    muon_lr: float,
    muon_momentum: float,
    muon_weight_decay: float,
    device_type: str,
) -> MuonAdamW:
    """Muon at `muon_lr` for `hidden_matrices(model)`, AdamW at `lr` (decay on the embeddings and
    head only, as `adamw` does on dim >= 2) for the rest. Each group's `lr_scale` is its peak lr
    over `lr`, so one schedule drives both."""
    matrices = hidden_matrices(model)
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    if not matrices:
        raise ValueError("the model has no hidden matrices for Muon")
    muon = torch.optim.Muon(matrices, lr=muon_lr, weight_decay=muon_weight_decay, momentum=muon_momentum)
    for group in muon.param_groups:
        group["lr_scale"] = muon_lr / lr
    adam = adamw(rest, lr=lr, weight_decay=weight_decay, betas=betas, device_type=device_type)
    for group in adam.param_groups:
        group["lr_scale"] = 1.0
    return MuonAdamW(muon, adam)
