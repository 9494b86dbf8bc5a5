"""What the fine-tuning recipes share: where they run, the base model they start from, LoRA,
the optimizer and the epoch loop.

`classify.py` and `instruct.py` are recipes that wire these pieces; nothing here knows about
either task. The functions take plain values (not the config object) and the dotted config
name (`param`) of the value they check, so an error names the key the user has to change.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from gptforge.errors import BadInput, StageFailed
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.hf_causal import resolved_precision
from gptforge.modeling.hf_convert import load_pretrained
from gptforge.runtime.tracking import NullRun
from gptforge.training.optim import adamw
from gptforge.training.runtime import Runtime

log = logging.getLogger("gptforge")


# ---------------------------------------------------------------------------------------------
# Where and how we run


def check_whole_batch(param: str, batch_size: int, world_size: int) -> None:
    """A trl stage's batch_size is the whole batch, split evenly over the processes: one line
    when it cannot be (the CLI checks it before launching: pipeline.stages.check_inputs)."""
    if batch_size % world_size:
        raise BadInput(
            f"{param}.batch_size ({batch_size}) is the whole batch, shared by the {world_size} "
            "processes: make it a multiple of their number"
        )


def runtime(device: str, precision: str, *, param: str) -> Runtime:
    """The device and autocast precision of a single-process fine-tuning run.

    `device`: auto (CUDA when present, else CPU) | cpu | cuda | cuda:N. `precision`: auto (bf16
    on CUDA, fp32 on CPU) | auto-bf16 (bf16 on CUDA and on CPUs with native bf16, else fp32) |
    fp32 | bf16 | fp16. `param` is the config section (`classify`,
    `instruct`) named in errors. Returns pretraining's `train.Runtime`: use `rt.device`,
    `with rt.autocast(): ...`, `rt.precision`; fp16 also needs a GradScaler, which
    `train_epochs` makes. Under torchrun (the stage's nproc_per_node above 1) it joins the
    process group and each process takes the GPU of its local rank (`rt.rank`, `rt.world_size`;
    finetune/distributed.py). No torch.compile: its compile time is not repaid over a few
    epochs of small batches.
    """
    from gptforge.training.processes import join

    if device == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device_type)
    else:
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise BadInput(f"{param}.device: expected auto, cpu, cuda or cuda:N, got {device!r}") from None
        if dev.type not in ("cpu", "cuda"):
            raise BadInput(f"{param}.device: expected auto, cpu, cuda or cuda:N, got {device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BadInput(f"{param}.device is {device} but no CUDA device is available")
    rank, local_rank, world = join(dev.type)
    if dev.type == "cuda" and world > 1:
        dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        if dev.index is not None:
            torch.cuda.set_device(dev)
        # TF32 matmuls: ~8x the fp32 tensor throughput on Ampere+, at a 10-bit mantissa.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    resolved = resolved_precision(precision, dev.type)
    if resolved == "fp16" and dev.type == "cpu":
        raise BadInput(f"{param}.precision fp16 needs CUDA; on the CPU use bf16 or fp32")
    return Runtime(device=dev, rank=rank, local_rank=local_rank, world_size=world, ddp=world > 1, precision=resolved)


# ---------------------------------------------------------------------------------------------
# The base model


def load_base(init_from: str, n_vocab: int, *, param: str) -> GPT:
    """The pretrained GPT a fine-tuning run starts from (on the CPU, in train mode).

    `init_from` is a GPT-2 hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl; transformers'
    download cache), a checkpoint folder written by `save_model` (`checkpoints/pretrain/final`),
    or a local Hugging Face GPT-2 folder (`gptforge export` output, `save_pretrained` output, a
    hub snapshot), converted to our GPT: `hf_convert.load_pretrained` says which is which. `param` is
    its config key (`classify.init_from`) for the messages. Raises BadInput when the folder is
    missing ("run `gptforge pretrain` first"), when its config.json is neither a gptforge GPT nor
    a Hugging Face GPT-2 (another architecture, another format: the message names the file), and
    when the model's vocabulary differs from the tokenizer's `n_vocab`.
    """
    model, source = load_pretrained(init_from, param=param, missing="run `gptforge pretrain` first, or ")
    if model.config.n_vocab != n_vocab:
        raise BadInput(
            f"{param}: {source} has a vocabulary of {model.config.n_vocab} tokens, the tokenizer "
            f"(tokenizer.path) {n_vocab}"
        )
    log.info("fine-tuning from %s (%.2fM parameters)", source, model.num_params() / 1e6)
    return model.train()


def load_hf_base(source: str, rt: Runtime, *, param: str, lora: bool, quantize: str | None = None):
    """(model, tokenizer) of a Hugging Face causal LM (`hf_causal.hf_source`) to fine-tune, in
    train mode on `rt.device`, and its transformers tokenizer.

    Weights load in float32 (autocast computes in bf16 on CUDA) except under LoRA with bf16,
    where the frozen base's linear layers stay in bf16 (`bf16_linears`: half their memory, no
    cast per step; peft keeps the adapters in float32). `quantize: 4bit` is QLoRA: the base in
    bitsandbytes NF4 with double quantization and bf16 compute, prepared with peft's
    `prepare_model_for_kbit_training`; it needs CUDA and
    the bitsandbytes package, and says so in one line (BadInput) before anything is loaded.
    `param` is the config section (`instruct`) the messages name.
    """
    from gptforge.modeling.hf_causal import load_causal_lm

    kwargs: dict[str, Any] = {}
    if quantize is not None:
        if rt.device.type != "cuda":
            raise BadInput(
                f"{param}.quantize: {quantize} (QLoRA) needs CUDA: bitsandbytes' NF4 kernels; "
                f"this run is on the {rt.device.type}: set {param}.quantize to null"
            )
        try:
            import bitsandbytes  # noqa: F401
            from transformers import BitsAndBytesConfig
        except ImportError:
            raise BadInput(
                f"{param}.quantize: {quantize} needs the bitsandbytes package "
                "(pip install bitsandbytes; the GPU worker image has it)"
            ) from None
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        kwargs["device_map"] = {"": rt.device.index or 0}
        kwargs["dtype"] = torch.bfloat16
    elif lora and rt.precision == "bf16":  # the frozen base in bf16 (autocast would cast it every step)
        kwargs["dtype"] = torch.bfloat16
    model, tokenizer = load_causal_lm(source, param=f"{param}.init_from", **kwargs)
    if quantize is None and kwargs.get("dtype") == torch.bfloat16:
        bf16_linears(model)
    if quantize is not None:
        import peft

        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model.to(rt.device)
    n = sum(p.numel() for p in model.parameters())
    log.info(
        "fine-tuning from Hugging Face %s %s (%.2fM parameters%s)",
        model.config.model_type,
        source,
        n / 1e6,
        ", 4-bit NF4" if quantize else "",
    )
    return model.train(), tokenizer


def bf16_linears(model: nn.Module) -> nn.Module:
    """A model loaded in bf16, made to compute under bf16 autocast what its float32 copy does:
    every parameter outside an nn.Linear (embeddings, norms; a head tied to the embedding goes
    with it) back to float32, so the residual stream and the norms stay float32 as autocast
    leaves them, while the linears' weights stay bf16, which is what autocast would cast them to
    at every step. In pure bf16 (the residual stream rounded to 8 bits at every layer) a LoRA
    epoch on SmolLM2 ended with a held-out loss 5% above Trainer's under autocast
    (docs/results/smollm2_cpu.md)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            continue
        for param in module.parameters(recurse=False):
            if param.dtype == torch.bfloat16:
                param.data = param.data.float()
    return model


def is_gpt(model: nn.Module) -> bool:
    """True for gptforge's own GPT (also inside a peft wrapper, whose `.config` is the GPT's),
    False for a transformers model."""
    return isinstance(getattr(model, "config", None), GPTConfig)


def model_positions(model: nn.Module) -> int:
    """How many positions the model has: our GPT's block_size, a Hugging Face model's
    max_position_embeddings (through a peft wrapper too)."""
    config = model.config
    if is_gpt(model):
        return config.block_size
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not positions:
        raise BadInput(f"{type(model).__name__}: its config names no maximum number of positions")
    return int(positions)


def check_max_length(max_length: int | None, model: nn.Module, param: str) -> int:
    """The sequence length to use: None -> the model's positions (`model_positions`); above
    them -> BadInput "`param` (N) is above the model's M positions" (positions past the last
    one have no embedding, so they cannot be trained or run)."""
    positions = model_positions(model)
    if max_length is None:
        return positions
    if max_length > positions:
        raise BadInput(f"{param} ({max_length}) is above the model's {positions} positions")
    return int(max_length)


# ---------------------------------------------------------------------------------------------
# LoRA (peft)


def apply_lora(model: nn.Module, lora, extra_trainable: Sequence[str] = (), task_type: str | None = None) -> nn.Module:
    """Wrap `model` in peft LoRA adapters; return the `peft.PeftModel`.

    `lora` is a config's LoRA section (`cfg.classify.lora`, `cfg.instruct.lora`: r, alpha,
    dropout, target_modules). `target_modules` are nn.Linear module-name suffixes; `auto` is
    every Linear inside the transformer blocks (`hf_causal.block_linear_names`: GPT-2's c_attn,
    c_proj, c_fc, named as in Hugging Face's GPT-2 so an adapter trained here also applies to
    the exported model; Llama's and Qwen's q/k/v/o_proj, gate/up/down_proj). `task_type`
    ("CAUSAL_LM" for a transformers model) is recorded in the adapter's config.
    Every original weight is frozen; the adapters (`lora_A`, `lora_B`) train, and so do the
    parameters of the modules named (exactly, relative to `model`) in `extra_trainable`, e.g.
    `["head"]` for a new classifier head.

    Why `get_peft_model` on our plain nn.Module works: peft's LoRA tuner only needs nn.Linear
    targets; with no task_type, `PeftModel.forward` passes every argument straight to `model`,
    and unknown attributes (`.config`, `.hidden_states`) fall through to it. The extra trained
    modules are made trainable with requires_grad rather than peft's `modules_to_save`, which
    matches name *suffixes* (`head` would also catch the GPT's tied `lm_head`) and trains a
    copy under another name.

    The PeftModel runs like `model`. `merge_lora(peft_model)` folds the adapters into the
    weights and returns the original module type (for saving with `save_model`).
    """
    import peft

    from gptforge.modeling.hf_causal import block_linear_names

    targets = block_linear_names(model) if lora.target_modules == "auto" else list(lora.target_modules)
    config = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, task_type=task_type
    )
    try:
        peft_model = peft.get_peft_model(model, config)
    except ValueError as e:  # no module matched target_modules
        raise BadInput(f"lora.target_modules {targets}: {' '.join(str(e).split())[:200]}") from None
    inner = peft_model.base_model.model  # `model` itself, its Linears now LoRA layers
    modules = dict(inner.named_modules())
    for name in extra_trainable:
        if name not in modules:
            raise ValueError(f"apply_lora: no module named {name!r} to keep trainable")
        for p in modules[name].parameters():
            p.requires_grad_(True)
    return peft_model


def merge_lora(model: nn.Module) -> nn.Module:
    """The plain module with LoRA folded into its weights (W + B·A·alpha/r) when `model` is a
    peft model; `model` itself otherwise. It modifies the wrapped module in place: compute
    any adapter-model outputs you need before merging."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    return model


def trainable_params(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; a tied tensor (wte = lm_head) counts once."""
    params = list(model.parameters())  # parameters() yields each shared tensor once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trainable parameters only, with pretraining's decay split and fused kernel
    (`gptforge.training.optim`), for any module: a classifier or a peft model, not only a GPT."""
    try:
        return adamw(model.parameters(), lr=lr, weight_decay=weight_decay, device_type=device.type)
    except ValueError as e:
        raise ValueError(f"make_optimizer: {e}") from None


# ---------------------------------------------------------------------------------------------
# The epoch loop


@dataclass
class History:
    """What `train_epochs` saw, for the recipe's curves and metrics."""

    train_loss: list[tuple[int, float]] = field(default_factory=list)  # (optimizer step, batch loss)
    evals: list[dict[str, float]] = field(default_factory=list)  # {"step": s, "epoch": e, **evaluate()}
    epoch_seconds: list[float] = field(default_factory=list)  # training time per epoch, evaluations excluded
    step: int = 0  # optimizer steps taken


def train_epochs(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any], torch.Tensor],
    batches: Callable[[int], Iterable[Any]],
    *,
    rt: Runtime,
    epochs: int,
    eval_interval: int,
    evaluate: Callable[[], dict[str, float]],
    run: NullRun = NullRun(),
    desc: str = "finetune",
    grad_clip: float = 0.0,
) -> History:
    """Train for `epochs` passes; return the History.

    `batches(epoch)` gives that epoch's batches (the recipe shuffles with its seed; a sized
    iterable gets a tqdm total; under torchrun every process gets the same batches and
    `loss_fn` takes its part). `loss_fn(batch)` returns the scalar loss of one batch; it runs
    under `rt.autocast()` with the model in train mode. One optimizer step per batch.
    `evaluate()` returns metrics (e.g. {"val_loss": ..., "val_accuracy": ...}); it runs with the
    model in eval mode, under no_grad and autocast, after every `eval_interval` optimizer steps
    and after the last step of each epoch (so short runs still get a curve point per epoch).
    Logged to `run`: `train_loss` every step, the evaluation metrics and `epoch` at each
    evaluation, all at the optimizer step. `grad_clip` > 0 clips the gradient norm.
    A non-finite loss stops the run with StageFailed before it reaches the weights.
    """
    from tqdm.auto import tqdm

    from gptforge.finetune.distributed import reduce_sums

    history = History()
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.precision == "fp16")
    params = [p for p in model.parameters() if p.requires_grad]

    def run_eval(epoch: int) -> None:
        model.eval()
        try:
            with torch.no_grad(), rt.autocast():
                metrics = {k: float(v) for k, v in evaluate().items()}
        finally:
            model.train()
        history.evals.append({"step": history.step, "epoch": epoch, **metrics})
        run.log_metrics({**metrics, "epoch": epoch}, step=history.step)

    model.train()
    for epoch in range(1, epochs + 1):
        epoch_batches = batches(epoch)
        total = len(epoch_batches) if hasattr(epoch_batches, "__len__") else None
        bar = tqdm(
            epoch_batches,
            total=total,
            desc=f"{desc} epoch {epoch}/{epochs}",
            unit="batch",
            leave=False,
            disable=not rt.master,
        )
        train_time, evaluated_at = 0.0, -1
        t0 = time.perf_counter()
        for batch in bar:
            with rt.autocast():
                loss = loss_fn(batch)
            # Each process's loss is its part's share of the batch's, scaled by the world
            # (finetune/distributed.py): their mean is the batch's loss, the same on every process.
            value = reduce_sums([loss.item()], rt)[0] / rt.world_size
            if not math.isfinite(value):
                raise StageFailed(
                    f"{desc}: loss is {value} at step {history.step + 1} (epoch {epoch}); "
                    "stopping before it reaches the weights (try a lower lr)"
                )
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            scaler.step(optimizer)
            scaler.update()
            history.step += 1
            history.train_loss.append((history.step, value))
            run.log_metrics({"train_loss": value}, step=history.step)
            bar.set_postfix(loss=f"{value:.4f}", refresh=False)
            if history.step % eval_interval == 0:
                rt.sync()
                train_time += time.perf_counter() - t0
                run_eval(epoch)
                evaluated_at = history.step
                t0 = time.perf_counter()
        rt.sync()
        train_time += time.perf_counter() - t0
        bar.close()
        history.epoch_seconds.append(train_time)
        if evaluated_at != history.step:
            run_eval(epoch)
        log.info(
            "%s epoch %d/%d: %d steps so far, %.1f s of training, %s",
            desc,
            epoch,
            epochs,
            history.step,
            train_time,
            ", ".join(f"{k} {v:.4f}" for k, v in history.evals[-1].items() if k not in ("step", "epoch")),
        )
    return history


def plot_curves(
    series: dict[str, list[tuple[float, float]]], ylabel: str, path: str | os.PathLike, xlabel: str = "step"
) -> Path | None:
    """One PNG line plot of named (x, y) series (matplotlib, Agg backend); None when matplotlib
    is not installed (a bare GPU box: the numbers are in the metrics and the run anyway)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, "o-" if len(points) < 30 else "-", label=label, markersize=3, linewidth=0.9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if any(series.values()):
        ax.legend()
    return save_png(fig, path)


def save_png(fig, path: Path) -> Path:
    """Write a matplotlib figure as a PNG, whole or not at all, and close it."""
    import matplotlib.pyplot as plt

    from gptforge.io import atomic_file

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return path


def epoch_batches(examples: Sequence[Any], batch_size: int, seed: int, epoch: int) -> list[list[Any]]:
    """One epoch's batches in an order that depends only on (seed, epoch): a rerun sees the
    same batches, and every epoch a different order."""
    order = list(examples)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def length_grouped_batches(
    examples: Sequence[Any], batch_size: int, seed: int, epoch: int, length: Callable[[Any], int], group: int = 50
) -> list[list[Any]]:
    """`epoch_batches` with little padding: the shuffled examples are cut into groups of
    `group` batches, each group sorted by `length` (longest first) and cut into batches, and the
    batches shuffled again, so a batch holds examples of similar length while the order still
    depends only on (seed, epoch) and changes every epoch. transformers' LengthGroupedSampler
    does the same (megabatches of 50 batches); a group is far smaller than the dataset, so the
    batches are not sorted across the epoch, which would bias the step-to-step gradient."""
    rng = random.Random(f"{seed}:{epoch}:grouped")
    order = list(examples)
    rng.shuffle(order)
    size = batch_size * group
    batches: list[list[Any]] = []
    for start in range(0, len(order), size):
        chunk = sorted(order[start : start + size], key=length, reverse=True)
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches
