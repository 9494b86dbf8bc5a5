"""Draft-free speculative decoding (`gptforge generate --speculate K`, gptforge.modeling.speculative)
against plain decoding, on the answers it is meant for and on the ones it is not: retrieval-augmented
questions about docs/ (the chunks of the quickstart's `index@gptforge-docs` in front of each question,
as `gptforge serve --rag` puts them) and the same questions without the chunks.

    python benchmarks/bench_speculative.py [--folder checkpoints/instruct_smollm2/final]
        [--index data/index/gptforge-docs] [--questions 10] [--new-tokens 96] [--speculate 4,8]
        [--repeats 3] [--out docs/results/speculative_cpu.json]

One process, the model loaded once in bf16 where the CPU has native bf16 (else float32; `--dtype`
chooses), greedy
answers of up to `--new-tokens` tokens stopping at the model's end of turn; every question is
answered once to warm up, then `--repeats` rounds in which each setting answers every question in
turn (plain first). Per setting and prompt kind: tokens/s of all answers together (the median
over rounds), the share of drafted tokens kept, new tokens per forward of the model, and whether
each answer is token for token the plain one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]


def prompts(tok, index_folder: str, n: int) -> dict[str, list[list[int]]]:
    """Chat-template token ids of the first `n` questions of data/qa/gptforge_docs.jsonl, with
    their top 2 chunks in front (rag) and without (plain)."""
    from gptforge.rag.index import Index
    from gptforge.rag.prompt import augment

    index = Index.load(index_folder, param="--index")
    questions = [
        json.loads(line)["question"]
        for line in (ROOT / "data/qa/gptforge_docs.jsonl").read_text().splitlines()
        if line.strip()
    ][:n]

    def ids(text: str) -> list[int]:
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(enc if isinstance(enc, list) else enc["input_ids"])

    return {
        "rag": [ids(augment(q, index.search(q, 2), lambda _text: True).text) for q in questions],
        "plain": [ids(q) for q in questions],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", default=str(ROOT / "checkpoints/instruct_smollm2/final"))
    ap.add_argument("--index", default=str(ROOT / "data/index/gptforge-docs"))
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--speculate", default="4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from tqdm import tqdm

    from gptforge.modeling.decoding import generate_hf
    from gptforge.modeling.hf_causal import cpu_has_native_bf16, load_causal_lm, stop_ids

    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else None
    dtype = dtype or (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    model, tok = load_causal_lm(args.folder, param="--folder", dtype=dtype)
    stop = stop_ids(tok, model)
    kinds = prompts(tok, args.index, args.questions)
    settings = [0] + [int(k) for k in args.speculate.split(",")]

    def answer(ids: list[int], k: int) -> tuple[list[int], dict, float]:
        stats: dict = {}
        start = time.perf_counter()
        out = generate_hf(
            model, tok, torch.tensor([ids]), args.new_tokens, temperature=0, stop=stop, speculate=k, stats=stats
        )
        return out[0, len(ids) :].tolist(), stats, time.perf_counter() - start

    for ids in kinds["rag"] + kinds["plain"]:  # warm-up
        answer(ids, settings[-1])
    rounds: dict = {}
    bar = tqdm(total=args.repeats * len(settings) * sum(len(v) for v in kinds.values()), desc="answers")
    for _ in range(args.repeats):
        for kind, prompt_ids in kinds.items():
            for k in settings:
                tokens, seconds, drafted, kept, forwards, texts = 0, 0.0, 0, 0, 0, []
                for ids in prompt_ids:
                    new, stats, s = answer(ids, k)
                    tokens, seconds = tokens + len(new), seconds + s
                    drafted += stats.get("drafted", 0)
                    kept += stats.get("accepted", 0)
                    forwards += stats.get("forwards", len(new) - 1)
                    texts.append(new)
                    bar.update(1)
                rounds.setdefault((kind, k), []).append(
                    {
                        "tokens_per_sec": tokens / seconds,
                        "drafted": drafted,
                        "kept": kept,
                        "forwards": forwards,
                        "tokens": tokens,
                        "answers": texts,
                    }
                )
    bar.close()
    rows = []
    for (kind, k), rs in rounds.items():
        plain = rounds[(kind, 0)][0]["answers"]
        r0 = rs[0]
        rows.append(
            {
                "prompts": kind,
                "speculate": k,
                "tokens_per_sec": round(statistics.median(r["tokens_per_sec"] for r in rs), 2),
                "speedup_over_plain": round(
                    statistics.median(r["tokens_per_sec"] for r in rs)
                    / statistics.median(r["tokens_per_sec"] for r in rounds[(kind, 0)]),
                    3,
                ),
                "drafted": r0["drafted"],
                "kept_share": round(r0["kept"] / r0["drafted"], 3) if r0["drafted"] else None,
                "new_tokens_per_forward": round(r0["tokens"] / (r0["forwards"] + len(plain)), 3),
                "answers_identical_to_plain": sum(a == b for a, b in zip(r0["answers"], plain)),
                "answers": len(plain),
                "runs_tokens_per_sec": [round(r["tokens_per_sec"], 2) for r in rs],
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_meters import machine

    result = {
        "benchmark": "speculative_prompt_lookup",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine(), "torch": torch.__version__, "dtype": str(dtype)},
        "folder": args.folder,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "example_rag_answer": tok.decode(rounds[("rag", 0)][0]["answers"][0], skip_special_tokens=True),
        "command": "python benchmarks/bench_speculative.py " + " ".join(sys.argv[1:]),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
