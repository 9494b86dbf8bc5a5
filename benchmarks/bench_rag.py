"""The retrieval index at size: build time and query latency of BM25 over 10,000 chunks.

    python benchmarks/bench_rag.py [--chunks 10000] [--words 150] [--queries 200] [--k 4]
        [--rounds 5] [--out docs/results/rag_bm25_cpu.json]

The chunks are windows of `--words` words (150, about 200 GPT-2 tokens) over the FineWeb-Edu
sample the project carries, one starting every len(text) / `--chunks` words, so there are exactly
`--chunks` of them and they overlap (a corpus of realistic chunk length). The queries are
12-word spans taken at random from the text (a fixed seed).

Measured, in this one process, after a warm-up pass over the queries:
- gptforge's index (`gptforge.rag.index.build` and `Index.search`: bm25s with our terms): the
  build (terms, BM25 matrix, saving the folder), and per-query latency (terms + retrieval of the
  top k): median and p95 per round, the median of the rounds' medians reported;
- the alternative a user would pick, rank_bm25's BM25Okapi with the same terms (`get_top_n`),
  when it is installed (`pip install rank-bm25`; not a gptforge dependency); it scores every
  chunk for every query. Not installed: the script says so and reports ours alone.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def make_chunks(n: int, words: int):
    from gptforge.synthesize.chunks import Chunk

    text = gzip.open(REPO / "src/gptforge/samples/fineweb_edu_sample.txt.gz", "rt", encoding="utf-8").read().split()
    stride = max(1, (len(text) - words) // n)
    chunks = []
    for i in range(n):
        body = " ".join(text[i * stride : i * stride + words])
        chunks.append(
            Chunk(id=f"fineweb#{i}", source="fineweb", headings=(), start=0, end=len(body), text=body, tokens=words)
        )
    return chunks, text


def latencies(search, queries, rounds: int) -> dict:
    for q in queries:  # warm-up
        search(q)
    medians, p95s = [], []
    for _ in range(rounds):
        times = []
        for q in queries:
            t0 = time.perf_counter()
            search(q)
            times.append(time.perf_counter() - t0)
        times.sort()
        medians.append(statistics.median(times))
        p95s.append(times[int(0.95 * (len(times) - 1))])
    return {
        "p50_ms": 1000 * statistics.median(medians),
        "p95_ms": 1000 * statistics.median(p95s),
        "p50_ms_rounds": [round(1000 * m, 4) for m in medians],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=10_000)
    ap.add_argument("--words", type=int, default=150)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from gptforge.rag.index import build
    from gptforge.rag.terms import terms

    chunks, words = make_chunks(args.chunks, args.words)
    rng = random.Random(0)
    queries = []
    for _ in range(args.queries):
        start = rng.randrange(len(words) - 12)
        queries.append(" ".join(words[start : start + 12]))

    result: dict = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "chunks": len(chunks),
        "words_per_chunk": args.words,
        "queries": len(queries),
        "k": args.k,
        "rounds": args.rounds,
    }
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        idx = build(chunks, Path(tmp) / "index", name="bench", chunks_sha256="bench")
        result["gptforge_build_s"] = time.perf_counter() - t0
        result["gptforge"] = latencies(lambda q: idx.search(q, args.k), queries, args.rounds)
    say(
        f"gptforge (bm25s): build {result['gptforge_build_s']:.2f} s; query p50 {result['gptforge']['p50_ms']:.3f} ms, "
        f"p95 {result['gptforge']['p95_ms']:.3f} ms over {len(chunks):,} chunks"
    )
    try:
        from rank_bm25 import BM25Okapi
    except ImportError:
        say("rank_bm25 is not installed (pip install rank-bm25): the alternative is not measured")
        result["rank_bm25"] = None
    else:
        t0 = time.perf_counter()
        okapi = BM25Okapi([terms(c.text) for c in chunks])
        result["rank_bm25_build_s"] = time.perf_counter() - t0
        result["rank_bm25"] = latencies(
            lambda q: okapi.get_top_n(terms(q), chunks, n=args.k), queries, max(1, args.rounds // 5)
        )
        say(
            f"rank_bm25 (BM25Okapi): build {result['rank_bm25_build_s']:.2f} s; query p50 "
            f"{result['rank_bm25']['p50_ms']:.3f} ms, p95 {result['rank_bm25']['p95_ms']:.3f} ms"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        say(f"written {args.out}")
    print(json.dumps(result, indent=2))
    return 0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
