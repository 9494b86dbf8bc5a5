"""Four pretraining recipes on the tiny config, model.arch gpt2 | llama x pretrain.optimizer adamw |
muon, each trained from scratch with several seeds on the same tinyshakespeare tokens (nanoGPT's
split) for the same token budget: validation loss at fixed steps and at a fixed wall time, the
step time, and the curves as a plot. Rerun it (about 6 minutes a run on 2 CPU cores, 12 runs):

    .venv/bin/python benchmarks/bench_recipe.py [--combos gpt2-adamw,llama-muon] [--seeds 1337,1338]
        [--steps N] [--eval-interval N] [--data tinyshakespeare/input.txt] [--out-json FILE]
        [--out-png FILE] [--keep]

Data: `gptforge prepare pretrain` once, in a scratch folder without a params.yaml (the built-in
defaults), with data.pretrain.val_tokens=36059 (nanoGPT's split of tinyshakespeare). Runs: one
`gptforge pretrain` per combination and seed, fp32, no compile, the schema's defaults otherwise
(4x4x128, block 64, 768 tokens a step, 1,000 steps, an eval of the first eval_steps validation
batches every eval_interval steps, the whole split after the last step), each in a fresh folder
of its own (data/pretrain linked to the prepared one), one after another, seeds in the outer loop
so that a drift of the machine touches every combination alike. GPTFORGE_PREFECT=0 and
tracking.enabled=false: no recorder or Prefect server shares the cores with the training.

What is read, not invented: plots/pretrain.csv (step, train and val loss, and train_s: the
seconds the run's optimizer steps took before that row, measured by the training loop, evaluations
and checkpoints not counted; its last row, the step max_steps without a train loss, is the whole
validation split), metrics/pretrain.json (the step time: the median of the steps after the first
five, as tokens / steps / tokens_per_sec) and the run's own log (its parameter count).
Fixed wall time T: the smallest of the combinations' median (over seeds) training seconds (train_s
of the last row). Each run's val loss at T: its latest eval of the first eval_steps batches (the
whole-split eval is a different measure and is left out) with train_s <= T; per combination the
median over seeds. Every median is over the seeds (statistics.median).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe, git  # noqa: E402

ARCHS = ("gpt2", "llama")
OPTIMIZERS = ("adamw", "muon")
ALL_COMBOS = tuple(f"{a}-{o}" for a in ARCHS for o in OPTIMIZERS)
DEFAULT_SEEDS = (1337, 1338, 1339)
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
VAL_TOKENS = 36059  # nanoGPT's split of tinyshakespeare: its last 10% in GPT-2 tokens
ENV = {"GPTFORGE_PREFECT": "0", "PYTHONUNBUFFERED": "1"}
COMMON = ["tokenizer.path=sample://gpt2_tokenizer", "tracking.enabled=false"]
RUN_SETTINGS = ["pretrain.precision=fp32", "pretrain.compile=false"]
PARAMS = re.compile(r"pretraining ([\d.]+)M parameters")
TRAIN_EVERY = 10  # the train loss kept in the JSON: every 10th step
COLORS = {"gpt2-adamw": "tab:blue", "gpt2-muon": "tab:orange", "llama-adamw": "tab:green", "llama-muon": "tab:red"}


class BadInput(Exception):
    """Bad arguments or a missing input: one line on stderr, exit 2."""


# ---------------------------------------------------------------------------------------------
# Pure parts (tests/test_bench_recipe.py)


def parse_combos(text: str) -> list[str]:
    """`gpt2-adamw,llama-muon` -> the names, in order, each once; an unknown one is BadInput."""
    names: list[str] = []
    for name in (part.strip().lower() for part in text.split(",")):
        if not name:
            continue
        if name not in ALL_COMBOS:
            raise BadInput(f"unknown combination {name!r}: choose from {', '.join(ALL_COMBOS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise BadInput(f"--combos names none: choose from {', '.join(ALL_COMBOS)}")
    return names


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BadInput(f"--seeds takes integers separated by commas, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise BadInput(f"--seeds takes distinct integers separated by commas, got {text!r}")
    return seeds


def split_combo(name: str) -> tuple[str, str]:
    arch, optimizer = name.split("-")
    return arch, optimizer


def read_curve(rows: list[dict]) -> tuple[list[dict], list[list[float]]]:
    """plots/pretrain.csv's rows -> the evals (step, val_loss, whole_split, elapsed_s: the row's
    train_s) and the train loss every TRAIN_EVERY steps. The whole split is the row with a val
    loss and no train loss."""
    evals, train = [], []
    for row in rows:
        step = int(row["step"])
        if row.get("val_loss") not in (None, ""):
            evals.append(
                {
                    "step": step,
                    "val_loss": float(row["val_loss"]),
                    "whole_split": row.get("train_loss") in (None, ""),
                    "elapsed_s": round(float(row["train_s"]), 2),
                }
            )
        if row.get("train_loss") not in (None, "") and step % TRAIN_EVERY == 0:
            train.append([step, round(float(row["train_loss"]), 4)])
    return evals, train


def at_wall_time(evals: list[dict], wall_s: float) -> dict | None:
    """The latest eval of the first eval_steps batches (not the whole split) with elapsed_s <= wall_s."""
    done = [e for e in evals if not e["whole_split"] and e["elapsed_s"] is not None and e["elapsed_s"] <= wall_s]
    return max(done, key=lambda e: e["step"], default=None)


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fixed_wall_time(runs: list[dict]) -> float:
    """T: the smallest of the combinations' median training wall times."""
    by_combo: dict[str, list[float]] = {}
    for run in runs:
        by_combo.setdefault(run["combo"], []).append(run["wall_s"])
    return min(_median(v) for v in by_combo.values())


def summarize(runs: list[dict], wall_s: float) -> dict[str, dict]:
    """Per combination, medians over its seeds: final (whole-split) val loss, val loss at each eval
    step every seed has, val loss at the fixed wall time `wall_s`, step time and wall time."""
    out: dict[str, dict] = {}
    for combo in dict.fromkeys(run["combo"] for run in runs):
        mine = [run for run in runs if run["combo"] == combo]
        finals = [run["final_val_loss"] for run in mine]
        steps = set.intersection(*({e["step"] for e in run["evals"] if not e["whole_split"]} for run in mine))
        at_step = {
            str(step): _median(
                [e["val_loss"] for run in mine for e in run["evals"] if e["step"] == step and not e["whole_split"]]
            )
            for step in sorted(steps)
        }
        elapsed_at_step = {
            str(step): _median(
                [e["elapsed_s"] for run in mine for e in run["evals"] if e["step"] == step and not e["whole_split"]]
            )
            for step in sorted(steps)
        }
        picked = [at_wall_time(run["evals"], wall_s) for run in mine]
        out[combo] = {
            "seeds": [run["seed"] for run in mine],
            "params_M": _median([run.get("params_M") for run in mine]),
            "final_val_loss": _median(finals),
            "final_val_loss_min": min(finals),
            "final_val_loss_max": max(finals),
            "val_loss_at_wall_time": _median([p["val_loss"] if p else None for p in picked]),
            "steps_at_wall_time": [p["step"] if p else None for p in picked],
            "step_time_s": _median([run["step_time_s"] for run in mine]),
            "wall_s": _median([run["wall_s"] for run in mine]),
            "val_loss_at_step": at_step,
            "elapsed_s_at_step": elapsed_at_step,
        }
    return out


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(summary: dict[str, dict], wall_s: float, max_steps: int) -> str:
    lines = [
        f"| recipe | params | val loss, whole split, step {max_steps} (min-max) | val loss at {wall_s:.1f} s (steps) "
        "| step time | training wall |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for combo, s in summary.items():
        steps = ",".join("-" if x is None else str(x) for x in s["steps_at_wall_time"])
        lines.append(
            f"| {combo} | {_fmt(s['params_M'], '.2f')}M | {_fmt(s['final_val_loss'])} ({_fmt(s['final_val_loss_min'])}-"
            f"{_fmt(s['final_val_loss_max'])}) | {_fmt(s['val_loss_at_wall_time'])} ({steps}) "
            f"| {_fmt(s['step_time_s'] and s['step_time_s'] * 1000, '.0f')} ms | {_fmt(s['wall_s'], '.1f')} s |"
        )
    steps = sorted({int(k) for s in summary.values() for k in s["val_loss_at_step"]})
    lines += ["", "| step | " + " | ".join(summary) + " |", "| ---: |" + " ---: |" * len(summary)]
    for step in steps:
        cells = [_fmt(s["val_loss_at_step"].get(str(step))) for s in summary.values()]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Runs


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BadInput(message)  # one line, exit 2


def prepare_overrides(data: Path) -> list[str]:
    return [f"data.pretrain.source={data}", f"data.pretrain.val_tokens={VAL_TOKENS}", *COMMON]


def pretrain_overrides(combo: str, seed: int, steps: int | None, eval_interval: int | None) -> list[str]:
    arch, optimizer = split_combo(combo)
    out = [*COMMON, *RUN_SETTINGS, f"pretrain.optimizer={optimizer}", f"model.arch={arch}", f"pretrain.seed={seed}"]
    if steps is not None:
        out.append(f"pretrain.max_steps={steps}")
    if eval_interval is not None:
        out.append(f"pretrain.eval_interval={eval_interval}")
    return out


def command(stage: list[str], overrides: list[str]) -> list[str]:
    return ["gptforge", *stage, *(x for o in overrides for x in ("-S", o))]


def shown(cmd: list[str]) -> str:
    return " ".join(f"{k}={v}" for k, v in ENV.items() if k == "GPTFORGE_PREFECT") + " " + shlex.join(cmd)


def stream(cmd: list[str], cwd: Path, log_path: Path) -> tuple[int, float]:
    """Run `cmd` in `cwd`, its output (stdout and stderr) into `log_path`. Returns the exit code
    and the command's wall seconds."""
    env = {**os.environ, **ENV}
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        log.write((shlex.join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen([str(BIN / cmd[0]), *cmd[1:]], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait()
        except BaseException:
            proc.terminate()
            proc.wait(timeout=30)
            raise
    return code, time.perf_counter() - t0


def tail(path: Path) -> str:
    """The log's last lines, a progress bar's redraws as lines of their own."""
    lines = path.read_text(encoding="utf-8", errors="replace").replace("\r", "\n").splitlines()
    return "\n".join(line for line in lines[-2000:] if line.strip())[-3000:]


def one_run(work: Path, prepared: Path, combo: str, seed: int, args) -> dict:
    folder = work / f"{combo}-s{seed}"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "pretrain").symlink_to(prepared / "data" / "pretrain", target_is_directory=True)
    cmd = command(["pretrain"], pretrain_overrides(combo, seed, args.steps, args.eval_interval))
    code, process_s = stream(cmd, folder, folder / "run.log")
    if code != 0:
        raise RuntimeError(
            f"{combo} seed {seed} failed (exit {code}); its log, {folder / 'run.log'}:\n{tail(folder / 'run.log')}"
        )
    with open(folder / "plots" / "pretrain.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    metrics = json.loads((folder / "metrics" / "pretrain.json").read_text(encoding="utf-8"))
    evals, train = read_curve(rows)
    max_steps = max(int(r["step"]) for r in rows)
    wall = float(rows[-1]["train_s"])  # the last row: after the last step
    found = PARAMS.search((folder / "run.log").read_text(encoding="utf-8", errors="replace"))
    step_tokens = metrics["tokens"] / max_steps
    return {
        "combo": combo,
        "arch": split_combo(combo)[0],
        "optimizer": split_combo(combo)[1],
        "seed": seed,
        "max_steps": max_steps,
        "params_M": float(found.group(1)) if found else None,
        "final_val_loss": metrics["val_loss"],
        "tokens": metrics["tokens"],
        "tokens_per_sec": metrics["tokens_per_sec"],
        "step_time_s": step_tokens / metrics["tokens_per_sec"] if metrics["tokens_per_sec"] else None,
        "wall_s": round(wall, 2),
        "process_s": round(process_s, 2),
        "evals": evals,
        "train_loss_every_10": train,
    }


def plot(runs: list[dict], summary: dict[str, dict], wall_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for combo, s in summary.items():
        color = COLORS.get(combo)
        for run in (r for r in runs if r["combo"] == combo):
            part = [e for e in run["evals"] if not e["whole_split"]]
            by_step.plot([e["step"] for e in part], [e["val_loss"] for e in part], color=color, alpha=0.25, lw=0.8)
            timed = [e for e in part if e["elapsed_s"] is not None]
            by_time.plot(
                [e["elapsed_s"] for e in timed], [e["val_loss"] for e in timed], color=color, alpha=0.25, lw=0.8
            )
        steps = [int(k) for k in s["val_loss_at_step"]]
        by_step.plot(steps, list(s["val_loss_at_step"].values()), "o-", color=color, ms=3, label=combo)
        times = list(s["elapsed_s_at_step"].values())
        by_time.plot(times, list(s["val_loss_at_step"].values()), "o-", color=color, ms=3, label=combo)
        final = s["final_val_loss"]
        by_step.plot([runs[0]["max_steps"]], [final], "*", color=color, ms=11)
        by_time.plot([s["wall_s"]], [final], "*", color=color, ms=11)
    by_time.axvline(wall_s, color="gray", ls="--", lw=0.8, label=f"T = {wall_s:.1f} s")
    by_step.set_xlabel("step")
    by_time.set_xlabel("training wall time, s")
    by_step.set_ylabel("val loss (lines: first eval_steps batches; stars: whole split)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_configs(combos: list[str], seeds: list[int], args) -> dict:
    """Every run's config validated before any run starts; the resolved model and pretrain
    sections of each combination returned for the JSON."""
    from gptforge.config.load import load_config
    from gptforge.errors import GptforgeError

    configs = {}
    for combo in combos:
        try:
            cfg = load_config(None, pretrain_overrides(combo, seeds[0], args.steps, args.eval_interval))
        except GptforgeError as e:
            raise BadInput(" ".join(str(e).split())) from None
        configs[combo] = {"model": cfg.model.model_dump(), "pretrain": cfg.pretrain.model_dump()}
    return configs


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--combos", default=",".join(ALL_COMBOS), help="ARCH-OPTIMIZER,... (default: all four)")
    ap.add_argument(
        "--seeds", default=",".join(map(str, DEFAULT_SEEDS)), help="pretrain.seed values (default: %(default)s)"
    )
    ap.add_argument("--steps", type=int, default=None, help="pretrain.max_steps (default: the schema's, 1000)")
    ap.add_argument(
        "--eval-interval", type=int, default=None, help="pretrain.eval_interval (default: the schema's, 100)"
    )
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="tinyshakespeare's input.txt (default: %(default)s)")
    ap.add_argument("--out-json", default=str(ROOT / "docs" / "results" / "recipe_tiny.json"))
    ap.add_argument("--out-png", default=str(ROOT / "docs" / "results" / "recipe_tiny.png"))
    ap.add_argument(
        "--keep", action="store_true", help="keep the work folder (prepared data, each run's folder and log)"
    )
    try:
        args = ap.parse_args(argv)
        combos, seeds = parse_combos(args.combos), parse_seeds(args.seeds)
        for name in ("steps", "eval_interval"):
            if getattr(args, name) is not None and getattr(args, name) <= 0:
                raise BadInput(f"--{name.replace('_', '-')} must be a positive integer")
        data = Path(args.data).expanduser().resolve()
        if not data.is_file():
            raise BadInput(f"no tinyshakespeare at {data}: pass --data PATH to its input.txt")
        if not (BIN / "gptforge").is_file():
            raise BadInput(f"no gptforge command beside {sys.executable}: run with the project's .venv/bin/python")
        configs = check_configs(combos, seeds, args)
    except BadInput as e:
        print(f"bench_recipe: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    load_before = os.getloadavg()[0]  # another process on the cores slows every step: see it in the JSON
    work = Path(tempfile.mkdtemp(prefix="bench_recipe_"))
    keep = args.keep
    try:
        prepared = work / "prepared"
        prepared.mkdir()
        prep_cmd = command(["prepare", "pretrain"], prepare_overrides(data))
        print(f"bench_recipe: preparing the data in {prepared} ...", file=sys.stderr, flush=True)
        code, prep_s = stream(prep_cmd, prepared, prepared / "prepare.log")
        if code != 0:
            keep = True
            raise RuntimeError(f"gptforge prepare pretrain failed (exit {code}):\n{tail(prepared / 'prepare.log')}")
        plan = [(combo, seed) for seed in seeds for combo in combos]
        runs = []
        with tqdm(plan, desc="bench_recipe", unit="run", file=sys.stderr) as bar:
            for combo, seed in bar:
                bar.set_postfix_str(f"{combo} seed {seed}")
                try:
                    runs.append(one_run(work, prepared, combo, seed, args))
                except RuntimeError:
                    keep = True
                    raise
    except RuntimeError as e:
        print(f"bench_recipe: {e}", file=sys.stderr)
        return 1
    finally:
        if keep:
            print(f"bench_recipe: work folder kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    wall_s = fixed_wall_time(runs)
    summary = summarize(runs, wall_s)
    machine = {**describe(), "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]}}
    max_steps = runs[0]["max_steps"]
    result = {
        "benchmark": "recipe_tiny",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
        "data": {
            "source": str(data),
            "sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
            "what": f"tinyshakespeare, GPT-2 BPE, nanoGPT's split (val {VAL_TOKENS:,} tokens)",
            "prepare_s": round(prep_s, 1),
        },
        "commands": [
            shown(prep_cmd),
            shown(
                command(["pretrain"], pretrain_overrides("ARCH-OPTIMIZER", 0, args.steps, args.eval_interval))
            ).replace("pretrain.seed=0", "pretrain.seed=SEED"),
        ],
        "how": "each command in a fresh folder without a params.yaml (the built-in defaults); each run's "
        "data/pretrain a link to the prepared one; runs one after another, seeds in the outer loop",
        "definitions": {
            "val_loss": "evals before the last step: the first eval_steps validation batches (the same batches "
            "each time); the eval after the last step (step max_steps, whole_split): the whole validation split",
            "elapsed_s": "plots/pretrain.csv's train_s: the seconds of the optimizer steps before that eval, "
            "measured by the training loop (evaluations, checkpoints, start-up not counted)",
            "wall_s": "train_s after the last step: the run's training seconds (process_s: the whole command)",
            "step_time_s": "metrics/pretrain.json: tokens / max_steps / tokens_per_sec, the median step "
            "after the first five",
            "fixed_wall_time_s": "T: the smallest of the combinations' median wall_s; val_loss_at_wall_time: "
            "per run its latest eval of the first eval_steps batches with elapsed_s <= T, median over seeds",
            "median": "over the seeds (statistics.median)",
        },
        "seeds": seeds,
        "max_steps": max_steps,
        "fixed_wall_time_s": round(wall_s, 2),
        "config": configs,
        "combos": summary,
        "runs": runs,
    }
    out_json, out_png = Path(args.out_json), Path(args.out_png)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    title = (
        f"tiny config, tinyshakespeare, {max_steps} steps, seeds {','.join(map(str, seeds))}, "
        "median (light: each seed); "
        f"{machine['cpu']}, {machine['cpu_count']} cores, torch {machine['torch']}, fp32"
    )
    plot(runs, summary, wall_s, out_png, title)
    print(
        f"## Pretraining recipes, tiny config ({max_steps} steps, seeds {','.join(map(str, seeds))}, "
        f"medians over seeds; {machine['cpu']}, {machine['cpu_count']} cores, {result['commit']}"
        f"{', uncommitted changes' if result['uncommitted_changes'] else ''})\n"
    )
    print(markdown(summary, wall_s, max_steps))
    print(
        f"\nT = {wall_s:.1f} s: the smallest median training wall time; "
        "val loss at T: each seed's latest eval with elapsed <= T"
    )
    print(f"wrote {out_json} and {out_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
