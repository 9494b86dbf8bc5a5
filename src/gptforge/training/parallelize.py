"""One way to wrap a model for training: `parallelize(model, rt, ...)`, applied from outside the
model in torchtitan's order: activation checkpointing on each transformer layer, then
torch.compile, then the data-parallel strategy (DDP, or FSDP2 on each layer and then the root).
Pretraining (gptforge.training.loop) and the fine-tuning stages that wrap a model themselves
(gptforge.finetune.distributed.wrap) both call it, for our GPT and for any transformers model.

The transformer layers are the modules whose class the model names in `_no_split_modules` (our
GPT's Block, Llama's and Qwen's decoder layers): the units that checkpointing recomputes and
FSDP gathers one at a time. Activation checkpointing puts each layer inside torch's
`checkpoint_wrapper` (non-reentrant, RNG state kept so dropout recomputes the same): in the
backward pass the layer's forward runs again instead of its activations being kept, ~1/3 more
compute for the memory of one layer's input. The wrapper keeps the state dict's names (its hooks
drop its prefix) and answers attribute lookups from the layer, so saving, loading, generating and
LoRA merging see the model as it was; `strip_activation_checkpointing` takes the wrappers out.

Compile: under FSDP each layer is compiled before it is sharded (FSDP's hooks stay outside the
compiled graphs), otherwise the whole model once. FSDP2: every layer, then the root (whose
parameters, the embeddings and the tied head, are the first the backward needs: kept gathered
from the forward on, one all-gather less); on CUDA with bf16 a mixed-precision policy gathers and
computes in bf16 and reduces gradients in fp32 over fp32 master weights. DDP: one
DistributedDataParallel around the root (ZeRO-1 is the optimizer's part; its model is DDP's).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gptforge.errors import BadInput
from gptforge.training.runtime import Runtime


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The modules whose class some module of `model` names in `_no_split_modules`, in order."""
    kinds = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    return [m for m in model.modules() if type(m).__name__ in kinds]


def check_strategy(rt: Runtime, strategy: str | None, param: str) -> None:
    """FSDP keeps fp32 master weights and computes in bf16: fp16's loss scaler does not take its
    sharded gradients, so fp16 under fsdp is refused (BadInput naming `param`)."""
    if strategy == "fsdp" and rt.world_size > 1 and rt.precision == "fp16":
        raise BadInput(
            f"{param}.strategy fsdp runs bf16 or fp32, not fp16 (its loss scaler does not take sharded "
            f"gradients): set {param}.precision to bf16"
        )


def checkpoint_activations(model: nn.Module) -> list[nn.Module]:
    """Put every transformer layer of `model` inside torch's checkpoint wrapper, in place, and
    return the wrapped layers. A transformers model stops using its KV cache in training (a cache
    filled again by each recomputation is wrong, and useless there)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

    layers = [m for m in transformer_layers(model) if not isinstance(m, CheckpointWrapper)]
    if not layers:
        raise BadInput(f"{type(model).__name__} names no transformer layer to checkpoint (no _no_split_modules)")
    owners = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    wrapped = []
    for layer in layers:
        parent, name = owners[id(layer)]
        wrapper = checkpoint_wrapper(layer, preserve_rng_state=True)
        parent.register_module(name, wrapper)
        wrapped.append(wrapper)
    for module in model.modules():  # the transformers models inside (a classifier's backbone)
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None):
            config.use_cache = False
    return wrapped


def strip_activation_checkpointing(model: nn.Module) -> nn.Module:
    """`model` with every checkpoint wrapper replaced by the layer inside it (in place)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, CheckpointWrapper):
                parent.register_module(name, child._checkpoint_wrapped_module)
    return model


def parallelize(
    model: nn.Module,
    rt: Runtime,
    *,
    strategy: str | None,
    param: str,
    activation_checkpointing: bool = False,
    compile: bool = False,
    reshard_after_forward: bool = True,
    root: nn.Module | None = None,
    find_unused_parameters: bool = False,
) -> nn.Module:
    """The module to call in training: `model` (on `rt.device`) with activation checkpointing,
    compile and `strategy` (ddp | zero1 | fsdp; ignored on one process) applied, in that order.
    `root` (default `model`) is what DDP or FSDP wraps at the top: a module holding `model` whose
    forward computes the loss (gptforge.finetune.distributed.LossOf). FSDP shards `model` in
    place (its parameters become DTensors): build the optimizer after this call."""
    check_strategy(rt, strategy, param)
    root = model if root is None else root
    layers = checkpoint_activations(model) if activation_checkpointing else transformer_layers(model)
    sharded = strategy == "fsdp" and rt.world_size > 1
    if compile and sharded:
        for layer in layers:  # before sharding: FSDP's hooks stay outside the compiled graphs
            layer.compile()
    elif compile:
        root = torch.compile(root)
    if rt.world_size == 1:
        return root
    if sharded:
        return _shard(root, layers, rt, reshard_after_forward, param, model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [rt.device.index] if rt.device.type == "cuda" else None
    return DDP(root, device_ids=ids, find_unused_parameters=find_unused_parameters)


def _shard(
    root: nn.Module, layers: list[nn.Module], rt: Runtime, reshard_after_forward: bool, param: str, model: nn.Module
) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not layers:
        raise BadInput(
            f"{param}.strategy fsdp: {type(model).__name__} names no transformer layer to shard (no _no_split_modules)"
        )
    kw: dict = {"reshard_after_forward": reshard_after_forward}
    if rt.device.type == "cuda" and rt.precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(root, **{**kw, "reshard_after_forward": False})
    return root
