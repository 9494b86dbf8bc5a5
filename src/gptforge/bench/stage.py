"""The `benchmark` stage's recipe: measure the grid (`grid`), then write and log its outputs (`report`)."""

from __future__ import annotations

from pathlib import Path

from gptforge.bench.grid import measure
from gptforge.bench.report import write_outputs
from gptforge.config.schema import Config
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun


def benchmark(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run=NullRun(),
    metrics_path="metrics/benchmark.json",
    report_path="reports/benchmark.md",
    plots_dir="plots",
    trace_dir="reports/benchmark_traces",
) -> dict:
    """The stage: measure everything, then write and log the outputs."""
    res = steps(measure, cfg, Path(trace_dir), run)
    return steps(write_outputs, cfg, res, run, metrics_path, report_path, plots_dir)
