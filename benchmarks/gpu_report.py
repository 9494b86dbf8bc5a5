"""GPU checks and benchmarks in one call; writes a dated report to docs/benchmarks/.

    PYTHONPATH=src:. python benchmarks/gpu_report.py [--steps 20] [--warmup 5] [--batch 16]

Needs a CUDA device; uses only torch and gptforge's model (no Prefect, MLflow or pydantic), so
it runs on a bare GPU image. It checks the CUDA paths against their references and times:

1. correctness: `sdpa` (FlashAttention-2) vs `math` attention logits (fp32 and bf16), KV-cache
   greedy decoding vs no-cache on the GPU, bf16 autocast loss vs fp32 loss;
2. the GPT-2 124M training step at T=1024 (forward, backward, clip, fused AdamW) for fp32, TF32
   and bf16 autocast, eager and compiled: ms/step (median of `--steps` after `--warmup`, CUDA
   synchronised), tokens/s and MFU against the device's peak from gptforge.modeling.flops;
3. batch-1 greedy decoding of GPT-2 124M, fp32 and bf16: tokens/s.

The report is Markdown with the raw JSON appended: docs/benchmarks/YYYY-MM-DD-<device>.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from gptforge.modeling import flops
from gptforge.modeling.decoding import generate
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.training.optim import adamw

REPO = Path(__file__).resolve().parents[1]


def timed(fn, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def check_correctness(dev) -> dict:
    out = {}
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=256, vocab_size=50304, n_vocab=50257)
    model = GPT(cfg).to(dev).eval()
    idx = torch.randint(0, 50257, (4, 256), device=dev)
    with torch.no_grad():
        sdpa = model(idx)[0][..., :50257]
        model_math = GPT(GPTConfig(**{**cfg.to_dict(), "attention": "math"})).to(dev).eval()
        model_math.load_state_dict(model.state_dict())
        ref = model_math(idx)[0][..., :50257]
        out["sdpa_vs_math_fp32_max_abs"] = (sdpa - ref).abs().max().item()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            sdpa_bf16 = model(idx)[0][..., :50257].float()
        out["sdpa_bf16_vs_math_fp32_max_abs"] = (sdpa_bf16 - ref).abs().max().item()
        targets = torch.randint(0, 50257, (4, 256), device=dev)
        loss32 = model(idx, targets)[1].item()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss16 = model(idx, targets)[1].item()
        out["loss_fp32"], out["loss_bf16"] = loss32, loss16
    prompt = idx[:1, :8]
    a = generate(model, prompt, 64, temperature=0, use_cache=True)
    b = generate(model, prompt, 64, temperature=0, use_cache=False)
    out["kv_cache_equals_no_cache"] = bool(torch.equal(a, b))
    return out


def bench_train(dev, batch: int, steps: int, warmup: int) -> list[dict]:
    rows = []
    cfg = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, n_vocab=50257)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randint(0, 50257, (batch, 1024), device=dev, generator=gen)
    y = torch.randint(0, 50257, (batch, 1024), device=dev, generator=gen)
    variants = [("fp32", False, False), ("tf32", False, False), ("bf16", False, False), ("bf16", True, False)]
    for precision, compiled, _ in variants:
        torch.backends.cuda.matmul.allow_tf32 = precision in ("tf32", "bf16")
        torch.backends.cudnn.allow_tf32 = precision in ("tf32", "bf16")
        torch.manual_seed(0)
        raw = GPT(cfg).to(dev)
        model = torch.compile(raw) if compiled else raw
        opt = adamw(raw.parameters(), weight_decay=0.1, lr=6e-4, betas=(0.9, 0.95), device_type="cuda")
        torch.cuda.reset_peak_memory_stats(dev)

        def step():
            opt.zero_grad(set_to_none=True)
            if precision == "bf16":
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = model(x, y)
            else:
                _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
            opt.step()

        try:
            times = timed(step, steps, warmup + (3 if compiled else 0))
        except torch.OutOfMemoryError:
            rows.append({"precision": precision, "compile": compiled, "error": "out of memory"})
            continue
        med = statistics.median(times)
        tps = batch * 1024 / med
        peak = flops.peak_flops(dev, "fp32" if precision == "tf32" else precision, None)
        rows.append(
            {
                "precision": precision,
                "compile": compiled,
                "attention": "sdpa",
                "batch": batch,
                "T": 1024,
                "ms_per_step": med * 1000,
                "min_ms": min(times) * 1000,
                "max_ms": max(times) * 1000,
                "tokens_per_sec": tps,
                "mfu": flops.mfu(tps, raw.flops_per_token(1024), peak),
                "peak_memory_gb": torch.cuda.max_memory_allocated(dev) / 2**30,
            }
        )
        model = raw = opt = None  # free the GPU memory before the next variant
        torch.cuda.empty_cache()
    return rows


def bench_generate(dev, repeats: int) -> list[dict]:
    rows = []
    cfg = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, n_vocab=50257)
    torch.manual_seed(0)
    model = GPT(cfg).to(dev).eval()
    prompt = torch.randint(0, 50257, (1, 16), device=dev)
    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype)
        times = timed(lambda: generate(m, prompt, 128, temperature=0), repeats, 2)
        rows.append(
            {
                "dtype": str(dtype).replace("torch.", ""),
                "new_tokens": 128,
                "tokens_per_sec": 128 / statistics.median(times),
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_report: error: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    report = {
        "date": dt.date.today().isoformat(),
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "correctness": check_correctness(dev),
        "train_step_gpt2_124m": bench_train(dev, args.batch, args.steps, args.warmup),
        "generate_gpt2_124m_batch1": bench_generate(dev, 5),
    }
    lines = [
        f"# GPU report {report['date']}: {name}",
        "",
        f"torch {report['torch']}, CUDA {report['cuda']}. Produced by `benchmarks/gpu_report.py`.",
        "",
        "## Correctness",
        "",
        *(f"- {k}: {v}" for k, v in report["correctness"].items()),
        "",
        f"## GPT-2 124M training step, T=1024, batch {args.batch} (median of {args.steps} after "
        f"{args.warmup} warm-up, CUDA synchronised)",
        "",
        "| precision | compile | ms/step | tokens/s | MFU | peak memory GB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["train_step_gpt2_124m"]:
        if "error" in r:
            lines.append(f"| {r['precision']} | {r['compile']} | {r['error']} | | | |")
        else:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
            lines.append(
                f"| {r['precision']} | {r['compile']} | {r['ms_per_step']:.1f} | {r['tokens_per_sec']:,.0f} "
                f"| {mfu} | {r['peak_memory_gb']:.1f} |"
            )
    lines += [
        "",
        "## Batch-1 greedy decoding, GPT-2 124M, 128 new tokens",
        "",
        "| dtype | tokens/s |",
        "| --- | --- |",
        *(f"| {r['dtype']} | {r['tokens_per_sec']:.1f} |" for r in report["generate_gpt2_124m_batch1"]),
        "",
        "## Raw",
        "",
        "```json",
        json.dumps(report, indent=2),
        "```",
        "",
    ]
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{report['date']}-{slug}.md"
    path.write_text("\n".join(lines))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
