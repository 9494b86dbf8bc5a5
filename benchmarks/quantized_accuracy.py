"""What weight-only int8 and int4 cost in accuracy: a Hugging Face Llama-family folder (SmolLM2
by default) in bfloat16, then with its decoder linears and head rounded as `--quantize int8` /
`int4` round them (gptforge.modeling.llama_decoding.round_weights: the weights the quantized decode
step multiplies by, tests/test_llama_decoding.py checks the two agree), scored teacher-forced on
the quickstart's FineWeb-Edu validation split: perplexity, and the share of positions whose
next-token argmax equals the unrounded model's, in bfloat16 (how the quantized step runs on CPUs
with native bf16) and in float32 (the weights' rounding alone). The float32 model against the
bfloat16 one is the floor of that share: how often bfloat16's rounding of the activations alone
flips a near-tie.

    python benchmarks/quantized_accuracy.py [--folder DIR ...] [--tokens 8192] [--window 512]
        [--out docs/results/quantized_accuracy_cpu.json]

The text is the validation split `prepare_pretrain` cuts (the first 20,000 GPT-2 tokens of the
embedded sample, data/pretrain/val_000000.npy, decoded back to text: byte-level BPE decodes
exactly) and tokenized with each folder's own tokenizer; the first `--tokens` tokens are scored in
windows of `--window` (each window's first token is context only). Each setting is its own load of
the folder, so one rounding never leaks into the next.

SmolLM2's quickstart folder is dequantized from the packaged Q4_1 GGUF, whose blocks of 32 are
the groups int4 rounds in: its int4 figures are flattering (the grid is already there). A
folder trained after the GGUF (checkpoints/instruct_smollm2/final: LoRA merged in) is not on that
grid; pass it with `--folder` beside the base.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
# the folder's weights; rounded as --quantize rounds them; rounded as llama.cpp's q8_0 and Q4_1
# round them (gguf-py's reference quantizers: blocks of 32, one fp16 scale; Q4_1 a minimum too)
SETTINGS = ("native", "int8", "int4", "q8_0", "q4_1")
ACTIVATIONS = ("bfloat16", "float32")


def validation_text() -> str:
    """The quickstart's FineWeb-Edu validation split as text."""
    import numpy as np

    from gptforge.modeling.tokenizer import load_tokenizer

    shard = ROOT / "data/pretrain/val_000000.npy"
    if not shard.is_file():
        raise SystemExit(f"{shard} is missing: run `make run` (or `dvc repro prepare_pretrain`) first")
    return load_tokenizer(str(ROOT / "src/gptforge/samples/gpt2_tokenizer")).decode(
        np.load(shard).astype(np.int64).tolist()
    )


def llama_cpp_round(model, setting: str) -> None:
    """Each decoder linear's weight replaced by its llama.cpp rounding and the head by q8_0's (what
    round_weights rounds, the head in 8 bits as llama.cpp keeps a Q4 file's output tensor in
    more bits; a tied head gets a rounded copy, the embedding stays, where a GGUF file would
    round its token_embd too)."""
    import torch
    from gguf import GGMLQuantizationType, quants

    from gptforge.modeling.llama_decoding import decoder_linears

    kind = {"q8_0": GGMLQuantizationType.Q8_0, "q4_1": GGMLQuantizationType.Q4_1}[setting]

    def rounded(w: torch.Tensor, kind) -> torch.Tensor:
        return torch.from_numpy(quants.dequantize(quants.quantize(w.float().numpy(), kind), kind)).to(w.dtype)

    with torch.no_grad():
        for m in decoder_linears(model):
            m.weight.copy_(rounded(m.weight, kind))
        head = rounded(model.lm_head.weight, GGMLQuantizationType.Q8_0)  # as --quantize int4 keeps it in int8
        model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)


def score(folder: str, setting: str, activations: str, text: str, tokens: int, window: int):
    """(next-token log-losses, argmaxes) over the first `tokens` tokens of `text`."""
    import torch
    import torch.nn.functional as F

    from gptforge.modeling.hf_causal import load_causal_lm
    from gptforge.modeling.llama_decoding import round_weights

    model, tok = load_causal_lm(folder, param="--folder", dtype=getattr(torch, activations))
    if setting in ("int8", "int4"):
        round_weights(model, setting)
    elif setting != "native":
        llama_cpp_round(model, setting)
    ids = tok(text, return_tensors="pt")["input_ids"][0][:tokens]
    losses, argmaxes = [], []
    with torch.inference_mode():
        for start in range(0, ids.numel() - 1, window):
            chunk = ids[start : start + window + 1]
            if chunk.numel() < 2:
                break
            logits = model(input_ids=chunk[:-1][None]).logits[0].float()
            losses.append(F.cross_entropy(logits, chunk[1:], reduction="none"))
            argmaxes.append(logits.argmax(-1))
    return torch.cat(losses), torch.cat(argmaxes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", action="append", default=None, help="repeatable (default: checkpoints/base/smollm2)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    folders = args.folder or [str(ROOT / "checkpoints/base/smollm2")]
    text = validation_text()
    from tqdm import tqdm

    rows = []
    for folder in folders:
        scored = {}
        for activations in ACTIVATIONS:
            for setting in tqdm(SETTINGS, desc=f"{Path(folder).name} {activations}", leave=False):
                scored[activations, setting] = score(folder, setting, activations, text, args.tokens, args.window)
        for (activations, setting), (loss, arg) in scored.items():
            ref_loss, ref_arg = scored[activations, "native"]
            ppl, ref_ppl = math.exp(loss.mean().item()), math.exp(ref_loss.mean().item())
            rows.append(
                {
                    "folder": folder,
                    "activations": activations,
                    "weights": setting,
                    "positions": loss.numel(),
                    "perplexity": round(ppl, 4),
                    "perplexity_over_native": round(ppl / ref_ppl, 5),
                    "argmax_agreement_with_native": round((arg == ref_arg).float().mean().item(), 5),
                    "argmax_agreement_with_bfloat16_native": round(
                        (arg == scored["bfloat16", "native"][1]).float().mean().item(), 5
                    ),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_meters import machine

    result = {
        "benchmark": "quantized_accuracy",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine(), "torch": torch.__version__},
        "text": "data/pretrain/val_000000.npy (the quickstart's FineWeb-Edu validation split), decoded",
        "tokens": args.tokens,
        "window": args.window,
        "rows": rows,
        "command": "python benchmarks/quantized_accuracy.py " + " ".join(sys.argv[1:]),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
