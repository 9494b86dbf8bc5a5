"""`gptforge pretrain`: the GPT-2 pretraining recipe, read top to bottom.

One process, or several when launched by `torchrun` (nccl on CUDA, gloo on CPU), sharing the
training state as `pretrain.strategy` says: DDP, ZeRO-1 or FSDP2 (gptforge.training.sharding).
Gradient accumulation fills `pretrain.batch_tokens` per optimizer step; AdamW with weight decay
on matrices only, or Muon for the blocks' matrices with AdamW for the rest (`pretrain.optimizer`);
linear warm-up then cosine decay to `min_lr`; gradient clipping; bf16/fp16 autocast; optional
torch.compile. Checkpoints hold everything a resumed run needs to continue bit for bit: weights
(safetensors), optimizer and grad-scaler state, the data position, the step and every RNG state
(gptforge.training.checkpoint saves them and picks the one to resume); the model is wrapped
for training by gptforge.training.parallelize.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptforge.config.schema import Config
from gptforge.errors import BadInput, StageFailed, Stopped
from gptforge.io import atomic_dir
from gptforge.modeling import flops
from gptforge.modeling.decoding import generate
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.tokenizer import describe, load_tokenizer
from gptforge.modeling.weights import empty_model, load_config, load_model, save_model
from gptforge.runtime.pause import PausePoint
from gptforge.runtime.signals import stop_requested
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics
from gptforge.training import checkpoint as ckpt
from gptforge.training import sharding
from gptforge.training.loader import ShardLoader
from gptforge.training.loss_plot import plot_losses, write_plot_csv
from gptforge.training.optim import adamw, muon_adamw, zero1_adamw
from gptforge.training.parallelize import check_strategy, parallelize
from gptforge.training.runtime import Runtime, setup_runtime
from gptforge.training.session import Session, fingerprint

log = logging.getLogger("gptforge")


# ---------------------------------------------------------------------------------------------
# The learning rate schedule and the batch


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr` at `max_steps` (build-nanogpt)."""
    p = cfg.pretrain
    if step < p.warmup_steps:
        return p.lr * (step + 1) / p.warmup_steps
    if step >= p.max_steps:
        return p.min_lr
    progress = (step - p.warmup_steps) / max(1, p.max_steps - p.warmup_steps)
    return p.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (p.lr - p.min_lr)


def grad_accum_steps(cfg: Config, world: int) -> int:
    p, T = cfg.pretrain, cfg.model.block_size
    per_micro = p.batch_size * T * world
    if p.batch_tokens % per_micro:
        raise BadInput(
            f"pretrain.batch_tokens ({p.batch_tokens}) is not divisible by batch_size*block_size*processes "
            f"({p.batch_size}*{T}*{world} = {per_micro})"
        )
    return p.batch_tokens // per_micro


# ---------------------------------------------------------------------------------------------
# The model: from scratch, from the hub, from a checkpoint


def build_model(cfg: Config, n_vocab: int) -> GPT:
    p, m = cfg.pretrain, cfg.model
    if p.init_from == "scratch":
        torch.manual_seed(p.seed)
        return GPT(GPTConfig.from_model_config(m, n_vocab))
    from gptforge.modeling.hf_convert import load_pretrained

    # A GPT-2 hub size, a checkpoint folder, or a Hugging Face GPT-2 folder.
    model, source = load_pretrained(p.init_from, param="pretrain.init_from")
    have = model.config.block_size
    if m.block_size > have:
        raise BadInput(f"model.block_size ({m.block_size}) is above the {have} positions of {source}")
    if model.config.n_vocab != n_vocab:
        raise BadInput(f"{source} has a vocabulary of {model.config.n_vocab}, the tokenizer {n_vocab}")
    if m.block_size < have:
        model.crop_block_size(m.block_size)
    log.info("initialised from %s", source)
    return model


# ---------------------------------------------------------------------------------------------
# One optimizer step


def train_step(
    model, raw_model: GPT, optimizer, scaler, loader, grad_accum: int, rt: Runtime, *, lr: float, grad_clip: float
) -> tuple[float, float]:
    """Forward/backward over `grad_accum` micro-batches, clip, step. Returns (loss, grad norm).

    A non-finite loss returns before the optimizer touches the weights, so the caller can stop
    with the last good state intact."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=rt.device)
    for micro in range(grad_accum):
        x, y = loader.next_batch(rt.device)
        # DDP: all-reduce gradients only on the last micro-step of the accumulation. (FSDP
        # reduce-scatters every micro-step: its gradients stay sharded in between.)
        last = micro == grad_accum - 1
        sync = model.no_sync() if rt.ddp and not last and hasattr(model, "no_sync") else contextlib.nullcontext()
        with sync:
            with rt.autocast():
                _, loss = model(x, y)
            loss = loss / grad_accum
            loss_sum += loss.detach().float()
            scaler.scale(loss).backward()
    if rt.ddp:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
    loss_value = loss_sum.item()
    if not math.isfinite(loss_value):
        return loss_value, float("nan")
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or float("inf"))
    if rt.ddp:  # under fsdp a DTensor: the norm over every process's shards
        grad_norm = sharding.whole(grad_norm)
    grad_norm = grad_norm.item()
    for group in optimizer.param_groups:  # muon_adamw's groups each scale the schedule's lr
        group["lr"] = lr * group.get("lr_scale", 1.0)
    scaler.step(optimizer)
    scaler.update()
    return loss_value, grad_norm


# ---------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def eval_loss(model, loader: ShardLoader, steps: int, rt: Runtime) -> float:
    model.eval()
    loader.reset()
    total = torch.zeros((), device=rt.device)
    for _ in range(steps):
        x, y = loader.next_batch(rt.device)
        with rt.autocast():
            _, loss = model(x, y)
        total += loss.float()
    total /= steps
    if rt.ddp:
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
    model.train()
    return total.item()


def sample_text(model: GPT, enc, prompt: str, n_tokens: int, seed: int, device: torch.device) -> str:
    gen = torch.Generator(device=device).manual_seed(seed)  # its own RNG: resume stays exact
    idx = torch.tensor([enc.encode_ordinary(prompt)], device=device)
    was_training = model.training
    model.eval()  # no dropout: it would draw from the training RNG
    try:
        out = generate(model, idx, n_tokens, temperature=1.0, top_k=50, eot_id=enc.eot_token, generator=gen)
    finally:
        model.train(was_training)
    return enc.decode(out[0].tolist())


# ---------------------------------------------------------------------------------------------
# The recipe


def setup(cfg: Config, data_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Session:
    """Runtime, data, model and optimizer; restored from the newest matching checkpoint."""
    p, out_dir = cfg.pretrain, Path(out_dir)
    rt = setup_runtime(cfg)
    grad_accum = grad_accum_steps(cfg, rt.world_size)
    enc = load_tokenizer(cfg.tokenizer.path)
    loader_args = dict(
        batch_size=p.batch_size,
        block_size=cfg.model.block_size,
        rank=rt.rank,
        world_size=rt.world_size,
        n_vocab=enc.n_vocab,
        tokenizer_name=describe(cfg.tokenizer.path),
    )
    train_loader = ShardLoader(data_dir, "train", seed=p.seed, shuffle=True, **loader_args)
    val_loader = ShardLoader(data_dir, "val", seed=p.seed, shuffle=False, **loader_args)
    fp = fingerprint(cfg, train_loader.manifest, rt.world_size)

    hellaswag = None
    if p.hellaswag.source:
        from gptforge.training import hellaswag as hs

        path = hs.local_copy(
            p.hellaswag.source, split=p.hellaswag.split, sha256=p.hellaswag.sha256, download=cfg.data.download
        )
        hellaswag = hs.load_examples(path, limit=p.hellaswag.limit)

    sharded = p.strategy == "fsdp" and rt.ddp
    check_strategy(rt, p.strategy, "pretrain")
    resume_from = ckpt.find_resume(cfg, out_dir, fp)
    if resume_from is not None:
        ckpt.check_resumable(resume_from, sharded)
    # A resumed run takes the architecture and weights from its checkpoint (no hub access); under
    # fsdp only the architecture here: each process reads its shards of the weights below.
    if resume_from is None:
        model = build_model(cfg, enc.n_vocab)
    else:
        model = empty_model(load_config(resume_from)) if sharded else load_model(resume_from)
    raw_model = model.to(rt.device)
    torch.manual_seed(p.seed + rt.rank)  # dropout streams; init above used the shared seed
    # Activation checkpointing, compile, then DDP or FSDP (which shards raw_model in place)
    model = parallelize(
        raw_model,
        rt,
        strategy=p.strategy,
        param="pretrain",
        activation_checkpointing=p.activation_checkpointing,
        compile=rt.compile,
        reshard_after_forward=p.fsdp_reshard_after_forward,
    )
    if p.optimizer == "muon":  # the config refuses it with zero1 and fsdp
        optimizer = muon_adamw(
            raw_model,
            lr=p.lr,
            weight_decay=p.weight_decay,
            betas=p.betas,
            muon_lr=p.muon_lr,
            muon_momentum=p.muon_momentum,
            muon_weight_decay=p.muon_weight_decay,
            device_type=rt.device.type,
        )
    else:
        build = zero1_adamw if p.strategy == "zero1" and rt.ddp else adamw
        optimizer = build(
            raw_model.parameters(), lr=p.lr, weight_decay=p.weight_decay, betas=p.betas, device_type=rt.device.type
        )
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.precision == "fp16")
    step = 0
    if resume_from is not None:
        step = ckpt.restore_session(resume_from, rt, raw_model, optimizer, scaler, train_loader)
        log.info("resumed from %s at step %d", resume_from, step)
    elif out_dir.exists():
        stale = ckpt.list_checkpoints(out_dir)
        if stale and rt.master:
            log.info("starting over: removing %d checkpoint(s) of another run in %s", len(stale), out_dir)
            for folder in stale:
                shutil.rmtree(folder)

    return Session(
        cfg,
        rt,
        enc,
        grad_accum,
        train_loader,
        val_loader,
        fp,
        hellaswag,
        model,
        raw_model,
        optimizer,
        scaler,
        out_dir,
        step=step,
        last_ckpt=resume_from,
        sharded=sharded,
    )


def train_loop(s: Session, run=NullRun()) -> None:
    """Steps from `s.step` to `pretrain.max_steps`, with evaluation, logging and checkpoints."""
    cfg, p, rt = s.cfg, s.cfg.pretrain, s.rt
    flops_per_token = s.raw_model.flops_per_token(cfg.model.block_size)
    peak = flops.peak_flops(rt.device, rt.precision, p.peak_flops)
    log.info(
        "pretraining %.2fM parameters on %s (%s%s, %d process%s), %d micro-steps of %dx%d per step",
        s.raw_model.num_params() / 1e6,
        rt.device,
        rt.precision,
        ", compiled" if rt.compile else "",
        rt.world_size,
        "es" if rt.world_size > 1 else "",
        s.grad_accum,
        p.batch_size,
        cfg.model.block_size,
    )
    from tqdm.auto import tqdm

    bar = tqdm(total=p.max_steps, initial=s.step, unit="step", desc="pretrain", disable=not rt.master)
    try:
        with stop_requested() as stop:
            _steps(s, run, stop, bar, flops_per_token, peak)
    finally:
        bar.close()


def _stop_now(stop, rt: Runtime) -> bool:
    """Whether any process was asked to stop: under DDP every rank must stop at the same step."""
    if not rt.ddp:
        return bool(stop)
    flag = torch.tensor([1.0 if stop else 0.0], device=rt.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _steps(s: Session, run, stop, bar, flops_per_token: float, peak: float | None) -> None:
    cfg, p, rt = s.cfg, s.cfg.pretrain, s.rt
    pause = PausePoint.from_env(rt.master)
    while s.step < p.max_steps:
        step = s.step
        row: dict[str, Any] = {"step": step, "train_s": round(s.train_seconds, 3)}
        if step % p.eval_interval == 0 and step != p.max_steps - 1:  # the last step gets the full eval
            row["val_loss"] = eval_loss(s.model, s.val_loader, p.eval_steps, rt)
            run.log_metrics({"val_loss": row["val_loss"]}, step=step)
        if s.hellaswag is not None and p.hellaswag_interval and step % p.hellaswag_interval == 0 and step:
            s.hellaswag_result = _hellaswag(s.plain_model(), s.hellaswag, s.enc, rt, cfg)
            run.log_metrics(
                {"hellaswag_acc_norm": s.hellaswag_result["acc_norm"], "hellaswag_acc": s.hellaswag_result["acc"]},
                step=step,
            )
        if p.sample_interval and step % p.sample_interval == 0 and step:
            plain = s.plain_model(everywhere=False)
            if rt.master:
                run.log_text(
                    sample_text(plain, s.enc, p.sample_prompt, p.sample_tokens, p.seed + step, rt.device),
                    f"samples/step_{step:08d}.txt",
                )

        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        loss, grad_norm = train_step(
            s.model, s.raw_model, s.optimizer, s.scaler, s.train_loader, s.grad_accum, rt, lr=lr, grad_clip=p.grad_clip
        )
        if not math.isfinite(loss):
            where = f"the last good checkpoint is {s.last_ckpt}" if s.last_ckpt else "no checkpoint was written yet"
            raise StageFailed(
                f"loss is {loss} at step {step}: stopping; {where} "
                "(resume: auto continues from it; consider a lower pretrain.lr)"
            )
        rt.sync()
        dt = time.perf_counter() - t0
        s.step, s.train_loss = step + 1, loss
        s.step_times.append(dt)
        s.train_seconds += dt
        row.update(train_loss=loss, lr=lr)
        s.history.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if s.step % p.log_interval == 0 or s.step == p.max_steps:
            tokens_per_sec = p.batch_tokens / dt
            metrics = {
                "train_loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_sec": tokens_per_sec,
                "step_time_ms": dt * 1000,
                "peak_memory_mb": _peak_memory_mb(rt.device),
            }
            step_mfu = flops.mfu(tokens_per_sec / rt.world_size, flops_per_token, peak)
            if step_mfu is not None:
                metrics["mfu"] = step_mfu
            run.log_metrics(metrics, step=s.step)
        stopping = _stop_now(stop, rt)
        if s.step % p.ckpt_interval == 0 or s.step == p.max_steps or stopping:
            if hasattr(s.optimizer, "consolidate_state_dict"):  # zero1: every process hands its share to 0
                s.optimizer.consolidate_state_dict(to=0)
            s.last_ckpt = ckpt.save_session(s)
        if rt.ddp:
            dist.barrier()
        if stopping:
            raise Stopped(
                stop.signum or 15,
                f"pretrain stopped by {stop.name or 'a signal'} at step {s.step}; "
                f"checkpoint {s.last_ckpt if rt.master else 'of rank 0'} saved (resume: auto continues "
                "from it)",
            )
        pause.after(s.step)


def finish(
    s: Session,
    run=NullRun(),
    metrics_path: str | os.PathLike = "metrics/pretrain.json",
    plots_path: str | os.PathLike = "plots/pretrain.csv",
) -> dict:
    """Full validation split, HellaSwag, a sample, the final model and the stage's records."""
    cfg, p, rt = s.cfg, s.cfg.pretrain, s.rt
    val_loss = eval_loss(s.model, s.val_loader, max(1, s.val_loader.batches_per_epoch), rt)
    s.history.append({"step": s.step, "val_loss": val_loss, "whole_split": True, "train_s": round(s.train_seconds, 3)})
    # The final model is always whole: later stages read it as they read any. Under fsdp it is
    # gathered on every process when HellaSwag splits its examples among them, else on process 0.
    plain = s.plain_model(everywhere=s.hellaswag is not None)
    if s.hellaswag is not None:
        s.hellaswag_result = _hellaswag(plain, s.hellaswag, s.enc, rt, cfg)
    if not rt.master:
        return {}
    final = s.out_dir / "final"
    with atomic_dir(final) as tmp:
        save_model(plain, tmp)
    timed = s.step_times[min(len(s.step_times) - 1, 5) :] or s.step_times  # the first steps warm up
    tokens_per_sec = p.batch_tokens / statistics.median(timed) if timed else 0.0
    peak = flops.peak_flops(rt.device, rt.precision, p.peak_flops)
    step_mfu = flops.mfu(tokens_per_sec / rt.world_size, s.raw_model.flops_per_token(cfg.model.block_size), peak)
    metrics = {
        "train_loss": s.train_loss,
        "val_loss": val_loss,
        "tokens": s.step * p.batch_tokens,
        "tokens_per_sec": tokens_per_sec,
        "mfu": step_mfu or 0.0,
    }
    if s.hellaswag_result is not None:
        metrics.update(hellaswag_acc_norm=s.hellaswag_result["acc_norm"], hellaswag_acc=s.hellaswag_result["acc"])
    write_plot_csv(plots_path, s.history)
    publish_metrics(run, metrics, metrics_path)
    run.log_metrics({"final_val_loss": val_loss}, step=s.step)
    run.log_text(sample_text(plain, s.enc, p.sample_prompt, p.sample_tokens, p.seed, rt.device), "samples/final.txt")
    run.log_artifact(final, "checkpoint")
    run.log_artifact(plots_path)
    png = plot_losses(s.history, Path(plots_path).with_suffix(".png"))
    if png:
        run.log_artifact(png)
    log.info(
        "pretrain done: step %d, train loss %.4f, val loss %.4f, %.0f tokens/s%s",
        s.step,
        s.train_loss,
        val_loss,
        tokens_per_sec,
        f", MFU {metrics['mfu']:.1%}" if peak else "",
    )
    return metrics


def pretrain(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run=NullRun(),
    data_dir: str | os.PathLike = "data/pretrain",
    out_dir: str | os.PathLike = "checkpoints/pretrain",
    metrics_path: str | os.PathLike = "metrics/pretrain.json",
    plots_path: str | os.PathLike = "plots/pretrain.csv",
) -> dict:
    """The stage: set up (or resume), train, finish. Each part is one step (a Prefect task)."""
    session = steps(setup, cfg, data_dir, out_dir)
    steps(train_loop, session, run)
    return steps(finish, session, run, metrics_path, plots_path)


def _hellaswag(model, examples, enc, rt: Runtime, cfg: Config) -> dict:
    from gptforge.training import hellaswag as hs

    autocast = None if rt.precision == "fp32" else (torch.bfloat16 if rt.precision == "bf16" else torch.float16)
    return hs.evaluate(
        model,
        examples,
        enc,
        device=rt.device,
        rank=rt.rank,
        world_size=rt.world_size,
        block_size=cfg.model.block_size,
        autocast_dtype=autocast,
    )


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
