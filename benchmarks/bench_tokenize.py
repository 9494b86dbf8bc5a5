"""Tokenization throughput of `prepare pretrain`, end to end: read, tokenize, write shards.

    python benchmarks/bench_tokenize.py [--mb 64] [--repeats 3] [--workers 0] [--text FILE]

Builds a text file of at least `--mb` MB (tinyshakespeare repeated when ../shared/data has it,
else seeded pseudo-English), then times `tokenize_to_shards` on it `--repeats` times after one
warm-up run and prints the median and spread in tokens/s. The file is one document, so this
also exercises the safe cutting of a large document across worker processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

from gptforge.data.pretrain import find_corpus, tokenize_to_shards

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def make_text(path: Path, mb: int, seed_text: Path | None) -> None:
    if seed_text and seed_text.is_file():
        base = seed_text.read_text(encoding="utf-8")
    else:
        rng = random.Random(0)
        words = ["the", "model", "learns", "from", "data", "and", "tokens", "of", "text", "in", "a",
                 "language", "training", "loss", "is", "computed", "over", "batches", "gradient", "step"]
        lines = (" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))).capitalize() + "."
                 for _ in range(20000))
        base = "\n".join(lines) + "\n"
    with open(path, "w", encoding="utf-8") as f:
        written = 0
        while written < mb * 1_000_000:
            f.write(base)
            written += len(base.encode("utf-8"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0, help="0 = one per core")
    ap.add_argument("--text", type=Path, default=None, help="use this file instead of building one")
    args = ap.parse_args()
    tok_dir = SHARED / "gpt2_tokenizer"
    tokenizer_path = str(tok_dir) if tok_dir.is_dir() else None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = args.text
        if text is None:
            text = tmp / "corpus.txt"
            make_text(text, args.mb, SHARED / "tinyshakespeare" / "input.txt")
        size = text.stat().st_size
        corpus = find_corpus(str(text), name=None, split="train", text_field="text", param="--text")
        rates = []
        for i in range(args.repeats + 1):  # the first run warms the page cache and the imports
            out = tmp / f"out{i}"
            out.mkdir()
            stats = tokenize_to_shards(corpus, out, tokenizer_path=tokenizer_path, max_tokens=10**12,
                                       shard_tokens=100_000_000, val_tokens=1_000_000, workers=args.workers)
            if i:
                rates.append(stats.total_tokens / stats.seconds)
            for f in out.iterdir():
                f.unlink()
    result = {
        "file_mb": round(size / 1e6, 1),
        "tokens": stats.total_tokens,
        "workers": args.workers or os.cpu_count(),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "repeats": args.repeats,
        "median_tokens_per_sec": statistics.median(rates),
        "min_tokens_per_sec": min(rates),
        "max_tokens_per_sec": max(rates),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
