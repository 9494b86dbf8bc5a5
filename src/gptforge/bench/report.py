"""The benchmark stage's outputs: the markdown report, the CSV tables, the plots, the metrics.

Everything here reads the `Results` that `gptforge.bench.grid.measure` returns and measures nothing
itself. Imports matplotlib only when plotting.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import torch

from gptforge.bench.grid import KEEP_TOLERANCE, STOP_FACTOR, Results
from gptforge.config.schema import Config
from gptforge.io import atomic_file
from gptforge.runtime.tracking import publish_metrics

log = logging.getLogger("gptforge")


def _write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    with atomic_file(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in fields})


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None or v != v else format(v, spec)


def verdict(r: dict, steps: int) -> str:
    """The 'kept' cell of a timed variant: `kept`, or `not kept: <why>` and whether its timing stopped early."""
    text = "kept" if r["kept"] else f"not kept: {r['reason']}"
    if r.get("stopped_early"):
        n = r["timed_steps"]
        text += (
            f" (timing stopped early: a step took over {STOP_FACTOR:.0f}x the fastest kept; "
            f"median of {n} step{'s' if n > 1 else ''}, not {steps})"
        )
    return text


def chain_summary(rows: list[dict]) -> str:
    """One sentence: the fastest kept variant, and every variant not kept with its reason."""
    timed = [r for r in rows if "skipped" not in r]
    kept = [r for r in timed if r["kept"]]
    if not kept:
        return "No variant ran."
    best = min(kept, key=lambda r: r["ms_per_step"])
    dropped = [f"{r['variant']} ({r['reason']})" for r in timed if not r["kept"]]
    return (
        f"Fastest kept: {best['variant']}, {best['ms_per_step']:.1f} ms/step, {best['speedup']:.2f}x the first "
        f"variant. Not kept: {'; '.join(dropped) if dropped else 'none'}."
    )


def report_markdown(cfg: Config, res: Results) -> str:
    m, b = cfg.model, cfg.benchmark
    lines = [
        f"# Training-step benchmark on {res.device}",
        "",
        f"Model: {m.n_layer} layers, {m.n_head} heads, {m.n_embd} wide; batch {res.B} x {res.T} tokens; "
        f"torch {torch.__version__}. Each variant adds one change (build-nanogpt's order) to the best "
        "configuration kept so far (column 'built on'). It is kept, and the next variants build on it, unless "
        f"its median step is more than {KEEP_TOLERANCE:.0%} slower than the fastest kept variant: a change that "
        "slows the step down here is not carried into the next variants. A variant whose step takes over "
        f"{STOP_FACTOR:.0f}x the fastest kept (any step after the first, warm-up included) stops being timed there. "
        "Timed: one full training step (forward, cross-entropy, backward, "
        f"gradient clipping, AdamW) on fixed random tokens; {b.warmup} untimed warm-up steps (+2 when compiled), then "
        f"the median of {b.steps} steps, each between device synchronisations; min and max beside it. "
        "MFU = tokens/s x (6N + 12 L H Q T) / the device's peak (n/a where the peak is unknown, e.g. CPUs; "
        "set benchmark.peak_flops). Peak memory: CUDA allocator peak, or growth of the process RSS on the CPU.",
        "",
        "| variant | adds | ms/step (min-max) | tokens/s | speed-up | MFU | peak memory MB | built on | kept |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res.variants:
        if "skipped" in r:
            lines.append(f"| {r['variant']} | {r['change']} | skipped: {r['skipped']} | | | | | | |")
        else:
            mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
            lines.append(
                f"| {r['variant']} | {r['change']} | {r['ms_per_step']:.1f} ({r['min_ms']:.1f}-"
                f"{r['max_ms']:.1f}) | {r['tokens_per_sec']:,.0f} | {r['speedup']:.2f}x | {mfu} | "
                f"{_fmt(r['peak_memory_mb'], '.0f')} | {r.get('builds_on') or '-'} | "
                f"{verdict(r, b.steps)} |"
            )
    lines += ["", chain_summary(res.variants)]
    lines += [
        "",
        f"## Attention (batch {b.attention_batch}, {b.attention_heads} heads of dim {b.attention_head_dim}, causal)",
        "",
        "| backend | T | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['backend']} | {r['seq_len']} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.3f} | {r['fwd_bwd_ms']:.2f} | "
        f"{r['fwd_bwd_tflops']:.3f} |"
        for r in res.attention
    ]
    lines += [
        "",
        f"## Cross-entropy, forward+backward over {b.ce_rows} rows",
        "",
        "| implementation | vocab | ms | peak memory MB |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['impl']} | {r['vocab']} | {r['ms']:.2f} | {_fmt(r['peak_memory_mb'], '.0f')} |"
        for r in res.cross_entropy
    ]
    for p in res.profiles:
        lines += [
            "",
            f"## Top kernels: {p['variant']} (trace: `{p['trace']}`)",
            "",
            f"Time per step is {p['clock']} time, over {b.profile_steps} profiled steps.",
            "",
            "| kernel | ms/step | share | calls |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| `{t['kernel']}` | {t['ms_per_step']:.2f} | {t['share']:.1%} | {t['calls']} |" for t in p["top"]]
    lines += ["", f"Total benchmark time: {res.seconds:.0f} s.", ""]
    return "\n".join(lines)


def plot_results(res: Results, plots_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    ran = [r for r in res.variants if "skipped" not in r]
    if ran:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [r["variant"] + ("" if r["kept"] else " (not kept)") for r in ran][::-1]
        ms = [r["ms_per_step"] for r in ran][::-1]
        ax.barh(labels, ms, color=["C0" if r["kept"] else "0.6" for r in ran][::-1])
        if max(ms) > 10 * min(ms):  # one very slow variant would flatten the others' bars
            ax.set_xscale("log")
        ax.set_xlabel("ms per training step (median); grey: not kept")
        ax.set_title(res.device)
        fig.tight_layout()
        made.append(plots_dir / "benchmark_variants.png")
        fig.savefig(made[-1], dpi=100)
        plt.close(fig)
    if res.attention:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for backend in sorted({r["backend"] for r in res.attention}):
            pts = [(r["seq_len"], r["fwd_bwd_tflops"]) for r in res.attention if r["backend"] == backend]
            ax.plot(*zip(*pts), "o-", label=backend)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("fwd+bwd TFLOP/s")
        ax.legend()
        fig.tight_layout()
        made.append(plots_dir / "benchmark_attention.png")
        fig.savefig(made[-1], dpi=100)
        plt.close(fig)
    return made


def write_outputs(cfg: Config, res: Results, run, metrics_path, report_path, plots_dir) -> dict:
    plots_dir, report_path = Path(plots_dir), Path(report_path)
    plots_dir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {"seconds": res.seconds}
    for r in res.variants:
        if "skipped" not in r:
            for k in ("ms_per_step", "tokens_per_sec", "speedup", "mfu", "peak_memory_mb"):
                if r.get(k) is not None and r[k] == r[k]:
                    metrics[f"{r['variant']}.{k}"] = r[k]
            metrics[f"{r['variant']}.kept"] = float(r["kept"])  # 1 kept, 0 not kept (numbers only: DVC metrics)
            metrics[f"{r['variant']}.stopped_early"] = float(r["stopped_early"])
    kept = [r for r in res.variants if r.get("kept")]
    if kept:
        best = min(kept, key=lambda r: r["ms_per_step"])
        metrics["best_ms_per_step"], metrics["best_speedup"] = best["ms_per_step"], best["speedup"]
        run.set_tags(
            {
                "benchmark.best_variant": best["variant"],
                "benchmark.not_kept": "; ".join(
                    f"{r['variant']}: {r['reason']}" for r in res.variants if "skipped" not in r and not r["kept"]
                )
                or "none",
            }
        )
    for r in res.attention:
        metrics[f"attention.{r['backend']}.T{r['seq_len']}.fwd_bwd_tflops"] = r["fwd_bwd_tflops"]
    for r in res.cross_entropy:
        metrics[f"cross_entropy.{r['impl']}.V{r['vocab']}.ms"] = r["ms"]
    _write_csv(
        plots_dir / "benchmark_variants.csv",
        [
            {**r, "kept": int(r["kept"]), "stopped_early": int(r["stopped_early"])}
            for r in res.variants
            if "skipped" not in r
        ],
        # the measured columns stay last, in their old order: `dvc plots` plots the last one by default
        [
            "variant",
            "kept",
            "builds_on",
            "stopped_early",
            "reason",
            "ms_per_step",
            "tokens_per_sec",
            "speedup",
            "mfu",
            "peak_memory_mb",
        ],
    )
    _write_csv(
        plots_dir / "benchmark_attention.csv",
        res.attention,
        ["backend", "seq_len", "fwd_ms", "fwd_tflops", "fwd_bwd_ms", "fwd_bwd_tflops"],
    )
    _write_csv(
        plots_dir / "benchmark_cross_entropy.csv", res.cross_entropy, ["impl", "vocab", "rows", "ms", "peak_memory_mb"]
    )
    with atomic_file(report_path, "w", encoding="utf-8") as f:
        f.write(report_markdown(cfg, res))
    publish_metrics(run, metrics, metrics_path)
    for path in [report_path, *plots_dir.glob("benchmark_*.csv"), *plot_results(res, plots_dir)]:
        run.log_artifact(path)
    for p in res.profiles:
        run.log_artifact(p["trace"], "traces")
    return metrics
