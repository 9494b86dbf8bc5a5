"""benchmarks/bench_recipe.py, the pretraining-recipe benchmark that docs/results/recipe_tiny.* come
from: its pure parts on made-up records (parsing the combinations and seeds, the evals and their
training seconds from the csv, the eval at a fixed wall time, the medians over seeds). No run is started here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_recipe.py"


@pytest.fixture(scope="module")
def bench():
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("bench_recipe", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = saved


def evals(*points, final=None):
    """(step, val_loss, elapsed_s) points, then the whole split (step, val_loss, elapsed_s)."""
    out = [{"step": s, "val_loss": v, "whole_split": False, "elapsed_s": t} for s, v, t in points]
    if final:
        out.append({"step": final[0], "val_loss": final[1], "whole_split": True, "elapsed_s": final[2]})
    return out


def run(combo, seed, wall_s, final_val, points, step_time_s=0.4):
    return {
        "combo": combo,
        "seed": seed,
        "wall_s": wall_s,
        "final_val_loss": final_val,
        "step_time_s": step_time_s,
        "params_M": 7.23,
        "max_steps": 200,
        "evals": evals(*points, final=(200, final_val, wall_s)),
    }


def test_combos_are_parsed_in_order_once_each_and_an_unknown_one_is_bad_input(bench):
    assert bench.parse_combos("llama-muon, gpt2-adamw,llama-muon,") == ["llama-muon", "gpt2-adamw"]
    assert bench.parse_combos(",".join(bench.ALL_COMBOS)) == list(bench.ALL_COMBOS)
    assert bench.split_combo("llama-muon") == ("llama", "muon")
    for bad in ("gpt2-sgd", "gpt3-adamw", "", " , "):
        with pytest.raises(bench.BadInput):
            bench.parse_combos(bad)


def test_seeds_are_distinct_integers(bench):
    assert bench.parse_seeds("1337,1338, 1339") == [1337, 1338, 1339]
    for bad in ("a,b", "1,1", ""):
        with pytest.raises(bench.BadInput):
            bench.parse_seeds(bad)


def test_the_csv_rows_give_the_evals_with_the_whole_split_last_and_the_train_loss_every_10(bench):
    rows = [
        {"step": str(s), "train_loss": f"{10 - s / 10:.4f}", "val_loss": "", "lr": "0.001", "train_s": str(s * 0.5)}
        for s in range(20)
    ]
    rows[0]["val_loss"], rows[10]["val_loss"] = "10.9", "9.9"
    rows.append({"step": "20", "train_loss": "", "val_loss": "9.5", "lr": "", "train_s": "10.25"})
    found, train = bench.read_curve(rows)
    assert found == [
        {"step": 0, "val_loss": 10.9, "whole_split": False, "elapsed_s": 0.0},
        {"step": 10, "val_loss": 9.9, "whole_split": False, "elapsed_s": 5.0},
        {"step": 20, "val_loss": 9.5, "whole_split": True, "elapsed_s": 10.25},
    ]
    assert train == [[0, 10.0], [10, 9.0]]


def test_the_eval_at_a_fixed_wall_time_is_the_latest_partial_one_not_after_it(bench):
    curve = evals((0, 10.8, 0.0), (100, 6.4, 30.0), (200, 5.9, 61.0), final=(300, 5.0, 90.0))
    assert bench.at_wall_time(curve, 61.0)["step"] == 200
    assert bench.at_wall_time(curve, 60.9)["step"] == 100
    assert bench.at_wall_time(curve, 1000.0)["step"] == 200  # never the whole split
    assert bench.at_wall_time(curve, -1.0) is None


def test_fixed_wall_time_is_the_smallest_median_and_every_figure_a_median_over_seeds(bench):
    runs = [
        run("gpt2-adamw", 1, 100.0, 5.0, [(0, 10.8, 0.0), (100, 6.0, 48.0), (150, 5.5, 75.0)]),
        run("gpt2-adamw", 2, 110.0, 5.2, [(0, 10.8, 0.0), (100, 6.2, 52.0), (150, 5.7, 80.0)], step_time_s=0.5),
        run("gpt2-adamw", 3, 90.0, 5.1, [(0, 10.8, 0.0), (100, 6.1, 45.0), (150, 5.6, 70.0)]),
        run("llama-muon", 1, 150.0, 4.6, [(0, 10.8, 0.0), (100, 5.5, 70.0), (150, 5.0, 110.0)]),
        run("llama-muon", 2, 200.0, 4.8, [(0, 10.8, 0.0), (100, 5.7, 95.0), (150, 5.2, 150.0)]),
        run("llama-muon", 3, 170.0, 4.7, [(0, 10.8, 0.0), (100, 5.6, 80.0), (150, 5.1, 128.0)]),
    ]
    wall = bench.fixed_wall_time(runs)
    assert wall == 100.0  # gpt2-adamw's median; llama-muon's is 170
    summary = bench.summarize(runs, wall)
    assert list(summary) == ["gpt2-adamw", "llama-muon"]
    adamw, muon = summary["gpt2-adamw"], summary["llama-muon"]
    assert adamw["final_val_loss"] == 5.1 and (adamw["final_val_loss_min"], adamw["final_val_loss_max"]) == (5.0, 5.2)
    assert adamw["val_loss_at_step"] == {"0": 10.8, "100": 6.1, "150": 5.6}
    assert adamw["elapsed_s_at_step"]["100"] == 48.0
    assert adamw["step_time_s"] == 0.4 and adamw["wall_s"] == 100.0 and adamw["seeds"] == [1, 2, 3]
    assert adamw["steps_at_wall_time"] == [150, 150, 150] and adamw["val_loss_at_wall_time"] == 5.6
    # llama-muon at 100 s: seed 1 its step 100 (70 s), seed 2 its step 100 (95 s), seed 3 step 100 (80 s)
    assert muon["steps_at_wall_time"] == [100, 100, 100] and muon["val_loss_at_wall_time"] == 5.6
    assert muon["final_val_loss"] == 4.7
    table = bench.markdown(summary, wall, 200)
    assert "| gpt2-adamw | 7.23M | 5.100 (5.000-5.200) | 5.600 (150,150,150) | 400 ms | 100.0 s |" in table
    assert "| 100 | 6.100 | 5.600 |" in table


def test_only_the_steps_every_seed_has_are_in_the_median_curve(bench):
    runs = [
        run("gpt2-muon", 1, 50.0, 5.0, [(0, 10.8, 0.0), (100, 6.0, 20.0), (150, 5.5, 40.0)]),
        run("gpt2-muon", 2, 60.0, 5.4, [(0, 10.8, 0.0), (100, 6.4, 25.0)]),
    ]
    summary = bench.summarize(runs, bench.fixed_wall_time(runs))
    assert summary["gpt2-muon"]["val_loss_at_step"] == {"0": 10.8, "100": 6.2}  # two seeds: their mean
    assert summary["gpt2-muon"]["wall_s"] == 55.0
