"""Continuous batching of a Hugging Face causal LM in `gptforge serve`'s engine (no HTTP), against
transformers' own `generate` on the same model: one request at a time, and a padded batch.

    python benchmarks/bench_serve_hf.py [--clients 1,4,16] [--new-tokens 64] [--repeats 3]
        [--out docs/results/serve_hf_tiny_cpu.json]

The model is a random Llama (hidden 256, 4 layers, 8 heads, 4 key/value heads, GPT-2's
vocabulary), float32 on the CPU. Each level submits `clients` greedy requests at once, each
with its own prompt (prompts of different lengths, so rows sit at different positions in the
left-padded cache) and `--new-tokens` tokens, through `serve.hf_backend.HFBackend` and the
engine (its scheduler in a thread of this process), and measures the aggregate tokens/s (all
requests' tokens over the wall time, median of
`--repeats`). Beside it: `generate_hf` one prompt at a time (what a server without batching
gives), and transformers' `generate` on the left-padded batch of all prompts (a static batch,
what padded batching would give at best, every row decoding until the longest ends). The JSON
says whether the engine's greedy answers equal `generate_hf`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_models import make_tokenizer  # noqa: E402

from gptforge.modeling.decoding import generate_hf  # noqa: E402
from gptforge.serve.engine import Engine, Sampling  # noqa: E402
from gptforge.serve.engine_core import ThreadCore  # noqa: E402
from gptforge.serve.hf_backend import HFBackend  # noqa: E402
from gptforge.serve.scheduler import Scheduler  # noqa: E402


def make_model(folder: Path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50257,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=50256,
        eos_token_id=50256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    make_tokenizer(folder)
    return model, AutoTokenizer.from_pretrained(str(folder))


def engine_level(model, prompts: list[list[int]], new_tokens: int, stop: set[int]) -> tuple[float, list[list[int]]]:
    async def main():
        backend = HFBackend(model, max_batch=len(prompts), context=512)
        engine = Engine(ThreadCore(Scheduler(backend)), lambda ids: "", max_queue=64)
        engine.start()
        try:
            start = time.perf_counter()
            jobs = [engine.submit(p, Sampling(max_tokens=new_tokens, temperature=0), stop) for p in prompts]
            for job in jobs:
                while (await job.events.get()).finish_reason is None:
                    pass
            seconds = time.perf_counter() - start
        finally:
            await engine.stop()
        return sum(len(j.generated) for j in jobs) / seconds, [j.generated for j in jobs]

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()  # stop=[-1] (never stop) is meant: no warning per call
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = make_model(Path(tmp))
    words = "the quick brown fox jumps over the lazy dog and keeps running far away".split()
    all_prompts = [
        tok(" ".join(words[: 3 + i % 11]))["input_ids"] for i in range(max(map(int, args.clients.split(","))))
    ]
    stop: set[int] = set()  # no stop id: every request makes exactly --new-tokens tokens
    levels = []
    for clients in map(int, args.clients.split(",")):
        prompts = all_prompts[:clients]
        engine_runs, answers = [], None
        for _ in range(args.repeats + 1):  # the first is a warm-up
            speed, answers = engine_level(model, prompts, args.new_tokens, stop)
            engine_runs.append(speed)
        one_at_a_time, padded = [], []
        reference = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            reference = [
                generate_hf(model, tok, torch.tensor([p]), args.new_tokens, temperature=0, stop=[-1])[
                    0, len(p) :
                ].tolist()
                for p in prompts
            ]
            one_at_a_time.append(clients * args.new_tokens / (time.perf_counter() - start))
            tok.padding_side, tok.pad_token = "left", tok.eos_token
            batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(
                    **batch,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    do_sample=False,
                    pad_token_id=50256,
                )
            padded.append(clients * args.new_tokens / (time.perf_counter() - start))
        level = {
            "clients": clients,
            "engine_tokens_per_sec": round(statistics.median(engine_runs[1:]), 1),
            "generate_one_at_a_time_tokens_per_sec": round(statistics.median(one_at_a_time[1:]), 1),
            "generate_padded_batch_tokens_per_sec": round(statistics.median(padded[1:]), 1),
            "same_tokens_as_generate": answers == reference,
        }
        levels.append(level)
        print(json.dumps(level))
    result = {
        "benchmark": "serve_hf_engine",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "model": "random Llama, hidden 256, 4 layers, 8 heads (4 kv), vocab 50257, float32",
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "levels": levels,
        "command": "python benchmarks/bench_serve_hf.py " + " ".join(sys.argv[1:]),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
