"""The output head's product at a few rows on the CPU: `model.head_logits` (F.linear; torch.mv for
one row) against the same product written head @ x.T (what `serve.gpt_backend.GPTBackend.logits`
uses, one row computed as two).

    python benchmarks/bench_head.py [--n-embd 128] [--rows 1,2,4,8,16] [--repeats 50]

The head is GPT-2's vocabulary (50257 rows, a slice of the 50304-row embedding, as in the
model) by `--n-embd`, random float32. Each form runs once to warm up, then the forms take turns
for `--repeats` rounds; the median time of each is printed, with the ratio and a check that
both give the same argmax. On the CPU MKL picks a kernel per shape, and the fastest way to
write the same product differs from machine to machine: rerun it where you serve.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gptforge.modeling.gpt import head_logits


def head_as_mm(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    rows = x.size(0)
    if rows == 1:
        x = torch.cat([x, x])
    return torch.mm(head, x.t()).t()[:rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    head = torch.randn(50304, args.n_embd)[:50257]
    results = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.n_embd)
            forms = {"head_logits": lambda: head_logits(x, head), "head @ x.T": lambda: head_as_mm(x, head)}
            same = bool(torch.equal(forms["head_logits"]().argmax(-1), forms["head @ x.T"]().argmax(-1)))
            times = {name: [] for name in forms}
            for _ in range(args.repeats):
                for name, fn in forms.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            results.append(
                {
                    "rows": rows,
                    "head_logits_ms": round(med["head_logits"], 3),
                    "mm_ms": round(med["head @ x.T"], 3),
                    "speedup": round(med["head_logits"] / med["head @ x.T"], 2),
                    "same_argmax": same,
                }
            )
            print(
                f"rows {rows:3d}: head_logits {med['head_logits']:7.3f} ms   head @ x.T {med['head @ x.T']:7.3f} ms"
                f"   {results[-1]['speedup']:.2f}x   same argmax: {same}"
            )
    print(
        json.dumps(
            {"n_embd": args.n_embd, "threads": torch.get_num_threads(), "torch": torch.__version__, "results": results}
        )
    )


if __name__ == "__main__":
    main()
