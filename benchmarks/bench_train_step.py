"""Time one pretraining step (forward, backward, clip, AdamW) of the configured model.

    python benchmarks/bench_train_step.py [-S key=value ...] [--steps 20] [--warmup 5]

Uses the library's own `train_step` on random tokens at the config's batch_size x block_size
(default: the tiny CPU model, 4x128, block 64, batch 12, vocab 50304), after `--warmup` steps,
with device synchronisation; prints the median, spread and tokens/s as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from gptforge.config.load import load_config
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.training.loop import grad_accum_steps, lr_at, train_step
from gptforge.training.optim import adamw
from gptforge.training.runtime import setup_runtime


class RandomTokens:
    def __init__(self, B: int, T: int, vocab: int, seed: int = 0) -> None:
        self.B, self.T, self.vocab = B, T, vocab
        self.gen = torch.Generator().manual_seed(seed)

    def next_batch(self, device=None):
        buf = torch.randint(0, self.vocab, (self.B, self.T + 1), generator=self.gen)
        x, y = buf[:, :-1], buf[:, 1:]
        return (x.to(device), y.to(device)) if device is not None else (x, y)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--params", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    cfg = load_config(args.params, args.set)
    rt = setup_runtime(cfg)
    p = cfg.pretrain
    grad_accum = grad_accum_steps(cfg, rt.world_size)
    torch.manual_seed(p.seed)
    model = GPT(GPTConfig.from_model_config(cfg.model, 50257)).to(rt.device)
    raw = model
    optimizer = adamw(
        model.parameters(), lr=p.lr, weight_decay=p.weight_decay, betas=p.betas, device_type=rt.device.type
    )
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.precision == "fp16")
    if rt.compile:
        model = torch.compile(model)
    data = RandomTokens(p.batch_size, cfg.model.block_size, 50257)
    times = []
    for i in range(args.warmup + args.steps):
        rt.sync()
        t0 = time.perf_counter()
        train_step(model, raw, optimizer, scaler, data, grad_accum, rt, lr=lr_at(i, cfg), grad_clip=p.grad_clip)
        rt.sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(
        json.dumps(
            {
                "device": str(rt.device) if rt.device.type == "cpu" else torch.cuda.get_device_name(rt.device),
                "cpu_threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "model": {
                    k: getattr(cfg.model, k)
                    for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "attention")
                },
                "batch_size": p.batch_size,
                "grad_accum": grad_accum,
                "precision": rt.precision,
                "compile": rt.compile,
                "warmup_steps": args.warmup,
                "timed_steps": args.steps,
                "median_step_s": med,
                "min_step_s": min(times),
                "max_step_s": max(times),
                "tokens_per_sec": p.batch_tokens / med,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
