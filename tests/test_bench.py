"""The benchmark stage on the CPU: every output, the skipped variants with their reasons."""

from __future__ import annotations

import csv
import json

import pytest

from gptforge.bench.stage import benchmark
from gptforge.config.load import load_config
from gptforge.errors import BadInput

SMALL = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "benchmark.batch_size=2",
    "benchmark.steps=2",
    "benchmark.warmup=1",
    "benchmark.attention_seq_lens=[16, 32]",
    "benchmark.attention_batch=1",
    "benchmark.attention_heads=2",
    "benchmark.attention_head_dim=16",
    "benchmark.ce_vocab_sizes=[300]",
    "benchmark.ce_rows=32",
    "benchmark.profile_steps=1",
    "benchmark.device=cpu",
    "tracking.enabled=false",
]


@pytest.mark.slow
def test_benchmark_writes_every_output(tmp_path):
    cfg = load_config(None, [*SMALL, "benchmark.variants=[baseline, sdpa, vocab50304]"])
    metrics = benchmark(
        cfg,
        metrics_path=tmp_path / "metrics/benchmark.json",
        report_path=tmp_path / "reports/benchmark.md",
        plots_dir=tmp_path / "plots",
        trace_dir=tmp_path / "reports/traces",
    )
    saved = json.loads((tmp_path / "metrics/benchmark.json").read_text())
    assert saved == pytest.approx(metrics)
    assert metrics["baseline.speedup"] == 1.0 and metrics["sdpa.ms_per_step"] > 0
    assert {
        "attention.math.T16.fwd_bwd_tflops",
        "attention.sdpa.T32.fwd_bwd_tflops",
        "cross_entropy.torch.V300.ms",
    } <= set(metrics)
    with open(tmp_path / "plots/benchmark_variants.csv") as f:
        assert [r["variant"] for r in csv.DictReader(f)] == ["baseline", "sdpa", "vocab50304"]
    report = (tmp_path / "reports/benchmark.md").read_text()
    assert "on cpu" in report and "median of 2 steps" in report
    assert "| tf32 | TF32 matmuls | skipped: TF32 is a CUDA tensor-core mode |" in report
    assert "| triton_attention |" in report and "skipped: needs CUDA" in report
    assert "| bf16 | bf16 autocast | skipped: not in benchmark.variants |" in report
    assert "## Top kernels: baseline" in report
    trace = json.loads((tmp_path / "reports/traces/baseline.json").read_text())
    assert trace["traceEvents"]
    assert (tmp_path / "plots/benchmark_attention.png").stat().st_size > 0


def test_unknown_variant_is_bad_input(tmp_path):
    cfg = load_config(None, [*SMALL, "benchmark.variants=[baseline, turbo]"])
    with pytest.raises(BadInput, match=r"benchmark.variants: unknown \['turbo'\]"):
        benchmark(
            cfg,
            metrics_path=tmp_path / "m.json",
            report_path=tmp_path / "r.md",
            plots_dir=tmp_path / "p",
            trace_dir=tmp_path / "t",
        )
