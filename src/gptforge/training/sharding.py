"""`pretrain.strategy: fsdp`: the model's parameters, gradients and AdamW states split across the
processes with PyTorch's FSDP2, and the sharded checkpoints that go with it.

gptforge.training.parallelize applies `fully_shard` from outside the model, as torchtitan's
`parallelize` does: once on every transformer block, then on the root (embeddings, final
LayerNorm and the tied lm_head). Each parameter becomes a DTensor holding 1/N of its rows on each process; a
block's whole weights exist only between the all-gather before its forward (and backward) and
the free after it (`reshard_after_forward`; off, they stay gathered from forward to backward:
ZeRO-2's memory, one all-gather less). Gradients are reduce-scattered, so each process keeps
and steps only its own rows. On CUDA with bf16 a mixed-precision policy gathers and computes in
bf16 and reduces gradients in fp32, over fp32 master weights.

Checkpoints (`save_sharded`/`load_sharded`): every process writes its shards of the model and
of AdamW's state through `torch.distributed.checkpoint` (DCP) into `dcp/` of the step folder,
whose contract stays that of gptforge.training.checkpoint (whole or absent, checksums, newest
intact one on resume). DCP reshards on load, so a checkpoint written by N processes loads into
M (gptforge.modeling.weights.load_model reads one in a single process).

`state_bytes` counts what one process holds of parameters, gradients and optimizer states: the
figure `gptforge plan` predicts and the tests measure.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from gptforge.modeling.gpt import GPT
from gptforge.modeling.weights import SHARDS_DIR  # noqa: F401 - inside a step folder


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value on every process (a collective); any other tensor as it is. For
    what `torch.nn.utils.clip_grad_norm_` returns over sharded gradients."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model: GPT, *, to_rank0_cpu: bool) -> dict[str, torch.Tensor]:
    """The whole weights gathered from the shards (a collective: every process calls it).
    `to_rank0_cpu`: only process 0 gets them, on the CPU (the others an empty dict); else every
    process gets them on its device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=to_rank0_cpu))


def unsharded_copy(model: GPT, device: torch.device, *, everywhere: bool = True) -> GPT | None:
    """An ordinary GPT with the sharded model's current weights on `device` (a collective), for
    what runs on some processes only or on uneven work (samples, HellaSwag, the final save).
    `everywhere` False: gathered through process 0's CPU memory, and only process 0 gets it."""
    from gptforge.modeling.weights import empty_model

    state = full_state_dict(model, to_rank0_cpu=not everywhere)
    if not everywhere and dist.get_rank() != 0:
        return None
    copy = empty_model(model.config, device)
    copy.load_state_dict(state, strict=True)
    copy.train(model.training)
    return copy


def _state(model: GPT, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def save_sharded(folder: str | os.PathLike, model: GPT, optimizer) -> None:
    """Every process writes its shards of the model and AdamW's state to `folder` (a collective;
    process 0 also writes DCP's metadata)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer), checkpoint_id=str(folder))


def load_sharded(folder: str | os.PathLike, model: GPT, optimizer) -> None:
    """Read a checkpoint written by `save_sharded` (at any world size: DCP reshards) into the
    sharded `model` and `optimizer` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def state_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes this process holds of parameters, gradients and optimizer states (local shards of
    DTensors; ZeroRedundancyOptimizer's local share; a tied parameter once)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def size(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    params = list({id(p): p for p in model.parameters()}.values())
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its share in .optim
    states = [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    return {
        "params": sum(size(p) for p in params),
        "grads": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(size(t) for t in states),
    }
