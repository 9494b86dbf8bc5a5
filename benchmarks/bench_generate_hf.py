"""Batch-1 greedy decoding of a Hugging Face Llama-family folder (SmolLM2-135M-Instruct by default):
gptforge's `generate_hf` (the lean decoder, gptforge.modeling.llama_decoding; `gptforge-int8` /
`gptforge-int4`: the same with `quantize="int8"` / `"int4"`, weight-only int8 / groupwise int4
linears) against transformers' own `generate` on the
same loaded model, and this machine's memory bandwidth, the bound of batch-1 decoding.

    python benchmarks/bench_generate_hf.py [--folder DIR] [--new-tokens 128] [--processes 3]
        [--dtypes float32,bfloat16] [--sides gptforge,gptforge-int8,gptforge-int4,transformers]
        [--out docs/results/generate_smollm2_cpu.json]

`--folder` defaults to the SmolLM2 folder that `prepare_base` writes from the packaged GGUF
(checkpoints/base/smollm2); when it is missing, the benchmark writes one into a temporary folder
the same way (gptforge.modeling.gguf_in.write_folder).

Each measurement is its own fresh process (this script with `--one SIDE`): it loads the model
in the dtype under test (not timed), encodes one chat question with the folder's template, then
times the first `generate` call of the process (what `gptforge generate` meets: one call per
process, first-call allocations included) and a second, warm call; 128 new tokens, greedy, no
stop id, so both sides make exactly the same number. The sides alternate (ours, transformers,
ours, ...) for `--processes` rounds per dtype; the JSON gives the medians, every run, the
ratios (each dtype's gptforge / transformers, and every gptforge setting against transformers'
fastest dtype), and whether each run's tokens equal transformers' float32 tokens (the text of
each is kept). torch's default thread count (the machine's cores).

Memory bandwidth: the median over 7 runs (after one warm-up) of summing a 1 GiB float32 tensor
(read only, what a decode step does with its weights); the bound of a dtype is that bandwidth
over the bytes of weights each token reads (every parameter once, the tied embedding once, as
the head), and each side's warm tokens/s is reported as a share of it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Explain in a few sentences why the sky is blue."
SIDES = ("gptforge", "gptforge-int8", "gptforge-int4", "transformers")  # -intN: generate_hf(quantize="intN")
QUANTIZE = {"gptforge-int8": "int8", "gptforge-int4": "int4"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def one(args) -> None:
    """One fresh process: load, then time the first and a second greedy call; print JSON."""
    import torch

    from gptforge.modeling.decoding import generate_hf
    from gptforge.modeling.hf_causal import load_causal_lm

    model, tok = load_causal_lm(args.folder, param="--folder", dtype=getattr(torch, args.dtype))
    enc = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True)
    ids = torch.tensor([list(enc if isinstance(enc, list) else enc["input_ids"])])
    runs, out = [], None
    for _ in range(2):
        start = time.perf_counter()
        out = generate_hf(
            model,
            tok,
            ids,
            args.new_tokens,
            temperature=0,
            stop=[],
            lean=args.one.startswith("gptforge"),
            quantize=QUANTIZE.get(args.one),
        )
        runs.append(time.perf_counter() - start)
    new = out[0, ids.size(1) :].tolist()
    assert len(new) == args.new_tokens
    print(
        json.dumps(
            {
                "side": args.one,
                "dtype": args.dtype,
                "first_s": runs[0],
                "warm_s": runs[1],
                "first_tokens_per_sec": args.new_tokens / runs[0],
                "warm_tokens_per_sec": args.new_tokens / runs[1],
                "tokens": new,
                "text": tok.decode(new, skip_special_tokens=True),
                "prompt_tokens": ids.size(1),
                "threads": torch.get_num_threads(),
            }
        )
    )


def memory_bandwidth(repeats: int = 7) -> float:
    """GB/s of reading a 1 GiB float32 tensor (its sum), median after a warm-up."""
    import torch

    t = torch.ones(1 << 28)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - start)
    return t.numel() * 4 / statistics.median(times[1:]) / 1e9


def weight_bytes(folder: str) -> dict:
    """Bytes of weights one decode step reads, per dtype: every parameter once (with the
    layers' linears in int8 for `gptforge-int8`, in int4 with a scale and a zero in the dtype
    per 32 weights for `gptforge-int4`, the rest in the dtype)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    linears = n * (h * h * 2 + h * kv * 2 + 3 * h * i)
    params = linears + n * 2 * h + h + cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    out = {"params": params, "linear_params": linears}
    for dtype, size in DTYPE_BYTES.items():
        out[dtype] = params * size
        out["int8+" + dtype] = linears + (params - linears) * size
        out["int4+" + dtype] = int(linears * (0.5 + 2 * size / 32)) + (params - linears) * size
    return out


def run_one(side: str, dtype: str, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        side,
        "--dtype",
        dtype,
        "--folder",
        args.folder,
        "--new-tokens",
        str(args.new_tokens),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{side} {dtype} failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", default=str(ROOT / "checkpoints/base/smollm2"))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--one", choices=SIDES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.one:
        return one(args)
    with tempfile.TemporaryDirectory() as tmp:
        if not (Path(args.folder) / "config.json").is_file():
            from gptforge.modeling.gguf_in import write_folder

            print(f"{args.folder} missing: writing SmolLM2 from the packaged GGUF", file=sys.stderr)
            args.folder = str(Path(tmp) / "smollm2")
            write_folder("packaged://smollm2-135m-instruct", Path(args.folder), param="--folder")
        bandwidth = memory_bandwidth()
        print(f"memory read bandwidth: {bandwidth:.1f} GB/s", file=sys.stderr)
        sizes = weight_bytes(args.folder)
        runs = {}
        for dtype in args.dtypes.split(","):
            for r in range(args.processes):
                for side in args.sides.split(","):
                    res = run_one(side, dtype, args)
                    runs.setdefault((side, dtype), []).append(res)
                    print(
                        f"{dtype:9s} {side:14s} first {res['first_tokens_per_sec']:6.1f} tok/s  "
                        f"warm {res['warm_tokens_per_sec']:6.1f} tok/s",
                        file=sys.stderr,
                    )
    reference = runs[("transformers", "float32")][0]["tokens"] if ("transformers", "float32") in runs else None
    rows = []
    for (side, dtype), rs in runs.items():
        first = statistics.median(x["first_tokens_per_sec"] for x in rs)
        warm = statistics.median(x["warm_tokens_per_sec"] for x in rs)
        bound = bandwidth * 1e9 / sizes[(QUANTIZE[side] + "+" if side in QUANTIZE else "") + dtype]
        rows.append(
            {
                "side": side,
                "dtype": dtype,
                "first_call_tokens_per_sec": round(first, 2),
                "warm_tokens_per_sec": round(warm, 2),
                "bandwidth_bound_tokens_per_sec": round(bound, 1),
                "warm_share_of_bound": round(warm / bound, 3),
                "same_tokens_as_transformers_float32": [x["tokens"] == reference for x in rs],
                "first_call_runs": [round(x["first_tokens_per_sec"], 2) for x in rs],
                "warm_runs": [round(x["warm_tokens_per_sec"], 2) for x in rs],
                "text": rs[0]["text"],
            }
        )
    by = {(r["side"], r["dtype"]): r for r in rows}
    ratios = {}
    for dtype in args.dtypes.split(","):
        ours, theirs = by.get(("gptforge", dtype)), by.get(("transformers", dtype))
        if ours and theirs:
            ratios[dtype] = {
                k: round(ours[k] / theirs[k], 3) for k in ("first_call_tokens_per_sec", "warm_tokens_per_sec")
            }
    # each gptforge setting against transformers' fastest first call, whatever its dtype
    theirs = [r for r in rows if r["side"] == "transformers"]
    if theirs:
        best = max(theirs, key=lambda r: r["first_call_tokens_per_sec"])
        ratios["over_fastest_transformers"] = {
            "transformers_dtype": best["dtype"],
            **{
                f"{r['side']} {r['dtype']}": round(
                    r["first_call_tokens_per_sec"] / best["first_call_tokens_per_sec"], 3
                )
                for r in rows
                if r["side"] != "transformers"
            },
        }
    import torch

    from gptforge.modeling.hf_causal import cpu_has_native_bf16

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_meters import machine

    result = {
        "benchmark": "generate_hf_batch1",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            **machine(),
            "platform": platform.platform(),
            "native_bf16": cpu_has_native_bf16(),
            "torch": torch.__version__,
            "memory_read_GBps": round(bandwidth, 2),
        },
        "folder": args.folder,
        "weights": sizes,
        "question": QUESTION,
        "new_tokens": args.new_tokens,
        "processes": args.processes,
        "rows": rows,
        "ratios": ratios,
        "command": "python benchmarks/bench_generate_hf.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps({"ratios": ratios}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
