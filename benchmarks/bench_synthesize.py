"""The synthesize stage's request path: pairs/min at concurrency 1 and 8, against an endpoint that
answers every request after a fixed delay (the stage's own overhead) and against `gptforge serve`
on the tiny model (a real server, its own speed).

    python benchmarks/bench_synthesize.py [--chunks 48] [--delay 0.2] [--rounds 3]
        [--serve-chunks 16] [--serve-max-tokens 64] [--no-serve] [--out docs/results/synthesize_cpu.json]

The chunks are the project's own docs/ pages cut as the stage cuts them (512 GPT-2 tokens, 64
shared), the first `--chunks` of them. Each measurement runs the stage's own `generate_pairs`
(prompt, request, parse, cache write, progress bar) on those chunks with a fresh, empty response
cache, so every chunk is a request. The levels take turns for `--rounds` rounds (1, 8, 1, 8, ...)
and each figure is the median over the rounds.

- The fixed-delay endpoint is the tests' scripted server (tests/chat_endpoint.py, threaded, in
  this process) sleeping `--delay` s (200 ms) per request, answering three well-formed pairs: at
  concurrency 1 the stage can do
  at most 60/delay requests a minute, at 8 eight times that; the ratio shows what the stage's
  own work costs (the target: 8 requests in flight give at least 6x the pairs/min of 1).
- `gptforge serve` on bench_generate's tiny model (1,024 positions, random weights, continuous batching, in a
  subprocess on 127.0.0.1) with `--serve-max-tokens` per reply: the tiny model writes no JSON, so
  its replies count as unparseable and each chunk is asked twice; requests/min and the
  completion tokens/s from the server's usage counts are the figures there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))  # the scripted OpenAI-compatible server the tests use

from chat_endpoint import ChatEndpoint  # noqa: E402
from machine import cpu_model, git  # noqa: E402
from servers import free_port, start_server, stop_server, wait_healthy  # noqa: E402

PAIRS = json.dumps(
    [{"question": f"What does step {i} of the pipeline do?", "answer": f"Step {i} runs a stage."} for i in range(3)]
)


class FixedDelayEndpoint(ChatEndpoint):
    """/v1/chat/completions answered after `delay` seconds with three pairs, on 127.0.0.1."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def answer(self, body: dict) -> str:
        time.sleep(self.delay)
        return PAIRS


def docs_chunks(n: int, tokenizer_path: str | None) -> list:
    from gptforge.modeling.tokenizer import load_tokenizer
    from gptforge.synthesize.chunks import chunk_documents
    from gptforge.synthesize.documents import read_documents

    enc = load_tokenizer(tokenizer_path)
    chunks = chunk_documents(
        read_documents(ROOT / "docs", param="docs"),
        chunk_tokens=512,
        overlap=64,
        count_tokens=lambda text: len(enc.encode_ordinary(text)),
    )
    return [c for c in chunks if c.tokens >= 32][:n]


def measure(url: str, model: str, chunks: list, concurrency: int, max_tokens: int) -> dict:
    """One pass of the stage's generate_pairs over `chunks` with an empty cache."""
    from gptforge.openai_client import ChatClient
    from gptforge.synthesize.generate import Asker, ResponseCache
    from gptforge.synthesize.stage import generate_pairs

    settings = types.SimpleNamespace(
        concurrency=concurrency, pairs_per_chunk=3, temperature=0.0, max_tokens=max_tokens, seed=123
    )
    with tempfile.TemporaryDirectory(prefix="bench_synthesize_cache_") as cache:
        asker = Asker(ChatClient(url, model, timeout=600, retries=0), ResponseCache(cache))
        t0 = time.perf_counter()
        got = generate_pairs(chunks, asker, settings)
        wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "wall_s": round(wall, 3),
        "requests": asker.sent,
        "pairs": len(got.pairs),
        "unparseable": got.unparseable,
        "pairs_per_min": round(len(got.pairs) / wall * 60, 1),
        "requests_per_min": round(asker.sent / wall * 60, 1),
        "completion_tokens_per_sec": round(got.completion_tokens / wall, 1),
    }


def rounds(url: str, model: str, chunks: list, levels: list[int], n_rounds: int, max_tokens: int) -> list[dict]:
    runs: dict[int, list[dict]] = {c: [] for c in levels}
    measure(url, model, chunks[: max(levels)], max(levels), max_tokens)  # warm-up: connections, imports
    for _ in range(n_rounds):
        for c in levels:
            runs[c].append(measure(url, model, chunks, c, max_tokens))
    out = []
    for c in levels:
        med = {
            k: statistics.median(r[k] for r in runs[c])
            for k in ("wall_s", "pairs_per_min", "requests_per_min", "completion_tokens_per_sec")
        }
        out.append(
            {
                "concurrency": c,
                **med,
                "requests": runs[c][0]["requests"],
                "pairs": runs[c][0]["pairs"],
                "unparseable": runs[c][0]["unparseable"],
                "rounds": runs[c],
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=48, help="chunks of docs/ asked about (default: %(default)s)")
    ap.add_argument("--delay", type=float, default=0.2, help="the fixed endpoint's seconds per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--serve-chunks", type=int, default=16)
    ap.add_argument("--serve-max-tokens", type=int, default=64)
    ap.add_argument("--no-serve", action="store_true", help="only the fixed-delay endpoint")
    ap.add_argument("--out", default=None, help="also write this JSON and a markdown table (.md)")
    args = ap.parse_args()
    levels = sorted({int(c) for c in args.levels.split(",")})
    from gptforge.config.load import load_config

    tokenizer_path = load_config(ROOT / "params.yaml").tokenizer.path if (ROOT / "params.yaml").is_file() else None
    chunks = docs_chunks(args.chunks, tokenizer_path)

    fixed = FixedDelayEndpoint(args.delay)
    try:
        fixed_levels = rounds(fixed.url, "fixed", chunks, levels, args.rounds, 1024)
    finally:
        fixed.close()
    by_c = {lv["concurrency"]: lv for lv in fixed_levels}
    speedup = by_c[levels[-1]]["pairs_per_min"] / by_c[levels[0]]["pairs_per_min"]
    result = {
        "benchmark": "synthesize",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": cpu_model(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "chunks": len(chunks),
        "rounds": args.rounds,
        "fixed_delay": {
            "delay_s": args.delay,
            "levels": fixed_levels,
            "speedup": round(speedup, 2),
            "ideal_pairs_per_min_at_1": round(3 * 60 / args.delay, 1),
            "target_met": speedup >= 6,
        },
    }
    if not args.no_serve:
        result["serve"] = serve_levels(args, chunks[: args.serve_chunks], levels, tokenizer_path)
    result["command"] = "python benchmarks/bench_synthesize.py " + " ".join(sys.argv[1:])
    result["commit"] = git("rev-parse", "--short", "HEAD")
    text = json.dumps(result, indent=2)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
        out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
    print(text)
    return 0


def serve_levels(args, chunks: list, levels: list[int], tokenizer_path: str | None) -> dict:
    import torch
    from bench_generate import CONFIGS

    from gptforge.modeling.gpt import GPT
    from gptforge.modeling.weights import save_model

    torch.manual_seed(1337)
    # bench_generate's tiny model with 1,024 positions: a 512-token chunk and its prompt fit
    model = GPT(dataclasses.replace(CONFIGS["tiny"], block_size=1024)).eval()
    serve_args = types.SimpleNamespace(max_batch=16, tokenizer_path=tokenizer_path, profile=None, server_threads=None)
    with tempfile.TemporaryDirectory(prefix="bench_synthesize_serve_") as tmp:
        tmp = Path(tmp)
        ckpt = save_model(model, tmp / "tiny")
        port = free_port()
        proc = start_server(ckpt, port, serve_args, tmp / "server.log")
        try:
            wait_healthy(proc, port, tmp / "server.log", 180)
            got = rounds(f"http://127.0.0.1:{port}/v1", "tiny", chunks, levels, args.rounds, args.serve_max_tokens)
        finally:
            stop_server(proc)
    return {
        "model": "bench_generate's tiny (4x4x128, 1,024 positions, random weights)",
        "max_tokens": args.serve_max_tokens,
        "chunks": len(chunks),
        "levels": got,
    }


def markdown(result: dict) -> str:
    lines = [
        f"# bench_synthesize ({result['date']}, {result['machine']['processor']}, "
        f"{result['machine']['cpu_count']} cores)",
        "",
        f"{result['chunks']} chunks of docs/, median of {result['rounds']} rounds.",
        "",
        "| endpoint | concurrency | pairs/min | requests/min | completion tokens/s | wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    parts = [(f"fixed {result['fixed_delay']['delay_s'] * 1000:.0f} ms", result["fixed_delay"]["levels"])]
    if "serve" in result:
        parts.append(("gptforge serve, tiny", result["serve"]["levels"]))
    for name, levels in parts:
        for lv in levels:
            lines.append(
                f"| {name} | {lv['concurrency']} | {lv['pairs_per_min']:g} | {lv['requests_per_min']:g} | "
                f"{lv['completion_tokens_per_sec']:g} | {lv['wall_s']:g} |"
            )
    lines += [
        "",
        f"Fixed-delay speedup at the top level: {result['fixed_delay']['speedup']}x "
        f"(target 6x: {'met' if result['fixed_delay']['target_met'] else 'NOT met'}).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
