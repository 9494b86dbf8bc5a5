"""Batch-1 greedy decoding speed: gptforge's KV-cached `generate` against Hugging Face `generate`.

    python benchmarks/bench_generate.py --config tiny|gpt2 [--repeats 5] [--new-tokens 128]

Both sides run the same random weights (ours converted with `to_hf`), fp32, on the CPU with
torch's default thread count. After one warm-up run of each, the median wall time of `--repeats`
runs gives tokens/s (new tokens only; the prompt's prefill is included in the time, as a user
would see it). Hugging Face runs `generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`
with its default cache and pad/eos set so it cannot stop early; ours runs
`generate(temperature=0)` with no eot stop. The JSON printed at the end has both speeds, the
ratio, and whether the two produced the same tokens.

Configs: `tiny` is the CPU default shape (4 layers x 4 heads x 128) but with block_size 256
instead of 64, so that prompt + 128 new tokens fit in the context and neither side crops
(cropping recomputes the whole window every step, which is another benchmark). `gpt2` is the
124M model (12 x 12 x 768, block 1024).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import torch  # noqa: E402

from gptforge.model import GPT, GPTConfig, generate, to_hf  # noqa: E402

CONFIGS = {
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=256),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),
}


def timed(fn, repeats: int) -> tuple[float, list[float], torch.Tensor]:
    out = fn()  # warm-up: first-call allocations, kernel selection, lazy imports
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    cfg = CONFIGS[args.config]
    model = GPT(cfg).eval()
    hf = to_hf(model)
    n = args.new_tokens
    prompt = torch.randint(0, cfg.n_vocab, (1, args.prompt_tokens))
    eos = cfg.n_vocab - 1

    def ours():
        return generate(model, prompt, n, temperature=0)

    def theirs():  # generate() runs under torch.no_grad itself
        return hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n, pad_token_id=eos, eos_token_id=eos)

    t_ours, all_ours, out_ours = timed(ours, args.repeats)
    t_hf, all_hf, out_hf = timed(theirs, args.repeats)
    same = out_ours.shape == out_hf.shape and torch.equal(out_ours, out_hf)
    first_diff = None
    if not same:
        k = min(out_ours.size(1), out_hf.size(1))
        diff = (out_ours[0, :k] != out_hf[0, :k]).nonzero()
        first_diff = int(diff[0]) - args.prompt_tokens if len(diff) else k - args.prompt_tokens
    result = {
        "config": args.config,
        "model": {**cfg.to_dict(), "params": model.num_params(non_embedding=False)},
        "batch_size": 1,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": n,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "ours_tokens_per_sec": round(n / t_ours, 2),
        "hf_tokens_per_sec": round(n / t_hf, 2),
        "speedup": round(t_hf / t_ours, 3),
        "ours_times_s": [round(t, 4) for t in all_ours],
        "hf_times_s": [round(t, 4) for t in all_hf],
        "same_tokens": same,
        # Other processes on the machine slow both sides (two threads wait on each other when
        # one is descheduled): read the numbers together with the load around the run.
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    if first_diff is not None:
        result["first_different_new_token"] = first_diff
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
