"""The benchmark's keep-the-best chain: a variant that slows the step down is not kept and not built
on, its timing stops early when hopeless, and every output says which variants were kept and why.
Every step is faked: it runs no model and advances a fake clock, the only clock the timing reads,
so every duration is exact (no sleeping, no real slow kernels, nothing the machine's load can move)."""

from __future__ import annotations

import csv
import functools
import json

import pytest
import torch
from fixture_data import FakeRun
from test_bench import SMALL

from gptforge.bench import grid as bench
from gptforge.bench.stage import benchmark
from gptforge.config.load import load_config


class FakeClock:
    """Seconds that the faked steps add; nothing else moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake(monkeypatch):
    """fake(name=seconds, ...): each step of those variants runs no model and takes `seconds` on the
    fake clock; a variant not named fails the test. Returns the variants given to build_step and
    how many steps each ran."""
    clock, built, calls = FakeClock(), [], {}
    seconds: dict[str, float] = {}
    real_build = bench.build_step

    def build_step(v, *args):
        built.append(v)
        raw, _ = real_build(v, *args)
        assert v.name in seconds, f"variant {v.name} has no faked step time"

        def step():
            calls[v.name] = calls.get(v.name, 0) + 1
            clock.now += seconds[v.name]

        return raw, step

    monkeypatch.setattr(bench, "build_step", build_step)
    monkeypatch.setattr(bench, "time_step", functools.partial(bench.time_step, clock=clock))

    def make(**step_seconds: float):
        seconds.update(step_seconds)
        return built, calls

    return make


class Tags(FakeRun):
    def __init__(self) -> None:
        super().__init__()
        self.tags: dict = {}

    def set_tags(self, tags) -> None:
        self.tags.update(tags)


def test_a_slow_variant_is_not_kept_and_the_chain_goes_on_from_the_best(tmp_path, fake):
    # Step times exact in binary, so the clock's sums and the medians are exact floats.
    # bf16: 30x the baseline, over the 10x that stops a timing early; sdpa: 2x faster than the
    # baseline, kept; vocab50304 on top of sdpa: 2x faster again, kept and the best.
    built, calls = fake(baseline=1.0, bf16=30.0, sdpa=0.5, vocab50304=0.25)
    cfg = load_config(None, [*SMALL, "benchmark.steps=3", "benchmark.variants=[baseline, bf16, sdpa, vocab50304]"])
    run = Tags()
    metrics = benchmark(
        cfg,
        run=run,
        metrics_path=tmp_path / "metrics/benchmark.json",
        report_path=tmp_path / "reports/benchmark.md",
        plots_dir=tmp_path / "plots",
        trace_dir=tmp_path / "reports/traces",
    )

    by_name = {v.name: v for v in built}
    assert by_name["bf16"].precision == "bf16"
    # The next variants build on the best kept configuration, not on the slow one.
    assert by_name["sdpa"].precision == "fp32" and by_name["sdpa"].attention == "sdpa"
    assert by_name["vocab50304"].precision == "fp32" and by_name["vocab50304"].vocab_size == 50304
    assert by_name["vocab50304"].attention == "sdpa"
    # Stopped early: the first (settling) warm-up step, then one step over 10x the best; not 1 + 3.
    assert calls["bf16"] == 2 and calls["sdpa"] == 1 + 3 and calls["vocab50304"] == 1 + 3

    assert metrics["bf16.kept"] == 0 and metrics["bf16.stopped_early"] == 1
    assert metrics["baseline.kept"] == 1 and metrics["baseline.stopped_early"] == 0
    assert metrics["sdpa.kept"] == 1 and metrics["vocab50304.kept"] == 1
    assert metrics["baseline.ms_per_step"] == 1000.0 and metrics["bf16.ms_per_step"] == 30_000.0
    assert metrics["sdpa.ms_per_step"] == 500.0 and metrics["vocab50304.ms_per_step"] == 250.0
    assert metrics["bf16.speedup"] == pytest.approx(1 / 30) and metrics["vocab50304.speedup"] == 4.0
    assert metrics["best_ms_per_step"] == 250.0
    assert json.loads((tmp_path / "metrics/benchmark.json").read_text()) == pytest.approx(metrics)

    report = (tmp_path / "reports/benchmark.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| bf16 |"))
    assert "| baseline | not kept: 30.0x slower than baseline" in row
    assert "timing stopped early: a step took over 10x the fastest kept; median of 1 step, not 3" in row
    assert next(line for line in report.splitlines() if line.startswith("| sdpa |")).count("| baseline |") == 1
    assert "Not kept: bf16 (" in report and "more than 5% slower than the fastest kept" in report

    with open(tmp_path / "plots/benchmark_variants.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["baseline", "bf16", "sdpa", "vocab50304"]
    assert rows["bf16"]["kept"] == "0" and rows["bf16"]["reason"] == "30.0x slower than baseline"
    assert rows["baseline"]["kept"] == "1" and rows["sdpa"]["builds_on"] == "baseline"
    assert rows["vocab50304"]["builds_on"] == "sdpa"
    # MLflow: the same metrics, and tags that say which variant won and which were not kept, and why.
    assert run.metrics[-1]["bf16.kept"] == 0 and run.metrics[-1]["baseline.kept"] == 1
    assert run.tags["benchmark.not_kept"] == "bf16: 30.0x slower than baseline"
    assert run.tags["benchmark.best_variant"] == "vocab50304"


def test_a_fast_change_is_kept_and_built_on(fake):
    built, _ = fake(baseline=1.0, bf16=0.3, sdpa=0.31)  # a device with fast bf16; sdpa within 5%
    cfg = load_config(None, [*SMALL, "benchmark.variants=[baseline, bf16, sdpa]"])
    rows = bench.run_variants(cfg, torch.device("cpu"), 2, 32)
    bf16 = next(r for r in rows if r["variant"] == "bf16")
    assert bf16["kept"] and "reason" not in bf16 and bf16["builds_on"] == "baseline"
    sdpa = next(r for r in rows if r["variant"] == "sdpa")
    assert sdpa["kept"] and sdpa["builds_on"] == "bf16" and sdpa["settings"]["precision"] == "bf16"
    assert [v.precision for v in built] == ["fp32", "bf16", "bf16"]


def test_a_variant_that_fails_is_a_row_and_the_chain_goes_on(tmp_path, fake, monkeypatch):
    # On an H100, compiling the model with the Triton attention raised inside Inductor and ended
    # the whole stage; a failing variant is now a row saying why, and the next builds on the last kept.
    built, calls = fake(baseline=1.0, sdpa=0.5, vocab50304=0.25)
    real_build = bench.build_step

    def build_step(v, *args):
        if v.name == "sdpa":
            raise RuntimeError("CompilationError at 40:14\nmore lines")
        return real_build(v, *args)

    monkeypatch.setattr(bench, "build_step", build_step)
    cfg = load_config(None, [*SMALL, "benchmark.steps=3", "benchmark.variants=[baseline, sdpa, vocab50304]"])
    rows = bench.run_variants(cfg, torch.device("cpu"), 2, 32)
    by_name = {r["variant"]: r for r in rows}
    assert by_name["sdpa"] == {
        "variant": "sdpa",
        "change": by_name["sdpa"]["change"],
        "skipped": "failed: RuntimeError: CompilationError at 40:14",
    }
    assert by_name["vocab50304"]["kept"] and by_name["vocab50304"]["builds_on"] == "baseline"
    assert built[-1].attention == "math" and built[-1].vocab_size == 50304
    assert "sdpa" not in calls and calls["vocab50304"] == 1 + 3


def test_the_keep_rule_in_words():
    assert bench.slower_reason(105.0, 100.0, "sdpa") is None  # within the 5% tolerance
    assert bench.slower_reason(90.0, 100.0, "sdpa") is None
    assert bench.slower_reason(108.0, 100.0, "sdpa") == "8.0% slower than sdpa"
    assert bench.slower_reason(150.0, 100.0, "sdpa") == "50% slower than sdpa"
    assert bench.slower_reason(12334.0, 339.0, "baseline") == "36.4x slower than baseline"


def test_time_step_stops_at_the_first_hopeless_step_after_settling():
    now = [0.0]
    durations = iter([100.0, 1.0, 1.0, 50.0, 1.0, 1.0])  # the first call settles (e.g. compiles)

    def step():
        now[0] += next(durations)

    times, stopped = bench.time_step(step, torch.device("cpu"), 2, 4, settle=1, stop_over_s=10.0, clock=lambda: now[0])
    assert stopped and times == [1.0, 50.0]  # timed steps so far, the slow one included
    now[0], durations = 0.0, iter([100.0, 50.0])
    times, stopped = bench.time_step(step, torch.device("cpu"), 3, 4, settle=1, stop_over_s=10.0, clock=lambda: now[0])
    assert stopped and times == [50.0]  # stopped during warm-up: the judged warm-up step
    now[0], durations = 0.0, iter([100.0] + [1.0] * 5)
    assert bench.time_step(step, torch.device("cpu"), 2, 4, stop_over_s=10.0, clock=lambda: now[0]) == (
        [1.0] * 4,
        False,
    )
