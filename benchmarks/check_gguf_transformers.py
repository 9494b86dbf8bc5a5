"""A GGUF file against the folder it was written from, read back by transformers' GGUF reader
(which dequantizes it): the logits' relative error and the next-token argmax agreement over a
held-out text.

    python benchmarks/check_gguf_transformers.py --gguf FILE --folder DIR [--chars 2000]

After `make run`, FILE is the aligned SmolLM2's q8_0 copy that `register` wrote (the closing
summary's "GGUF of rl" line) and DIR is checkpoints/rl/final. The relative error is the one
tests/test_gguf_out.py bounds (1e-2 for f16, 5e-2 for q8_0 against f16): over positions, the
largest |logit difference| over the largest |logit| there; the mean over positions beside it.
Both models run in float32 on the CPU. The held-out text is docs/gguf-out.md, which no model here
trained on. Measured 2026-11-29 on the quickstart's aligned SmolLM2 (671 positions): q8_0 0.041
(mean 0.014), argmax agreement 97.9%; its f16 export 2e-6, 100%.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, type=Path)
    p.add_argument("--folder", required=True, type=Path)
    p.add_argument("--chars", type=int, default=2000, help="characters of the held-out text")
    args = p.parse_args()
    text = (ROOT / "docs" / "gguf-out.md").read_text(encoding="utf-8")[: args.chars]
    tok = AutoTokenizer.from_pretrained(str(args.folder))
    ids = tok(text, return_tensors="pt").input_ids
    source = AutoModelForCausalLM.from_pretrained(str(args.folder), dtype=torch.float32).eval()
    read = AutoModelForCausalLM.from_pretrained(
        str(args.gguf.parent), gguf_file=args.gguf.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        want, got = source(ids).logits[0], read(ids).logits[0]
    per_position = (want - got).abs().amax(-1) / want.abs().amax(-1)
    relative, mean_relative = per_position.max().item(), per_position.mean().item()
    agree = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    print(
        json.dumps(
            {
                "gguf": str(args.gguf),
                "folder": str(args.folder),
                "positions": ids.shape[1],
                "relative_error": round(relative, 6),
                "mean_relative_error": round(mean_relative, 6),
                "argmax_agreement": round(agree, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
