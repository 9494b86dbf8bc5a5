"""AdamW as every gptforge training loop builds it (pretraining, both fine-tunings), whole on
every process or, for `pretrain.strategy: zero1`, with its states sharded (`zero1_adamw`).

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
