"""`gptforge benchmark`: which settings make the training step fast, and how far from the limit?

The grid follows build-nanogpt's progression (fp32 eager with plain attention and the raw 50257
vocabulary, then TF32, bf16 autocast, SDPA attention, the vocabulary padded to 50304, fused
AdamW, torch.compile, our Triton attention, our fused cross-entropy) as a keep-the-best chain:
each variant is the best configuration kept so far plus its own change, and it is kept (the
next variants build on it) unless its median step is more than 5% slower than the fastest kept
variant. A variant that makes the step slower, such as bf16 autocast on a CPU without native
bf16 (36x slower on an AVX2-only EPYC), is reported as not kept with the reason ("not kept:
36.4x slower than baseline") and is not carried into the next variants; one whose step already
takes over 10x the fastest kept stops being timed after that step. A change that does not apply
on the device (TF32 and the Triton kernels need CUDA) is skipped with the reason. Every timing:
`warmup` untimed steps, device synchronisation around each timed step, the median of `steps`
repetitions with min and max. Micro-benchmarks time attention (forward and forward+backward,
TFLOP/s against sequence length, per backend) and cross-entropy (time and peak memory against
vocabulary size); a torch.profiler trace of chosen variants gives the top kernels.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from gptforge.config.schema import Config
from gptforge.errors import BadInput
from gptforge.modeling import flops
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.runtime.tracking import NullRun
from gptforge.training.optim import adamw, fused_adamw_supported

log = logging.getLogger("gptforge")
N_VOCAB = 50257


@dataclass(frozen=True)
class Variant:
    name: str
    change: str  # what this variant adds to the previous one
    precision: str = "fp32"  # fp32 | tf32 | bf16
    attention: str = "math"
    vocab_size: int = N_VOCAB
    fused_adamw: bool = False
    compile: bool = False
    fused_ce: bool = False


def variant_grid() -> list[tuple[str, str, dict]]:
    """(name, what it adds, settings changed) in build-nanogpt's order. `run_variants` applies each
    change to the best configuration kept so far, not to the variant just before it."""
    return [
        ("baseline", "fp32, eager, math attention, vocab 50257, AdamW, F.cross_entropy", {}),
        ("tf32", "TF32 matmuls", {"precision": "tf32"}),
        ("bf16", "bf16 autocast", {"precision": "bf16"}),
        ("sdpa", "SDPA attention (FlashAttention-2 on CUDA)", {"attention": "sdpa"}),
        ("vocab50304", "vocabulary padded to 50304", {"vocab_size": 50304}),
        ("fused_adamw", "fused AdamW", {"fused_adamw": True}),
        ("compile", "torch.compile", {"compile": True}),
        ("triton_attention", "gptforge Triton FlashAttention-2", {"attention": "triton"}),
        ("fused_ce", "gptforge fused cross-entropy", {"fused_ce": True}),
    ]


def _kernels_available() -> str | None:
    """None when our Triton kernels can run here, else why not."""
    if not torch.cuda.is_available():
        return "needs CUDA (Triton kernels; TRITON_INTERPRET on the CPU is for tests, not timing)"
    try:
        import kernels.cross_entropy  # noqa: F401
        import kernels.flash_attention  # noqa: F401
    except ImportError as e:
        return f"kernels not importable ({e})"
    return None


def skip_reason(change: dict, device: torch.device) -> str | None:
    if change.get("precision") == "tf32" and device.type != "cuda":
        return "TF32 is a CUDA tensor-core mode"
    if change.get("attention") == "triton" or change.get("fused_ce"):
        return _kernels_available()
    if change.get("fused_adamw") and not fused_adamw_supported(device.type):
        return f"this torch has no fused AdamW for {device.type}"
    return None


# ---------------------------------------------------------------------------------------------
# Measuring


class PeakMemory:
    """Peak memory over a block: CUDA's allocator peak, or on the CPU the process RSS sampled
    every 5 ms (its growth over the block: torch's CPU allocator keeps no statistics)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak_mb = device, float("nan")

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        try:
            import psutil
        except ImportError:
            self._proc = None
            return self
        self._proc = psutil.Process()
        self._base = self._peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        elif self._proc is not None:
            self._stop.set()
            self._thread.join()
            self.peak_mb = (max(self._peak, self._proc.memory_info().rss) - self._base) / 2**20


def time_it(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> list[float]:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def time_step(
    step: Callable[[], Any],
    device: torch.device,
    warmup: int,
    repeats: int,
    *,
    settle: int = 1,
    stop_over_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[float], bool]:
    """`time_it` for a training step that gives up on a hopeless variant: (times, stopped early).

    Every call is timed between synchronisations, the warm-up ones too. The first `settle` calls
    pay one-time costs (allocation, compilation) and are never judged; any later call, warm-up or
    timed, that takes over `stop_over_s` ends the timing at once (a step 10x slower than the best
    needs no five repetitions to be rejected). The times returned are then the timed calls made so
    far, or if it stopped during warm-up the judged warm-up calls, the slow one included."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, judged = [], []
    for i in range(warmup + repeats):
        sync()
        start = clock()
        step()
        sync()
        elapsed = clock() - start
        if i >= warmup:
            times.append(elapsed)
        elif i >= settle:
            judged.append(elapsed)
        if stop_over_s is not None and i >= settle and elapsed > stop_over_s:
            return times or judged, True
    return times, False


def summary(times: list[float]) -> dict[str, float]:
    return {"ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3}


# ---------------------------------------------------------------------------------------------
# The training step of one variant


def _autocast(v: Variant, device: torch.device):
    if v.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _loss_fn(v: Variant) -> Callable:
    if v.fused_ce:
        from kernels.cross_entropy import fused_cross_entropy

        return fused_cross_entropy
    return F.cross_entropy


def build_step(v: Variant, cfg: Config, device: torch.device, B: int, T: int):
    m = cfg.model
    gcfg = GPTConfig(
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        block_size=T,
        vocab_size=v.vocab_size,
        n_vocab=N_VOCAB,
        dropout=0.0,
        bias=m.bias,
        attention=v.attention,
    )
    torch.manual_seed(0)
    raw = GPT(gcfg).to(device)
    model = torch.compile(raw) if v.compile else raw
    # Unfused until the fused_adamw variant, whatever the training loops pick on this device.
    opt = adamw(
        raw.parameters(),
        lr=1e-4,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        device_type=device.type,
        fused=bool(v.fused_adamw),
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, N_VOCAB, (B, T), generator=gen).to(device)
    y = torch.randint(0, N_VOCAB, (B, T), generator=gen).to(device)
    loss_fn = _loss_fn(v)

    def step():
        opt.zero_grad(set_to_none=True)
        with _autocast(v, device):
            logits, _ = model(x)
        loss = loss_fn(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        opt.step()

    return raw, step


@contextlib.contextmanager
def _matmul_precision(v: Variant, device: torch.device):
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    tf32 = v.precision in ("tf32", "bf16")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# The keep rule. A variant is kept when its median step is at most 5% slower than the fastest kept
# variant so far (5%: run-to-run noise of a median of a few steps; a change that is neutral on this
# device, e.g. fused AdamW on a tiny model, stays in the chain as it would on the device it is
# meant for). Kept variants form the chain: the next variant is the last kept one plus its own
# change. A variant that is slower than that is not carried into the next ones, so one bad change
# (bf16 autocast without native bf16: 36x) cannot slow every later variant. A step over 10x the
# fastest kept stops the variant's timing early: it cannot be kept anyway.
KEEP_TOLERANCE = 0.05
STOP_FACTOR = 10.0


def slower_reason(ms: float, best_ms: float, best_name: str) -> str | None:
    """Why a variant of `ms` per step is not kept against the fastest kept one, or None to keep it."""
    ratio = ms / best_ms
    if ratio <= 1 + KEEP_TOLERANCE:
        return None
    if ratio >= 2:
        return f"{ratio:.1f}x slower than {best_name}"
    pct = (ratio - 1) * 100
    return f"{pct:.1f}% slower than {best_name}" if pct < 10 else f"{pct:.0f}% slower than {best_name}"


def _settings(v: Variant) -> dict:
    return {k: val for k, val in asdict(v).items() if k not in ("name", "change")}


def run_variants(cfg: Config, device: torch.device, B: int, T: int, run=NullRun()) -> list[dict]:
    """Time the grid as a keep-the-best chain (rule above). Each row: the variant, what it adds,
    `builds_on` (the kept variant it was applied to), its settings, the timing, and `kept` with
    `reason` when not kept (`stopped_early` when a step over 10x the fastest cut its timing short).
    """
    b = cfg.benchmark
    wanted = set(b.variants) if b.variants else None
    known = [name for name, _, _ in variant_grid()]
    if wanted and wanted - set(known):
        raise BadInput(f"benchmark.variants: unknown {sorted(wanted - set(known))}; known: {', '.join(known)}")
    rows: list[dict] = []
    head = Variant("baseline", "")  # the last kept variant: what the next one builds on
    best: tuple[str, float] | None = None  # fastest kept variant and its median ms
    base_ms = None
    for name, change_text, change in variant_grid():
        reason = skip_reason(change, device)
        if reason is None and wanted is not None and name not in wanted:
            reason = "not in benchmark.variants"
        if reason:
            rows.append({"variant": name, "change": change_text, "skipped": reason})
            log.info("benchmark %s: skipped (%s)", name, reason)
            continue
        v = replace(head, name=name, change=change_text, **change)
        try:
            with _matmul_precision(v, device):
                raw, step = build_step(v, cfg, device, B, T)
                extra_warmup = 2 if v.compile else 0  # compilation happens in the first calls
                with PeakMemory(device) as mem:
                    times, stopped = time_step(
                        step,
                        device,
                        b.warmup + extra_warmup,
                        b.steps,
                        settle=1 + extra_warmup,
                        stop_over_s=best and STOP_FACTOR * best[1] / 1e3,
                    )
        except Exception as e:  # noqa: BLE001 - one variant that cannot run (a compiler error, out of
            # memory) is a row of the report, not the end of the stage: the rest of the grid and the
            # micro-benchmarks still run, and the next variant builds on the last one kept.
            first = (str(e).strip().splitlines() or [""])[0][:200]
            rows.append({"variant": name, "change": change_text, "skipped": f"failed: {type(e).__name__}: {first}"})
            log.warning("benchmark %s: failed (%s: %s); going on without it", name, type(e).__name__, first)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        s = summary(times)
        tokens_per_sec = B * T / (s["ms"] / 1e3)
        precision = "fp32" if v.precision == "tf32" else v.precision
        peak = flops.peak_flops(device, precision, b.peak_flops)
        mfu = flops.mfu(tokens_per_sec, raw.flops_per_token(T), peak)
        base_ms = base_ms or s["ms"]
        why = best and slower_reason(s["ms"], best[1], best[0])
        row = {
            "variant": name,
            "change": change_text,
            "builds_on": head.name if best else None,
            "settings": _settings(v),
            "ms_per_step": s["ms"],
            "min_ms": s["min_ms"],
            "max_ms": s["max_ms"],
            "tokens_per_sec": tokens_per_sec,
            "mfu": mfu,
            "peak_memory_mb": mem.peak_mb,
            "speedup": base_ms / s["ms"],
            "timed_steps": len(times),
            "stopped_early": stopped,
            "kept": not why,
        }
        if why:
            row["reason"] = why
        rows.append(row)
        if why:
            log.info(
                "benchmark %s: %.1f ms/step (%.2fx), not kept: %s%s",
                name,
                s["ms"],
                row["speedup"],
                why,
                f" (stopped after {len(times)} step(s) over {STOP_FACTOR:.0f}x)" if stopped else "",
            )
        else:
            head = v
            if best is None or s["ms"] < best[1]:
                best = (name, s["ms"])
            log.info(
                "benchmark %s: %.1f ms/step (%.2fx), %.0f tokens/s, kept", name, s["ms"], row["speedup"], tokens_per_sec
            )
        del raw, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Micro-benchmarks


def _attention_fns(device: torch.device) -> dict[str, Callable]:
    def math_attn(q, k, v):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        return F.softmax(att, dim=-1) @ v

    fns = {"math": math_attn, "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    if _kernels_available() is None:
        from kernels.flash_attention import flash_attention

        fns["triton"] = lambda q, k, v: flash_attention(q, k, v, causal=True)
    return fns


def bench_attention(cfg: Config, device: torch.device, dtype: torch.dtype) -> list[dict]:
    b = cfg.benchmark
    B, H, D = b.attention_batch, b.attention_heads, b.attention_head_dim
    rows = []
    for name, fn in _attention_fns(device).items():
        for T in b.attention_seq_lens:
            q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            fwd = summary(time_it(lambda: fn(q, k, v), device, 2, b.steps))

            def fwd_bwd():
                fn(q, k, v).sum().backward()

            both = summary(time_it(fwd_bwd, device, 2, b.steps))
            flops_fwd = 4 * B * H * T * T * D / 2  # causal: half of QK^T and PV
            rows.append(
                {
                    "backend": name,
                    "seq_len": T,
                    "fwd_ms": fwd["ms"],
                    "fwd_bwd_ms": both["ms"],
                    "fwd_tflops": flops_fwd / (fwd["ms"] / 1e3) / 1e12,
                    "fwd_bwd_tflops": 3.5 * flops_fwd / (both["ms"] / 1e3) / 1e12,
                }
            )  # bwd = 2.5x fwd
    return rows


def bench_cross_entropy(cfg: Config, device: torch.device, dtype: torch.dtype) -> list[dict]:
    b = cfg.benchmark
    impls: dict[str, Callable] = {"torch": F.cross_entropy}
    if _kernels_available() is None:
        from kernels.cross_entropy import fused_cross_entropy

        impls["fused"] = fused_cross_entropy
    rows = []
    for V in b.ce_vocab_sizes:
        gen = torch.Generator().manual_seed(0)
        targets = torch.randint(0, V, (b.ce_rows,), generator=gen).to(device)
        for name, fn in impls.items():
            logits = torch.randn(b.ce_rows, V, generator=gen).to(device=device, dtype=dtype).requires_grad_()

            def step():
                logits.grad = None
                fn(logits, targets).backward()

            with PeakMemory(device) as mem:
                s = summary(time_it(step, device, 2, b.steps))
            rows.append({"impl": name, "vocab": V, "rows": b.ce_rows, "ms": s["ms"], "peak_memory_mb": mem.peak_mb})
    return rows


def profile_variants(
    cfg: Config, device: torch.device, B: int, T: int, trace_dir: Path, timed: list[dict] | None = None
) -> list[dict]:
    """Chrome traces of `profile_steps` steps of each chosen variant, and their top kernels. A variant
    timed in `timed` (rows of `run_variants`) is traced with the settings it was timed with (its
    place in the keep-the-best chain); any other with its own change on the baseline."""
    from torch.profiler import ProfilerActivity, profile

    b = cfg.benchmark
    grid = {name: change for name, _, change in variant_grid()}
    unknown = [n for n in b.profile if n not in grid]
    if unknown:
        raise BadInput(f"benchmark.profile: unknown variants {unknown}; known: {', '.join(grid)}")
    trace_dir.mkdir(parents=True, exist_ok=True)
    out = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name in b.profile:
        change = grid[name]
        if skip_reason(change, device):
            continue
        ran = next((r["settings"] for r in timed or [] if r["variant"] == name and "settings" in r), None)
        v = Variant(name, "", **ran) if ran else replace(Variant(name, ""), **change)
        with _matmul_precision(v, device):
            _, step = build_step(v, cfg, device, B, T)
            step()
            with profile(activities=activities) as prof:
                for _ in range(b.profile_steps):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        path = trace_dir / f"{name}.json"
        prof.export_chrome_trace(str(path))
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:10]
        total = sum(getattr(e, key, 0) for e in prof.key_averages()) or 1
        out.append(
            {
                "variant": name,
                "trace": str(path),
                "clock": "self CUDA"
                if device.type == "cuda"
                else "self CPU (summed over threads, profiler overhead included)",
                "top": [
                    {
                        "kernel": e.key,
                        "ms_per_step": getattr(e, key, 0) / 1e3 / b.profile_steps,
                        "share": getattr(e, key, 0) / total,
                        "calls": e.count,
                    }
                    for e in events
                ],
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# The recipe


@dataclass
class Results:
    device: str
    B: int
    T: int
    variants: list = field(default_factory=list)
    attention: list = field(default_factory=list)
    cross_entropy: list = field(default_factory=list)
    profiles: list = field(default_factory=list)
    seconds: float = 0.0


def measure(cfg: Config, trace_dir: Path, run=NullRun()) -> Results:
    b = cfg.benchmark
    if b.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(b.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BadInput("benchmark.device is cuda but no CUDA device is available")
    T = b.block_size or cfg.model.block_size
    start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    res = Results(device=name, B=b.batch_size, T=T)
    res.variants = run_variants(cfg, device, b.batch_size, T, run)
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    res.attention = bench_attention(cfg, device, half)
    res.cross_entropy = bench_cross_entropy(cfg, device, half)
    res.profiles = profile_variants(cfg, device, b.batch_size, T, trace_dir, res.variants)
    res.seconds = time.perf_counter() - start
    return res
