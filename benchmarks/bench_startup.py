"""What a stage's orchestration costs: the data stage prepare_classify as a user types it, with
tracking and Prefect on and with both off, and inside `gptforge pipeline`.

    python benchmarks/bench_startup.py [--repeats 5] [--pipeline-repeats 3] [--out FILE.json]

On a fresh clone of this repository in a temporary folder (its committed state, the embedded
SMS sample), with no servers configured (no PREFECT_API_URL, no MLFLOW_TRACKING_URI: MLflow's
SQLite store in the clone, the recorder's own Prefect server, PREFECT_HOME in the temporary
folder), each case runs once unmeasured (first-use costs: migrations, caches, the recorder's
start) and then `--repeats` times; the figure is the median wall time of the whole process.
A stage's records are delivered by the folder's recorder after the command returns
(docs/records.md): each run waits for that before the next starts, so no timed run shares the
machine with a delivery, and the delay from the command's end to its records' delivery is
reported too:

- on:  `dvc repro -f -s prepare_classify`, tracking.enabled true, Prefect on (what a user gets);
- off: the same with tracking.enabled false and GPTFORGE_PREFECT=0;
- tracking only / Prefect only: one of the two on, to split their costs;
- the command alone (both off): `gptforge prepare classify` without dvc;
- `python -c pass` and `python -c "import gptforge.cli, gptforge.pipeline.stages, gptforge.data.classify"`;
- inside the pipeline: `gptforge pipeline prepare_classify --force` (tracking and Prefect on),
  the stage's own duration as the pipeline reports it ("prepare_classify ran in X s").

The breakdown is made of differences between those medians (python start, library imports, the
work, dvc, tracking set-up, Prefect), so its parts are measured, not estimated. The last two
lines are the typed case's two medians.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_model  # noqa: E402

# Hugging Face Hub offline for the runs here and in bench_make_run and bench_tokenize (which import this
# module), as when cpu_model was imported from bench_serve, whose bench_generate sets it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(
            f"bench_startup: {' '.join(cmd)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return seconds, done


def delivered(cwd: Path, timeout: float = 300.0) -> float:
    """Seconds until the recorder has delivered every journal of `cwd` (0 when there is none)."""
    t0 = time.perf_counter()
    while list((cwd / ".gptforge" / "records").glob("*.jsonl")):
        if time.perf_counter() - t0 > timeout:
            raise SystemExit(
                f"bench_startup: journals not delivered within {timeout:.0f} s "
                f"(see {cwd}/.gptforge/recorder/recorder.log)"
            )
        time.sleep(0.02)
    return time.perf_counter() - t0


def median_of(cmd: list[str], cwd: Path, env: dict, repeats: int) -> dict:
    timed(cmd, cwd, env)  # once unmeasured: first-use costs
    delivered(cwd)
    times, latency = [], []
    for _ in range(repeats):
        times.append(timed(cmd, cwd, env)[0])
        latency.append(delivered(cwd))
    out = {"median_s": round(statistics.median(times), 3), "runs_s": [round(t, 3) for t in times]}
    if any(latency):
        out["records_delivered_after_s"] = round(statistics.median(latency), 3)
    return out


def stop_recorder(cwd: Path) -> None:
    """The clone's recorder (and its Prefect server) leaves with the benchmark."""
    state = cwd / ".gptforge" / "recorder" / "state.json"
    if state.is_file():
        pid = json.loads(state.read_text())["pid"]
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        for _ in range(300):
            if not state.exists():
                break
            time.sleep(0.1)


# What points a process at servers or makes it wait for its records: a user with nothing configured.
SERVER_VARS = (
    "PREFECT_API_URL",
    "MLFLOW_TRACKING_URI",
    "GPTFORGE_PREFECT",
    "PREFECT_HOME",
    "GPTFORGE_WAIT_FOR_RECORDS",
)


def without_servers(environ) -> dict[str, str]:
    """`environ` less SERVER_VARS."""
    return {k: v for k, v in environ.items() if k not in SERVER_VARS}


def fresh_clone(tmp: Path) -> tuple[Path, dict]:
    """A clone of this repository's committed state in `tmp`, and the environment of a user with
    no servers configured (no PREFECT_API_URL, no MLFLOW_TRACKING_URI, PREFECT_HOME in `tmp`)."""
    clone = tmp / "gptforge"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    env = without_servers(os.environ)
    env.update(
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        PREFECT_HOME=str(tmp / "prefect-home"),
        DVC_NO_ANALYTICS="1",
        DO_NOT_TRACK="1",
    )
    return clone, env


def set_tracking(clone: Path, enabled: bool) -> None:
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["tracking"]["enabled"] = enabled
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pipeline-repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the figures as JSON")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        tmp = Path(tmp)
        clone, base_env = fresh_clone(tmp)
        no_prefect = {**base_env, "GPTFORGE_PREFECT": "0"}
        dvc = [str(BIN / "dvc"), "repro", "-f", "-s", "prepare_classify"]
        command = [str(BIN / "gptforge"), "prepare", "classify"]
        py = sys.executable
        cases: dict[str, dict] = {}

        set_tracking(clone, True)
        print("bench_startup: dvc repro, tracking and Prefect on ...", file=sys.stderr, flush=True)
        cases["on"] = median_of(dvc, clone, base_env, args.repeats)
        cases["tracking_only"] = median_of(dvc, clone, no_prefect, args.repeats)
        set_tracking(clone, False)
        print("bench_startup: dvc repro, both off ...", file=sys.stderr, flush=True)
        cases["off"] = median_of(dvc, clone, no_prefect, args.repeats)
        cases["prefect_only"] = median_of(dvc, clone, base_env, args.repeats)
        cases["command_off"] = median_of(command, clone, no_prefect, args.repeats)
        cases["python"] = median_of([py, "-c", "pass"], clone, no_prefect, args.repeats)
        cases["imports"] = median_of(
            [py, "-c", "import gptforge.cli, gptforge.pipeline.stages, gptforge.data.classify"],
            clone,
            no_prefect,
            args.repeats,
        )

        set_tracking(clone, True)
        print("bench_startup: gptforge pipeline prepare_classify --force ...", file=sys.stderr, flush=True)
        inside, whole = [], []
        pipeline = [str(BIN / "gptforge"), "pipeline", "prepare_classify", "--force", "--no-pull", "--no-push"]
        for i in range(args.pipeline_repeats + 1):
            seconds, done = timed(pipeline, clone, base_env)
            found = re.search(r"prepare_classify\s+ran in ([0-9.]+) s", done.stdout + done.stderr)
            if not found:
                raise SystemExit(
                    "bench_startup: the pipeline did not report prepare_classify's duration:\n"
                    + (done.stdout + done.stderr)[-3000:]
                )
            if i:  # the first run is unmeasured, as for the other cases
                inside.append(float(found.group(1)))
                whole.append(seconds)
            delivered(clone)
        stop_recorder(clone)
        cases["inside_pipeline"] = {
            "median_s": round(statistics.median(inside), 3),
            "runs_s": inside,
            "pipeline_median_s": round(statistics.median(whole), 3),
        }

    m = {name: case["median_s"] for name, case in cases.items()}
    breakdown = {
        "python start": m["python"],
        "library imports (cli, stage table, the stage's module)": m["imports"] - m["python"],
        "the stage's work (and its own imports)": m["command_off"] - m["imports"],
        "dvc repro around it": m["off"] - m["command_off"],
        "tracking (the MLflow run, journaled)": m["tracking_only"] - m["off"],
        "Prefect (the flow and task runs, journaled)": m["prefect_only"] - m["off"],
    }
    result = {
        "benchmark": "startup",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": cpu_model(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "repeats": args.repeats,
        "cases": cases,
        "breakdown_s": {k: round(v, 3) for k, v in breakdown.items()},
        "on_over_off": round(m["on"] / m["off"], 2),
        "inside_pipeline_over_off": round(m["inside_pipeline"] / m["off"], 2),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(
        f"prepare_classify, medians of {args.repeats} runs ({result['machine']['processor']}, "
        f"{result['machine']['cpu_count']} cores, {result['date']}):"
    )
    for name in ("on", "tracking_only", "prefect_only", "off", "command_off", "imports", "python"):
        print(f"  {name:<16} {m[name]:7.2f} s")
    print(
        f"  inside the pipeline (its report): {m['inside_pipeline']:.2f} s "
        f"({result['inside_pipeline_over_off']}x off; "
        f"the pipeline run: {cases['inside_pipeline']['pipeline_median_s']:.1f} s)"
    )
    print("breakdown of the typed case with both on:")
    for name, seconds in breakdown.items():
        print(f"  {name:<58} {seconds:6.2f} s")
    print(
        f"records delivered by the recorder (median, after the command returned): "
        f"{cases['on'].get('records_delivered_after_s', 0):.2f} s with both on"
    )
    print(f"median with tracking and Prefect on: {m['on']:.2f} s")
    print(f"median with both off: {m['off']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
