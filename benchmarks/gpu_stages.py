"""Two of gptforge's own stages on a CUDA device, for the GPU report: `benchmark` and `pretrain`.

    PYTHONPATH=src:. python benchmarks/gpu_stages.py benchmark --out DIR
    PYTHONPATH=src:. python benchmarks/gpu_stages.py pretrain --data data/pretrain --out DIR [--steps 30]

Both read configs/gpt2-124m-fineweb.yaml (GPT-2 124M, bf16 autocast, TF32, torch.compile, fused
AdamW, SDPA attention) and call the stage functions directly, without Prefect, MLflow or DVC
(the GPU image has none of them; pydantic is carried as wheels):

- `benchmark`: the build-nanogpt keep-the-best grid at batch 16 x 1024, the attention
  micro-benchmark (our Triton FlashAttention against SDPA and plain math) and the cross-entropy
  one (our fused kernel against F.cross_entropy): DIR/benchmark.md, .json and plots.
- `pretrain`: the pretraining loop itself for `--steps` optimizer steps of 64 x 1024 tokens
  (micro-batch 16, 4 accumulation steps) on the given token shards (the quickstart's
  FineWeb-Edu sample, tokenized here by `gptforge prepare pretrain`): DIR/pretrain.json
  (tokens/s and MFU from the stage's own median), DIR/pretrain.csv (the loss curve).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "gpt2-124m-fineweb.yaml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["benchmark", "pretrain"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=REPO / "data" / "pretrain")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()

    import logging

    import torch

    from gptforge.config.load import load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("gpu_stages: error: no CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["tokenizer.path=sample://gpt2_tokenizer", "tracking.enabled=false"]
    if args.stage == "benchmark":
        from gptforge.bench.stage import benchmark

        cfg = load_config(CONFIG, common)
        benchmark(
            cfg,
            metrics_path=args.out / "benchmark.json",
            report_path=args.out / "benchmark.md",
            plots_dir=args.out,
            trace_dir=args.out / "traces",
        )
        return 0
    from gptforge.training.loop import pretrain

    cfg = load_config(
        CONFIG,
        common
        + [
            f"pretrain.max_steps={args.steps}",
            "pretrain.batch_size=16",
            "pretrain.batch_tokens=65536",
            "pretrain.warmup_steps=5",
            "pretrain.eval_interval=10",
            "pretrain.eval_steps=1",
            "pretrain.ckpt_interval=1000",
            "pretrain.hellaswag.source=sample://hellaswag_val_1000.jsonl.gz",
            "pretrain.hellaswag_interval=0",
            "pretrain.sample_interval=0",
            "pretrain.nproc_per_node=1",
        ],
    )
    metrics = pretrain(
        cfg,
        data_dir=args.data,
        out_dir=args.out / "ckpt",
        metrics_path=args.out / "pretrain.json",
        plots_path=args.out / "pretrain.csv",
    )
    print(metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
