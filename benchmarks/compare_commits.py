"""Two commits' speed, measured in one run: the code before a change and after it.

    python benchmarks/compare_commits.py --before REV [--after HEAD] [--rounds 2]
        [--benchmarks generate,train_step,serve] [--serve-measures ceiling,levels,hf]
        [--out docs/results/NAME.json]

Each commit is checked out into a git worktree of its own (in a temporary folder, removed at the
end) and runs its own benchmark scripts on its own `src/` (PYTHONPATH; the servers that
bench_serve starts get the worktree's `src/` the same way), in this project's virtual
environment. The sides alternate, before then after, for `--rounds` rounds, so a drift of the
machine's speed falls on both; run it alone on the machine (more busy threads than cores distort
every figure). Prints, and with `--out` writes as JSON and a markdown table, each figure's values
per round on both sides and the ratio of their medians (after / before).

The figures: bench_generate.py (tiny config, batch 1: ours and transformers' tokens/s),
bench_train_step.py (the tiny config's median step) and bench_serve.py's measures (ceiling:
direct generate and the server's step alone; levels: aggregate tokens/s per client count; hf:
gptforge and transformers' server per mode and client count).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

BENCHMARKS = ("generate", "train_step", "serve")


def note(msg: str) -> None:
    print(f"compare_commits [{datetime.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def run_benchmark(tree: Path, name: str, args, scratch: Path) -> dict:
    """One benchmark script of the worktree `tree`, on its own src/; its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    if name == "serve":
        out = scratch / "serve.json"
        cmd = ["bench_serve.py", "--measures", args.serve_measures, "--out", str(out), *args.serve_args]
    elif name == "generate":
        cmd = ["bench_generate.py", *args.generate_args]
    else:
        cmd = ["bench_train_step.py", *args.train_step_args]
    proc = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / cmd[0]), *cmd[1:]], cwd=tree, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"compare_commits: {cmd[0]} failed in {tree.name}: {proc.stderr.strip()[-600:]}")
    if name == "serve":
        return json.loads(out.read_text())
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def figures(name: str, result: dict) -> dict[str, float]:
    """The figures compared, by name, from one benchmark's result."""
    if name == "generate":
        return {
            "generate: ours tok/s (batch 1)": result["ours_tokens_per_sec"],
            "generate: transformers tok/s (batch 1)": result["hf_tokens_per_sec"],
        }
    if name == "train_step":
        return {"train step: median ms": 1000 * result["median_step_s"]}
    out = {}
    for batch, x in (result.get("direct_generate") or {}).items():
        out[f"ceiling: direct generate {batch} tok/s"] = x["tokens_per_sec"]
    for batch, x in (result.get("server_step_alone_ms") or {}).items():
        out[f"ceiling: server step alone {batch} ms"] = x["step_aligned_ms"]
    for level in result.get("levels") or []:
        out[f"levels: {level['clients']} clients tok/s"] = level["aggregate_tokens_per_sec"]
    for server in ("gptforge", "transformers"):
        for level in ((result.get("hf") or {}).get(server) or {}).get("levels", []):
            out[f"hf: {server} {level['mode']} {level['clients']} clients tok/s"] = level["aggregate_tokens_per_sec"]
    return out


def table(rows: dict[str, dict[str, list[float]]], before: str, after: str) -> str:
    lines = [
        f"| figure | before ({before}), per round | after ({after}), per round | after / before (medians) |",
        "|---|---|---|---|",
    ]
    for name, sides in rows.items():
        b, a = sides["before"], sides["after"]
        ratio = statistics.median(a) / statistics.median(b) if a and b else float("nan")
        lines.append(
            f"| {name} | {', '.join(f'{x:.1f}' for x in b)} | {', '.join(f'{x:.1f}' for x in a)} | {ratio:.3f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the commit before the change")
    ap.add_argument("--after", default="HEAD", help="the commit after it")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--benchmarks", default=",".join(BENCHMARKS), help=f"comma-separated, from {', '.join(BENCHMARKS)}")
    ap.add_argument("--serve-measures", default="ceiling,levels,hf")
    ap.add_argument("--out", default=None, help="also write this JSON and a markdown table (.md) beside it")
    # the scripts' own settings, one string each (--generate-args="--repeats 3"): the quick test's small ones
    ap.add_argument("--generate-args", type=shlex.split, default=[])
    ap.add_argument("--train-step-args", type=shlex.split, default=[])
    ap.add_argument("--serve-args", type=shlex.split, default=[])
    args = ap.parse_args()
    chosen = [b for b in args.benchmarks.split(",") if b]
    if unknown := [b for b in chosen if b not in BENCHMARKS]:
        raise SystemExit(
            f"compare_commits: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}"
        )
    commits = {"before": git("rev-parse", args.before), "after": git("rev-parse", args.after)}
    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="compare_commits_") as tmp:
        trees = {side: Path(tmp) / side for side in commits}
        for side, tree in trees.items():
            git("worktree", "add", "--detach", "--force", str(tree), commits[side])
        try:
            for r in range(1, args.rounds + 1):
                for side, tree in trees.items():
                    for name in chosen:
                        note(f"round {r}, {side} ({commits[side][:7]}): {name}")
                        result = run_benchmark(tree, name, args, Path(tmp))
                        for figure, value in figures(name, result).items():
                            rows.setdefault(figure, {"before": [], "after": []})[side].append(value)
        finally:
            for tree in trees.values():
                git("worktree", "remove", "--force", str(tree))
    md = table(rows, commits["before"][:7], commits["after"][:7])
    result = {
        "benchmark": "compare_commits",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": describe(),
        "commits": commits,
        "rounds": args.rounds,
        "benchmarks": chosen,
        "serve_measures": args.serve_measures if "serve" in chosen else None,
        "figures": rows,
        "command": "python benchmarks/compare_commits.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(result, indent=1))
    print(md, file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
