"""How much of `make run` is orchestration: the quickstart pipeline on a fresh clone, split into
the stages' own work and everything around it.

    python benchmarks/bench_make_run.py [--out FILE.json]

Clones this repository (its committed state) into a temporary folder and runs what `make run`
runs after its install, `gptforge pipeline`, with no servers configured (MLflow's SQLite store
in the clone, the recorder's own Prefect server, PREFECT_HOME in the temporary folder), timing
the whole command. Each stage's own work is read from its journal (docs/records.md): from its
`open` record (the stage process has started, parsed its arguments, loaded and checked its
config) to its `close` (its recipe returned and its outputs are written). Orchestration is the
rest of the wall time: Python and library start-up of every stage process, dvc, the pipeline's
own Prefect flow run and MLflow run, the recorder's start and its Prefect server, and what
the pipeline waits for. The recorder's delivery after the command returned is reported apart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_startup import delivered, fresh_clone, stop_recorder  # noqa: E402
from machine import cpu_model  # noqa: E402


def stage_spans(clone: Path) -> dict[str, float]:
    """Stage -> seconds from its journal's `open` to its `close` (a stage run twice: summed); the
    pipeline's own journal (its flow run) spans the whole run and is left out."""
    spans: dict[str, float] = {}
    for path in sorted((clone / ".gptforge" / "records" / "delivered").glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        opened = next(r for r in records if r["kind"] == "open")
        closed = next((r for r in records if r["kind"] == "close"), None)
        if closed is not None and opened["stage"] != "pipeline":  # the pipeline's own journal: the whole run
            spans[opened["stage"]] = spans.get(opened["stage"], 0.0) + closed["time"] - opened["time"]
    return spans


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the figures as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_make_run_") as tmp:
        tmp = Path(tmp)
        clone, env = fresh_clone(tmp)
        print("bench_make_run: gptforge pipeline on a fresh clone ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(
            [str(BIN / "gptforge"), "pipeline"], cwd=clone, env=env, capture_output=True, text=True, timeout=3600
        )
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(
                f"bench_make_run: the pipeline failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}"
            )
        after = delivered(clone)
        spans = stage_spans(clone)
        stop_recorder(clone)
    work = sum(spans.values())
    result = {
        "benchmark": "make_run",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"processor": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "pipeline_s": round(wall, 1),
        "stages_work_s": {k: round(v, 1) for k, v in spans.items()},
        "work_s": round(work, 1),
        "orchestration_s": round(wall - work, 1),
        "orchestration_share": round((wall - work) / wall, 3),
        "records_delivered_after_s": round(after, 1),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(
        f"gptforge pipeline on a fresh clone ({result['machine']['processor']}, {result['machine']['cpu_count']} "
        f"cores, {result['date']}, {result['commit']}):"
    )
    for stage, seconds in spans.items():
        print(f"  {stage:<22} {seconds:7.1f} s of its own work")
    print(f"  {'stages, in all':<22} {work:7.1f} s")
    print(f"orchestration (everything else): {wall - work:.1f} s of {wall:.1f} s = {100 * (wall - work) / wall:.1f}%")
    print(f"the recorder delivered the last records {after:.1f} s after the pipeline returned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
