"""`gptforge prepare pretrain` against a build-nanogpt-style tokenizing pool, whole processes.

    python benchmarks/bench_tokenize.py [--mb 100] [--repeats 5] [--prefect on|off|both]
                                        [--max-noise 0.15] [--corpus FILE.jsonl] [--out docs/results/tokenize_cpu]

Builds a JSONL file of `--mb` MB of FineWeb-Edu-like records (`{"text": ..., "id": ...}`): the
lines of the FineWeb-Edu sample in ../shared/data (or, without it, seeded pseudo-English),
grouped in order into documents of 500 to 8,000 characters (seeded; about 4.3 KB on average,
near FineWeb-Edu's ~1,000 GPT-2 tokens a document) and repeated to the size. Then, in rounds
(one unmeasured warm-up round, then `--repeats`), each case as a whole process, python start to
exit, reading the JSONL itself:

- pool: build-nanogpt's fineweb.py: `multiprocessing.Pool(os.cpu_count() // 2)`,
  `pool.imap(tokenize, docs, chunksize=16)`, each document `[EOT] + enc.encode_ordinary(text)`
  into a uint16 array, written to `.npy` shards of `--shard-tokens` (the first one val);
  tiktoken's gpt2 built from the GPT-2 files the package embeds (no download);
- stage: `python -m gptforge.cli prepare pretrain -S data.pretrain.source=FILE` with tracking
  off, with Prefect on (its flow run through its journal and the folder's recorder, which the
  warm-up round starts, as any earlier gptforge command in a clone does; the recorder's own
  Prefect server, PREFECT_HOME in the temporary folder; each run waits for its records to be
  delivered before the next starts) and/or off (GPTFORGE_PREFECT=0), the pool's shard
  size, params.yaml's val split (20,000 tokens), max_tokens above the file's tokens;
- loop: `tokenize_to_shards` in this process (read, tokenize, write shards; no imports, config
  or manifest), to separate the stage's fixed costs from its loop.

The figures are medians (with min-max) of tokens/s = the file's tokens / wall seconds, with
each case's CPU seconds (its process and children). The shards of the stage and the pool are
checked to hold the same tokens. A round during which other processes on the machine used more
than `--max-noise` cores (from /proc/stat, less this benchmark's own CPU) is run again, up to
`--max-redo` times; the output says how many were, and how much CPU others used in all. (The
CPU of descendants this process does not reap counts as others': code that tokenizes in a
forkserver's workers, as this stage did before, needs `--max-noise 99` and a machine known
to be quiet.) The last lines give the
acceptance figures (issue: at least 2.0 M tokens/s and at least 1.5x the pool, whole processes,
one run) for each Prefect setting measured. `--out PATH` also writes PATH.md and PATH.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's gptforge, also in the child processes
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_startup import delivered, stop_recorder, without_servers  # noqa: E402
from machine import cpu_model  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
POOL_SCRIPT = '''
"""build-nanogpt's fineweb.py, reading a local JSONL (its loop, shard writing and progress bar)."""
import json, multiprocessing as mp, os, sys
import numpy as np
import tiktoken, tiktoken.load
from tqdm import tqdm

src, out_dir, tok_dir, shard_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
os.makedirs(out_dir, exist_ok=True)
# tiktoken.get_encoding("gpt2"), built from the same files (this machine may have no network)
enc = tiktoken.Encoding(
    name="gpt2", pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+""",
    mergeable_ranks=tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=os.path.join(tok_dir, "vocab.bpe"), encoder_json_file=os.path.join(tok_dir, "encoder.json")),
    special_tokens={"<|endoftext|>": 50256})
eot = enc._special_tokens["<|endoftext|>"]

def tokenize(doc):
    tokens = [eot]
    tokens.extend(enc.encode_ordinary(doc["text"]))
    tokens_np = np.array(tokens)
    assert (0 <= tokens_np).all() and (tokens_np < 2**16).all(), "token dictionary too large for uint16"
    return tokens_np.astype(np.uint16)

def docs():
    with open(src, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)

def write_datafile(filename, tokens_np):
    np.save(filename, tokens_np)

if __name__ == "__main__":
    nprocs = max(1, os.cpu_count() // 2)
    with mp.Pool(nprocs) as pool:
        shard_index = 0
        all_tokens_np = np.empty((shard_size,), dtype=np.uint16)
        token_count = 0
        progress_bar = None
        for tokens in pool.imap(tokenize, docs(), chunksize=16):
            if token_count + len(tokens) < shard_size:
                all_tokens_np[token_count:token_count + len(tokens)] = tokens
                token_count += len(tokens)
                if progress_bar is None:
                    progress_bar = tqdm(total=shard_size, unit="tokens", desc=f"Shard {shard_index}")
                progress_bar.update(len(tokens))
            else:
                split = "val" if shard_index == 0 else "train"
                filename = os.path.join(out_dir, f"fineweb_{split}_{shard_index:06d}")
                remainder = shard_size - token_count
                progress_bar.update(remainder)
                all_tokens_np[token_count:token_count + remainder] = tokens[:remainder]
                write_datafile(filename, all_tokens_np)
                shard_index += 1
                progress_bar = None
                all_tokens_np[0:len(tokens) - remainder] = tokens[remainder:]
                token_count = len(tokens) - remainder
        if token_count != 0:
            split = "val" if shard_index == 0 else "train"
            filename = os.path.join(out_dir, f"fineweb_{split}_{shard_index:06d}")
            write_datafile(filename, all_tokens_np[:token_count])
'''

WORDS = [
    "the",
    "model",
    "learns",
    "from",
    "data",
    "and",
    "tokens",
    "of",
    "text",
    "in",
    "a",
    "language",
    "training",
    "loss",
    "is",
    "computed",
    "over",
    "batches",
    "gradient",
    "step",
    "students",
    "energy",
    "history",
    "water",
    "cells",
    "research",
    "children",
    "science",
    "(1998)",
    "3.5%",
    "naïve",
    "café",
]


def source_lines(seed: int) -> tuple[list[str], str]:
    sample = SHARED / "fineweb_edu" / "fineweb_sample.txt"
    if sample.is_file():
        lines = [line for line in sample.read_text(encoding="utf-8").split("\n") if line]
        return lines, f"lines of {sample}"
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))).capitalize() + "." for _ in range(4000)]
    return lines, "seeded pseudo-English (no FineWeb-Edu sample found)"


def make_jsonl(path: Path, mb: float, seed: int = 0) -> dict:
    """Documents of consecutive source lines (500-8,000 characters each), repeated to `mb` MB."""
    lines, what = source_lines(seed)
    rng = random.Random(seed)
    target, written, i, n = int(mb * 1_000_000), 0, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            want, doc, size = rng.randint(500, 8000), [], 0
            while size < want:
                line = lines[i % len(lines)]
                doc.append(line)
                size += len(line) + 1
                i += 1
            record = json.dumps({"text": "\n".join(doc), "id": f"doc-{n:07d}"}, ensure_ascii=False) + "\n"
            f.write(record)
            written += len(record.encode("utf-8"))
            n += 1
    return {"source": what, "documents": n, "bytes": written}


def busy_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (all processes; /proc/stat), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in (fields + ["0"] * 8)[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    """CPU seconds of this process and its finished children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, float]:
    """Wall seconds and CPU seconds (the process and its children) of one command."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(
            f"bench_tokenize: {' '.join(cmd)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return seconds, (after.ru_utime + after.ru_stime) - (kids.ru_utime + kids.ru_stime)


def read_shards(folder: Path, names: list[str]) -> np.ndarray:
    return np.concatenate([np.load(folder / name) for name in names])


def summary(times: list[float], tokens: int, cpu: list[float] | None = None) -> dict:
    rates = [tokens / t for t in times]
    out = {
        "median_s": round(statistics.median(times), 3),
        "runs_s": [round(t, 3) for t in times],
        "median_tokens_per_sec": round(statistics.median(rates)),
        "min_tokens_per_sec": round(min(rates)),
        "max_tokens_per_sec": round(max(rates)),
    }
    if cpu:
        out["median_cpu_s"] = round(statistics.median(cpu), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100, help="size of the JSONL file to build")
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds, after one warm-up round")
    ap.add_argument(
        "--prefect",
        choices=("on", "off", "both"),
        default="on",
        help="the stage with Prefect on (the default), off (GPTFORGE_PREFECT=0), or both",
    )
    ap.add_argument("--shard-tokens", type=int, default=10_000_000, help="shard size of both")
    ap.add_argument("--val-tokens", type=int, default=20_000, help="the stage's val split (params.yaml's)")
    ap.add_argument("--workers", type=int, default=0, help="data.pretrain.workers of the stage (0: one per core)")
    ap.add_argument(
        "--max-noise",
        type=float,
        default=0.15,
        help="run a round again when other processes used more than this many cores during it",
    )
    ap.add_argument("--max-redo", type=int, default=20, help="at most this many rounds run again for noise")
    ap.add_argument("--no-loop", action="store_true", help="skip the in-process tokenize_to_shards timing")
    ap.add_argument("--corpus", type=Path, default=None, help="use this JSONL (a 'text' field) instead of building one")
    ap.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="also time the stage of another checkout's src/ (e.g. a worktree of an older commit), Prefect off",
    )
    ap.add_argument("--out", default=None, help="also write OUT.md and OUT.json")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")

    from gptforge import samples
    from gptforge.data.pretrain import find_corpus, tokenize_to_shards

    tok_dir = samples.resolve("sample://gpt2_tokenizer")
    modes = {"on": ["on"], "off": ["off"], "both": ["on", "off"]}[args.prefect]
    with tempfile.TemporaryDirectory(prefix="bench_tokenize_") as tmp:
        tmp = Path(tmp)
        if args.corpus:
            corpus_path, built = args.corpus.resolve(), {"source": str(args.corpus)}
        else:
            corpus_path = tmp / "fineweb_like.jsonl"
            print(f"bench_tokenize: building {args.mb:g} MB of JSONL ...", file=sys.stderr, flush=True)
            built = make_jsonl(corpus_path, args.mb)
        pool_script = tmp / "fineweb_pool.py"
        pool_script.write_text(POOL_SCRIPT, encoding="utf-8")
        env = without_servers(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(
                [str(ROOT / "src"), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
            ),
            PREFECT_HOME=str(tmp / "prefect-home"),
            DO_NOT_TRACK="1",
        )
        envs = {"on": env, "off": {**env, "GPTFORGE_PREFECT": "0"}}
        work = tmp / "work"  # the stage's folder: data/pretrain, metrics/ (no params.yaml: -S only)
        work.mkdir()
        stage_cmd = [
            sys.executable,
            "-m",
            "gptforge.cli",
            "prepare",
            "pretrain",
            "-S",
            f"data.pretrain.source={corpus_path}",
            "-S",
            "tracking.enabled=false",
            "-S",
            "tokenizer.path=sample://gpt2_tokenizer",
            "-S",
            "data.pretrain.max_tokens=1000000000000",
            "-S",
            f"data.pretrain.shard_tokens={args.shard_tokens}",
            "-S",
            f"data.pretrain.val_tokens={args.val_tokens}",
            "-S",
            f"data.pretrain.workers={args.workers}",
        ]
        pool_out = tmp / "pool_out"
        pool_cmd = [sys.executable, str(pool_script), str(corpus_path), str(pool_out), tok_dir, str(args.shard_tokens)]
        corpus = find_corpus(str(corpus_path), name=None, split="train", text_field="text", param="--corpus")

        corpus_mb = round(corpus_path.stat().st_size / 1e6, 1)
        baseline = "stage_baseline_prefect_off"
        env_baseline = None
        if args.baseline_src:
            env_baseline = {
                **envs["off"],
                "PYTHONPATH": f"{args.baseline_src.resolve()}{os.pathsep}{env['PYTHONPATH']}",
            }
            (tmp / "work_baseline").mkdir()
        times: dict[str, list[float]] = {"pool": [], **{f"stage_prefect_{m}": [] for m in modes}, "loop": []}
        if env_baseline:
            times[baseline] = []
        cpus: dict[str, list[float]] = {name: [] for name in times}
        inner: dict[str, list[float]] = {f"stage_prefect_{m}": [] for m in modes}  # the manifest's seconds
        tokens = None
        busy0, own0, t_start = busy_seconds(), own_cpu(), time.perf_counter()
        round_, redone = 0, 0
        while round_ <= args.repeats:
            label = "warm-up round" if round_ == 0 else f"round {round_}/{args.repeats}"
            print(f"bench_tokenize: {label} ...", file=sys.stderr, flush=True)
            seconds, cpu, in_stage = {}, {}, {}
            r_busy, r_own, r_t = busy_seconds(), own_cpu(), time.perf_counter()
            seconds["pool"], cpu["pool"] = timed(pool_cmd, tmp, env)
            pool_files = sorted((p.name for p in pool_out.glob("*.npy")), key=lambda n: n.rsplit("_", 1)[1])
            for m in modes:
                seconds[f"stage_prefect_{m}"], cpu[f"stage_prefect_{m}"] = timed(stage_cmd, work, envs[m])
                delivered(work)  # the recorder's delivery, before the next timed run
                manifest = json.loads((work / "data/pretrain/manifest.json").read_text())
                if tokens is None:  # the same tokens as the pool, once
                    ours = read_shards(work / "data/pretrain", [s["file"] for s in manifest["shards"]])
                    theirs = read_shards(pool_out, pool_files)
                    if not np.array_equal(ours, theirs):
                        raise SystemExit(
                            f"bench_tokenize: the stage's {ours.size} tokens differ from the pool's {theirs.size}"
                        )
                    tokens = int(ours.size)
                if manifest["tokens"]["val"] + manifest["tokens"]["train"] != tokens:
                    raise SystemExit("bench_tokenize: the stage wrote a different number of tokens")
                in_stage[f"stage_prefect_{m}"] = manifest["seconds"]
            if env_baseline:
                seconds[baseline], cpu[baseline] = timed(stage_cmd, tmp / "work_baseline", env_baseline)
                old = json.loads((tmp / "work_baseline/data/pretrain/manifest.json").read_text())
                if read_shards(tmp / "work_baseline/data/pretrain", [x["file"] for x in old["shards"]]).size != tokens:
                    raise SystemExit("bench_tokenize: the baseline stage wrote a different number of tokens")
            if not args.no_loop:
                out = tmp / "loop_out"
                out.mkdir()
                t0, c0 = time.perf_counter(), time.process_time()
                stats = tokenize_to_shards(
                    corpus,
                    out,
                    tokenizer_path=tok_dir,
                    max_tokens=10**12,
                    shard_tokens=args.shard_tokens,
                    val_tokens=args.val_tokens,
                    workers=args.workers,
                )
                seconds["loop"], cpu["loop"] = time.perf_counter() - t0, time.process_time() - c0
                assert stats.total_tokens == tokens
                for f in out.iterdir():
                    f.unlink()
                out.rmdir()
            # Other processes' CPU during the round, in cores: another job on the machine shows here.
            noise = (
                None
                if r_busy is None
                else max(0.0, (busy_seconds() - r_busy) - (own_cpu() - r_own)) / (time.perf_counter() - r_t)
            )
            print(
                "  "
                + ", ".join(f"{k} {v:.2f} s (cpu {cpu[k]:.2f} s)" for k, v in seconds.items())
                + ("" if noise is None else f"; other processes: {noise:.2f} cores"),
                file=sys.stderr,
                flush=True,
            )
            if round_ and noise is not None and noise > args.max_noise and redone < args.max_redo:
                redone += 1
                print(f"  a noisy round (above --max-noise {args.max_noise}): run again", file=sys.stderr, flush=True)
                continue
            if round_:
                for name, x in seconds.items():
                    times[name].append(x)
                    cpus[name].append(cpu[name])
                for name, x in in_stage.items():
                    inner[name].append(x)
            round_ += 1
        busy1, own1, wall = busy_seconds(), own_cpu(), time.perf_counter() - t_start
        stop_recorder(work)
        if args.no_loop:
            del times["loop"]
    # CPU that other processes on the machine used while this ran: a noisy run shows here.
    others = None if busy0 is None else max(0.0, (busy1 - busy0) - (own1 - own0))
    cases = {name: summary(t, tokens, cpus[name]) for name, t in times.items()}
    for name, secs in inner.items():
        cases[name]["loop_in_stage"] = summary(secs, tokens)
    pool_rate = cases["pool"]["median_tokens_per_sec"]
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    result = {
        "benchmark": "tokenize",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "processor": cpu_model(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "commit": git("rev-parse", "--short", "HEAD")
        + ("+uncommitted changes" if git("status", "--porcelain") else ""),
        "corpus": {**built, "mb": corpus_mb, "tokens": tokens},
        "other_processes_cpu_s": None if others is None else round(others, 1),
        "bench_wall_s": round(wall, 1),
        "rounds_run_again_for_noise": redone,
        "max_noise_cores": args.max_noise,
        "repeats": args.repeats,
        "shard_tokens": args.shard_tokens,
        "val_tokens": args.val_tokens,
        "workers": args.workers,
        "pool_processes": max(1, (os.cpu_count() or 2) // 2),
        "cases": cases,
        "acceptance": {
            m: {
                "tokens_per_sec": cases[f"stage_prefect_{m}"]["median_tokens_per_sec"],
                "over_pool": round(cases[f"stage_prefect_{m}"]["median_tokens_per_sec"] / pool_rate, 2),
            }
            for m in modes
        },
    }
    if env_baseline:
        result["baseline_src"] = str(args.baseline_src)
        for m in modes:
            result["acceptance"][m]["over_baseline"] = round(
                cases[f"stage_prefect_{m}"]["median_tokens_per_sec"] / cases[baseline]["median_tokens_per_sec"], 2
            )
    lines = report_lines(result)
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        command = "python benchmarks/bench_tokenize.py " + " ".join(sys.argv[1:])
        md = [
            f"# bench_tokenize ({result['machine']['processor']}, {result['machine']['cpu_count']} cores, "
            f"{result['date'][:10]})",
            "",
            f"`{command}` at {result['commit']}, its output:",
            "",
            "```",
            *lines,
            "```",
            "",
        ]
        out.with_suffix(".md").write_text("\n".join(md), encoding="utf-8")
    return 0


def report_lines(r: dict) -> list[str]:
    c, m = r["cases"], r["machine"]
    M = lambda x: f"{x / 1e6:5.2f} M tokens/s"  # noqa: E731
    corpus = r["corpus"]
    lines = [
        f"corpus: {corpus.get('mb')} MB JSONL, {corpus.get('documents', '?')} documents, {corpus['tokens']:,} "
        f"GPT-2 tokens ({corpus['source']})",
        f"machine: {m['processor']}, {m['cpu_count']} cores, Python {m['python']}; {r['date']}",
        f"whole processes (python start to exit), medians of {r['repeats']} after a warm-up round (min-max):",
    ]
    names = {
        "pool": f"pool: build-nanogpt fineweb.py, Pool({r['pool_processes']}), imap chunksize=16",
        "stage_prefect_on": "gptforge prepare pretrain, Prefect on",
        "stage_prefect_off": "gptforge prepare pretrain, GPTFORGE_PREFECT=0",
        "loop": "tokenize_to_shards, in the benchmark's process",
        "stage_baseline_prefect_off": f"the stage of {r.get('baseline_src', '')}, GPTFORGE_PREFECT=0",
    }
    pool = c["pool"]["median_tokens_per_sec"]
    for key in ("pool", "stage_prefect_on", "stage_prefect_off", "stage_baseline_prefect_off"):
        if key in c:
            x = c[key]
            lines.append(
                f"  {names[key]:<62} {x['median_s']:6.2f} s  {M(x['median_tokens_per_sec'])} "
                f"({x['min_tokens_per_sec'] / 1e6:.2f}-{x['max_tokens_per_sec'] / 1e6:.2f})  "
                f"{x['median_tokens_per_sec'] / pool:4.2f}x pool  cpu {x['median_cpu_s']:5.2f} s"
            )
    lines.append("the tokenizing loop alone (read, tokenize, write shards):")
    loops = {
        "stage_prefect_on": "in those stage runs (manifest's seconds), Prefect on",
        "stage_prefect_off": "in those stage runs (manifest's seconds), GPTFORGE_PREFECT=0",
    }
    for key in ("stage_prefect_on", "stage_prefect_off"):
        if key in c:
            x = c[key]["loop_in_stage"]
            lines.append(
                f"  {loops[key]:<62} {x['median_s']:6.2f} s  "
                f"{M(x['median_tokens_per_sec'])}  {x['median_tokens_per_sec'] / pool:4.2f}x pool"
            )
    if "loop" in c:
        x = c["loop"]
        lines.append(
            f"  {names['loop']:<62} {x['median_s']:6.2f} s  {M(x['median_tokens_per_sec'])}  "
            f"{x['median_tokens_per_sec'] / pool:4.2f}x pool  cpu {x['median_cpu_s']:5.2f} s"
        )
    if r["other_processes_cpu_s"] is not None:
        lines.append(
            f"other processes on the machine used {r['other_processes_cpu_s']:.1f} CPU s during the "
            f"{r['bench_wall_s']:.0f} s of the benchmark (near 0: a quiet machine); "
            f"{r['rounds_run_again_for_noise']} round(s) run again for using over "
            f"{r['max_noise_cores']} cores"
        )
    for mode, a in r["acceptance"].items():
        label = "Prefect on" if mode == "on" else "GPTFORGE_PREFECT=0"
        lines.append(
            f"ACCEPTANCE ({label}) throughput: {a['tokens_per_sec'] / 1e6:.2f} M tokens/s, needs >= 2.0: "
            f"{'PASS' if a['tokens_per_sec'] >= 2.0e6 else 'FAIL'}"
        )
        lines.append(
            f"ACCEPTANCE ({label}) vs the pool: {a['over_pool']:.2f}x, needs >= 1.5x: "
            f"{'PASS' if a['over_pool'] >= 1.5 else 'FAIL'}"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
