"""The benchmark scripts that the figures in docs/ come from still run and report what they say they
report (smallest settings; the timings themselves are not asserted: a unit test is no
benchmark)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, timeout: int = 300) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout[proc.stdout.index("{") :])


@pytest.mark.slow  # a benchmark script in its own interpreter: ~9 s here
def test_bench_generate_compares_with_hugging_face_and_checks_the_tokens():
    r = run_script("bench_generate.py", "--config", "tiny", "--new-tokens", "20", "--repeats", "2")
    assert r["config"] == "tiny" and r["new_tokens"] == 20 and r["repeats"] == 2
    assert r["same_tokens"] is True and r["same_tokens_full_head"] is True
    for key in ("ours_tokens_per_sec", "hf_tokens_per_sec", "ours_full_head_tokens_per_sec"):
        assert r[key] > 0
    assert len(r["ours_times_s"]) == len(r["hf_times_s"]) == 2
    assert r["speedup"] == pytest.approx(r["ours_tokens_per_sec"] / r["hf_tokens_per_sec"], rel=0.01)


@pytest.mark.slow  # a benchmark script in its own interpreter: ~9 s here
def test_bench_train_step_reports_the_median_of_the_timed_steps():
    r = run_script("bench_train_step.py", "--steps", "3", "--warmup", "1")
    assert r["timed_steps"] == 3 and r["warmup_steps"] == 1
    assert r["min_step_s"] <= r["median_step_s"] <= r["max_step_s"]
    assert r["tokens_per_sec"] > 0


@pytest.mark.slow
def test_bench_lora_trains_both_recipes_on_the_same_real_tokens():
    r = run_script(
        "bench_lora.py",
        "--recipes",
        "ours,stock",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--hidden",
        "32",
        "--layers",
        "1",
        "--intermediate",
        "64",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--heldout",
        "8",
    )
    assert set(r["recipes"]) == {"ours", "stock"}
    for key in ("speedup", "heldout_loss_ratio", "heldout_loss_initial", "target_met", "machine", "settings"):
        assert key in r
    assert r["same_real_tokens"] and r["same_data"] and r["same_lora_init"] and r["same_lora_config"]
    ours, stock = r["recipes"]["ours"], r["recipes"]["stock"]
    assert ours["real_tokens"] == stock["real_tokens"] > 0 and ours["steps"] == stock["steps"] == 3
    for recipe in (ours, stock):
        (run,) = recipe["runs"]
        assert run["timed_steps"] == 2 and run["tokens_per_sec"] > 0 and 0 <= run["padding_fraction"] < 1
        assert run["heldout_loss"] > 0 and run["peak_rss_mb"] > 0
    assert r["speedup"] == pytest.approx(ours["median"]["tokens_per_sec"] / stock["median"]["tokens_per_sec"], rel=0.01)


@pytest.mark.slow  # ~5 s
def test_bench_rag_times_the_index_build_and_queries():
    r = run_script("bench_rag.py", "--chunks", "300", "--queries", "20", "--rounds", "2")
    assert r["chunks"] == 300 and r["queries"] == 20 and r["rounds"] == 2
    assert r["gptforge_build_s"] > 0 and r["gptforge"]["p50_ms"] > 0 and len(r["gptforge"]["p50_ms_rounds"]) == 2


@pytest.mark.slow  # two worktrees, each benchmark twice in its own interpreter: ~40 s here
def test_compare_commits_runs_each_side_on_its_own_code_in_turn(tmp_path):
    r = run_script(
        "compare_commits.py",
        "--before",
        "HEAD",  # (a clone may be shallow: HEAD against itself, each in a worktree of its own)
        "--rounds",
        "1",
        "--benchmarks",
        "generate,train_step",
        "--generate-args=--new-tokens 8 --repeats 1",
        "--train-step-args=--steps 2 --warmup 1",
        "--out",
        str(tmp_path / "ab.json"),
    )
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert r["commits"] == {"before": head, "after": head}
    for figure in ("generate: ours tok/s (batch 1)", "train step: median ms"):
        assert len(r["figures"][figure]["before"]) == len(r["figures"][figure]["after"]) == 1
        assert all(v > 0 for side in r["figures"][figure].values() for v in side)
    assert json.loads((tmp_path / "ab.json").read_text())["figures"] == r["figures"]
    assert "| train step: median ms |" in (tmp_path / "ab.md").read_text()
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "compare_commits_" not in worktrees  # removed at the end
