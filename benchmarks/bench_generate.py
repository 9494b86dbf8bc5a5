"""Batch-1 greedy decoding speed: gptforge's KV-cached `generate` against Hugging Face `generate`.

    python benchmarks/bench_generate.py --config tiny|gpt2 [--repeats N] [--new-tokens 128]

Both sides run the same random weights (ours converted with `to_hf`), fp32, on the CPU with
torch's default thread count. After one warm-up run of each, the runs take turns for
`--repeats` rounds and the median wall time of each gives tokens/s (new tokens only; the
prompt's prefill is included in the time, as a user would see it). Hugging Face runs
`generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)` with its default cache and
pad/eos set so it cannot stop early; ours runs `generate(temperature=0)` with no eot stop.
The JSON printed at the end has both speeds, the ratio, and whether the two produced the same
tokens.

What makes ours faster (see gptforge.modeling.decoding): each decode step runs as straight functional
calls over weights gathered once (`Decoder`), and greedy steps find the argmax through an
int8 copy of the head whose candidates are then checked exactly (`GreedyHead`), so a token
reads ~40 MB of head instead of 154 MB at GPT-2 124M. `ours_full_head` is the same run with
that screen off (the float32 head read at every token), to show what each part brings.

`--dtypes float32,bfloat16` adds bf16 sides (the default where the CPU has native bf16): ours
in bf16 (`ours_bf16`; one- and two-row products through ATen's matrix-vector kernels,
gptforge.modeling.cpu_gemv), with weight-only int8 and int4 linears and an int8 head
(`ours_int8`, `ours_int4`: `generate(weights=...)`, bf16 activations, packing included in each
call as `gptforge generate --quantize` pays it once per process), and Hugging Face's `generate`
on the same weights in bf16 (`hf_bf16`); `speedup_over_fastest_hf` divides each of ours by the
faster Hugging Face dtype.

Configs: `tiny` is the CPU default shape (4 layers x 4 heads x 128) but with block_size 256
instead of 64, so that prompt + 128 new tokens fit in the context and neither side crops
(cropping recomputes the whole window every step, which is another benchmark). `gpt2` is the
124M model (12 x 12 x 768, block 1024).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import torch  # noqa: E402
import transformers  # noqa: E402

from gptforge.modeling.decoding import GreedyHead, generate  # noqa: E402
from gptforge.modeling.gpt import GPT, GPTConfig  # noqa: E402
from gptforge.modeling.hf_convert import to_hf  # noqa: E402

CONFIGS = {
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=256),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),
}


def timed_interleaved(fns: dict, repeats: int) -> dict:
    """Median wall time of each function over `repeats` rounds, after one warm-up call of each
    (first-call allocations, kernel selection, lazy imports, the int8 head copy). The functions
    take turns within each round, so a slow spell of this shared machine hits them alike rather
    than one side's whole series."""
    outs = {name: fn() for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), ts, outs[name]) for name, ts in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of timing (default: 15 for tiny, 5 for gpt2)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--dtypes", default=None, help="float32[,bfloat16] (default: bfloat16 too on native-bf16 CPUs)")
    args = ap.parse_args()
    if args.dtypes is None:
        from gptforge.modeling.hf_causal import cpu_has_native_bf16

        args.dtypes = "float32,bfloat16" if cpu_has_native_bf16() else "float32"

    if args.repeats is None:
        args.repeats = 15 if args.config == "tiny" else 5
    torch.manual_seed(args.seed)
    cfg = CONFIGS[args.config]
    model = GPT(cfg).eval()
    hf = to_hf(model)
    n = args.new_tokens
    prompt = torch.randint(0, cfg.n_vocab, (1, args.prompt_tokens))
    eos = cfg.n_vocab - 1

    def ours():
        return generate(model, prompt, n, temperature=0)

    def hf_generate(m):
        def run():  # generate() runs under torch.no_grad itself
            return m.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=eos,
                eos_token_id=eos,
            )

        return run

    theirs = hf_generate(hf)

    def ours_full_head():  # the same, with the greedy int8 head screen switched off
        with mock.patch.object(GreedyHead, "for_model", classmethod(lambda cls, m, build=True: None)):
            return generate(model, prompt, n, temperature=0)

    screen_used = GreedyHead.for_model(model) is not None
    sides = {"ours": ours, "ours_full_head": ours_full_head, "hf": theirs}
    if "bfloat16" in args.dtypes.split(","):
        model16, hf16 = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(hf).to(torch.bfloat16)
        sides["ours_bf16"] = lambda: generate(model16, prompt, n, temperature=0)
        sides["ours_int8"] = lambda: generate(model16, prompt, n, temperature=0, weights="int8")
        sides["ours_int4"] = lambda: generate(model16, prompt, n, temperature=0, weights="int4")
        sides["hf_bf16"] = hf_generate(hf16)
    res = timed_interleaved(sides, args.repeats)
    (t_ours, all_ours, out_ours), (t_hf, all_hf, out_hf) = res["ours"], res["hf"]
    t_full, _, out_full = res["ours_full_head"]
    same = out_ours.shape == out_hf.shape and torch.equal(out_ours, out_hf)
    first_diff = None
    if not same:
        k = min(out_ours.size(1), out_hf.size(1))
        diff = (out_ours[0, :k] != out_hf[0, :k]).nonzero()
        first_diff = int(diff[0]) - args.prompt_tokens if len(diff) else k - args.prompt_tokens
    result = {
        "config": args.config,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {**cfg.to_dict(), "params": model.num_params(non_embedding=False)},
        "batch_size": 1,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": n,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "ours_tokens_per_sec": round(n / t_ours, 2),
        "hf_tokens_per_sec": round(n / t_hf, 2),
        "speedup": round(t_hf / t_ours, 3),
        # Ablation: our decoder with the float32 head read in full at every token.
        "greedy_int8_screen": screen_used,
        "ours_full_head_tokens_per_sec": round(n / t_full, 2),
        "speedup_full_head": round(t_hf / t_full, 3),
        "same_tokens_full_head": bool(torch.equal(out_full, out_ours)),
        "ours_times_s": [round(t, 4) for t in all_ours],
        "hf_times_s": [round(t, 4) for t in all_hf],
        "same_tokens": same,
        # Other processes on the machine slow both sides (two threads wait on each other when
        # one is descheduled): read the numbers together with the load around the run.
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    if first_diff is not None:
        result["first_different_new_token"] = first_diff
    if "hf_bf16" in res:
        fastest_hf = min(t_hf, res["hf_bf16"][0])
        result["bf16"] = {
            name: {
                "tokens_per_sec": round(n / res[name][0], 2),
                "times_s": [round(t, 4) for t in res[name][1]],
                "same_tokens_as_ours_float32": bool(torch.equal(res[name][2], out_ours)),
            }
            for name in ("ours_bf16", "ours_int8", "ours_int4", "hf_bf16")
        }
        result["speedup_over_fastest_hf"] = {
            name: round(fastest_hf / res[name][0], 3) for name in ("ours", "ours_bf16", "ours_int8", "ours_int4")
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
