"""Fine-tuning on several processes (`classify`, `instruct`: `nproc_per_node` above 1 under
torchrun; `preference` goes through trl's own accelerate support).

Every process builds the same model and the same epoch of batches (the order depends only on the
seed), then trains on its own part of every batch (`part`): contiguous rows, disjoint, together
the whole batch. Each part's loss is scaled so that the gradient DDP or FSDP averages over the
processes is exactly the one-process gradient of the whole batch (a mean over its examples or
its target tokens), whatever the part sizes: the batch size keeps its meaning and the run
follows the one-process run up to float rounding.

`wrap` puts the model under the stage's strategy through gptforge.training.parallelize (the one
way pretraining wraps its model too: activation checkpointing, then the strategy):
- `ddp`: DistributedDataParallel, a whole copy on every process, gradients all-reduced;
- `fsdp`: FSDP2 `fully_shard` on every transformer layer (the module kinds named in the models'
  `_no_split_modules`: our GPT's Block, Llama's and Qwen's decoder layers) and then the root, so
  weights, gradients and AdamW states are split. Under LoRA the frozen base is sharded with the
  adapters inside its layers; only the adapters have gradients and optimizer states. Before
  sharding, process 0 keeps a meta-device twin of the model (no memory), which `gathered` fills
  with the whole weights at the end for what process 0 alone does: merge, measure, answer, save.

The loss runs inside the wrapped module (`LossOf`): DDP and FSDP act in the root module's
forward, and the instruct loss of a transformers model calls the decoder and the head itself.

`GPTFORGE_BATCH_TRACE=DIR` writes, per process, one line per optimizer step with a short hash of
each row it trained on (`DIR/rank{N}.jsonl`): how the tests check that the parts are disjoint.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from gptforge.training.runtime import Runtime

TRACE_ENV = "GPTFORGE_BATCH_TRACE"


def part(
    batch: Sequence[Any], rt: Runtime, weight: Callable[[Sequence[Any]], float] = len, *, trace: bool = False
) -> tuple[list[Any], float]:
    """(this process's rows of `batch`, the factor its mean loss is multiplied by).

    The factor is world x weight(part) / weight(batch), `weight` counting what the loss averages
    over (`len`: examples; the instruct stage: target tokens). A process whose part is empty (a
    last batch smaller than the world) runs the first row at factor 0: it still takes part in the
    collectives of the forward and the backward. `trace`: a training batch, written to the
    batch trace when GPTFORGE_BATCH_TRACE is set.
    """
    if rt.world_size == 1:
        rows, factor = list(batch), 1.0
    else:
        lo, hi = len(batch) * rt.rank // rt.world_size, len(batch) * (rt.rank + 1) // rt.world_size
        rows = list(batch[lo:hi])
        if rows:
            factor = rt.world_size * weight(rows) / weight(batch)
        else:
            rows, factor = list(batch[:1]), 0.0
    if trace:
        _trace(rows if factor else [], rt)
    return rows, factor


def _trace(rows: Sequence[Any], rt: Runtime) -> None:
    folder = os.environ.get(TRACE_ENV)
    if not folder:
        return
    digests = [hashlib.sha1(repr(tuple(map(_plain, row))).encode()).hexdigest()[:16] for row in rows]
    path = Path(folder) / f"rank{rt.rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(digests) + "\n")


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def alone(rt: Runtime) -> Runtime:
    """`rt` as one process: for what process 0 does by itself at the end (no collectives)."""
    return dataclasses.replace(rt, rank=0, world_size=1, ddp=False)


def reduce_sums(values: Sequence[float], rt: Runtime) -> list[float]:
    """The sums over the processes of `values` (float64 on the CPU or this process's GPU)."""
    if rt.world_size == 1:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=rt.device)
    dist.all_reduce(t)
    return t.tolist()


def gather_rows(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """Every process's rows of `t` (on the CPU), concatenated in rank order (small tensors:
    evaluation logits)."""
    if rt.world_size == 1:
        return t.cpu()
    import torch.distributed as dist

    every: list[Any] = [None] * rt.world_size
    dist.all_gather_object(every, t.cpu())
    return torch.cat(every)


class LossOf(nn.Module):
    """`fn(model, *args)` as the forward of a module holding `model`: what DDP and FSDP wrap, so
    that a loss that calls into the model's parts (not its forward) still runs inside theirs."""

    def __init__(self, model: nn.Module, fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *args):
        return self.fn(self.model, *args)


@dataclasses.dataclass
class Wrapped:
    """The model as it trains, and how to get the whole model back for process 0."""

    module: nn.Module  # call this in training (DDP, FSDP, or the model itself)
    model: nn.Module  # the model `wrap` was given (under DDP it is the trained one; under FSDP sharded)
    strategy: str | None  # None: one process
    twin: nn.Module | None = None  # fsdp, process 0: the model's structure on the meta device
    prefix: str = ""  # what the wrapping adds in front of the model's parameter names


def wrap(
    model: nn.Module,
    rt: Runtime,
    strategy: str,
    *,
    loss: Callable[..., torch.Tensor] | None = None,
    param: str,
    activation_checkpointing: bool = False,
    find_unused_parameters: bool = False,
) -> Wrapped:
    """`model` (on `rt.device`) as gptforge.training.parallelize wraps it: activation
    checkpointing, then `strategy` when there is more than one process; `loss`, when given, runs
    inside the wrapped forward (`LossOf`)."""
    from gptforge.training.parallelize import parallelize

    root: nn.Module = LossOf(model, loss) if loss is not None else model
    prefix = "model." if loss is not None else ""
    several = rt.world_size > 1
    # fsdp: process 0's meta twin of the model as it is, before any wrapping or sharding
    twin = meta_copy(model) if several and strategy == "fsdp" and rt.master else None
    module = parallelize(
        model,
        rt,
        strategy=strategy,
        param=param,
        activation_checkpointing=activation_checkpointing,
        root=root,
        find_unused_parameters=find_unused_parameters,
    )
    return Wrapped(module, model, strategy if several else None, twin, prefix)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters are on the meta device (no memory) and whose buffers
    are real copies (small; some, as rotary frequencies, are in no state dict)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def gathered(w: Wrapped) -> nn.Module | None:
    """The whole trained model on process 0 (a collective under FSDP: every process calls it);
    None on the other processes. Under DDP and on one process it is `w.model` itself."""
    if w.strategy != "fsdp":
        import torch.distributed as dist

        from gptforge.training.parallelize import strip_activation_checkpointing

        return strip_activation_checkpointing(w.model) if not dist.is_initialized() or dist.get_rank() == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(w.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if w.twin is None:
        return None
    state = {k[len(w.prefix) :] if k.startswith(w.prefix) else k: v for k, v in state.items()}
    ties = _tied_names(w.twin)
    w.twin.load_state_dict(state, strict=True, assign=True)
    _retie(w.twin, ties)
    return w.twin


def _tied_names(model: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Make the parameters that were one tensor (tied embeddings) one tensor again after an
    assigning load, which gives each name its own."""
    for first, *others in ties:
        shared = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, leaf, shared)


def barrier(rt: Runtime) -> None:
    if rt.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
