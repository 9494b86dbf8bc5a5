"""Continued pretraining of SmolLM2-135M in gptforge's own loop (issue 48's check): the packaged
SmolLM2-135M-Instruct GGUF (`make install` brings it) made a Hugging Face folder by `prepare
base`'s own function, the quickstart's FineWeb-Edu sample tokenized with SmolLM2's tokenizer
(`tokenizer.path` = that folder), and `gptforge pretrain -S pretrain.init_from=<folder>`: the
folder becomes an `arch: llama` GPT (30 layers, 9 query and 3 key/value heads, tied head).

Checked and written to docs/results/continue_smollm2.json:
- the loss of our model on the loader's first batch against transformers' LlamaForCausalLM of
  the same folder on the same batch (float32, cross-entropy over the same targets), and the
  run's own step-0 train loss against that reference (issue: within 1e-4);
- the validation loss (the same first eval_steps batches each time) at step 0 and after 50 steps
  of AdamW at lr 1e-4 (issue: it falls), and the whole split after the last step.

Run (about 5 minutes on 2 CPU cores, most of it the 50 steps):
    .venv/bin/python benchmarks/check_continue_smollm2.py [--steps 50] [--keep]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe, git  # noqa: E402

SOURCE = "packaged://smollm2-135m-instruct"
OUT = ROOT / "docs" / "results" / "continue_smollm2.json"


def overrides(folder: Path, steps: int) -> list[str]:
    return [
        f"tokenizer.path={folder}",
        "tracking.enabled=false",
        f"pretrain.init_from={folder}",
        "model.block_size=128",
        "pretrain.batch_size=4",
        "pretrain.batch_tokens=512",
        f"pretrain.max_steps={steps}",
        "pretrain.lr=0.0001",
        "pretrain.min_lr=0.00001",
        "pretrain.warmup_steps=5",
        "pretrain.eval_interval=10",
        "pretrain.eval_steps=5",
        f"pretrain.ckpt_interval={steps}",
        "pretrain.precision=fp32",
        "pretrain.compile=false",
        "pretrain.sample_tokens=16",
    ]


def run(cmd: list[str], cwd: Path, log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(
            [str(BIN / cmd[0]), *cmd[1:]], cwd=cwd, env={**os.environ, "GPTFORGE_PREFECT": "0"}, stdout=f, stderr=f
        )
    if done.returncode != 0:
        sys.exit(f"check_continue_smollm2: {' '.join(cmd[:3])} failed; its log: {log}")
    return time.perf_counter() - t0


def first_batch_losses(cfg, data_dir: Path, folder: Path) -> dict:
    """Our model's and transformers' loss on the first batch the run's loader gives."""
    import torch
    from transformers import LlamaForCausalLM

    from gptforge.training import loop

    with tempfile.TemporaryDirectory() as out:
        s = loop.setup(cfg, data_dir, out)
        x, y = s.train_loader.next_batch(s.rt.device)
        with torch.no_grad():
            ours = s.raw_model.eval()(x, y)[1].item()
        config = s.raw_model.config
    hf = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(x).logits
        ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    shape = dict(n_layer=config.n_layer, n_head=config.n_head, n_kv_head=config.n_kv_head, n_embd=config.n_embd)
    return {"ours": ours, "transformers": ref, "arch": config.arch, **shape, "tokens": int(y.numel())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    from gptforge.config.load import load_config
    from gptforge.data.base_models import fetch

    work = Path(tempfile.mkdtemp(prefix="continue_smollm2_"))
    try:
        folder = work / "checkpoints" / "base" / "smollm2"
        t0 = time.perf_counter()
        fetch(SOURCE, folder, param="base.models.smollm2")
        fetch_s = time.perf_counter() - t0
        params = str(ROOT / "params.yaml")
        over = overrides(folder, args.steps)
        prep = ["gptforge", "prepare", "pretrain", "--params", params, f"-S=tokenizer.path={folder}"]
        prep += ["-S=tracking.enabled=false"]
        prepare_s = run(prep, work, work / "prepare.log")
        manifest = json.loads((work / "data" / "pretrain" / "manifest.json").read_text())
        cfg = load_config(params, over)
        first = first_batch_losses(cfg, work / "data" / "pretrain", folder)
        train = ["gptforge", "pretrain", "--params", params, *(f"-S={o}" for o in over)]
        train_s = run(train, work, work / "pretrain.log")
        with open(work / "plots" / "pretrain.csv") as f:
            rows = list(csv.DictReader(f))
        val = {int(r["step"]): float(r["val_loss"]) for r in rows if r["val_loss"] and r["train_loss"]}
        whole = [float(r["val_loss"]) for r in rows if r["val_loss"] and not r["train_loss"]]
        step0 = float(rows[0]["train_loss"])
    finally:
        if args.keep:
            print(f"work folder kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    last = max(val)
    result = {
        "check": "continue_smollm2",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": describe(),
        "commit": git("rev-parse", "--short", "HEAD"),
        "source": SOURCE,
        "model": {k: first[k] for k in ("arch", "n_layer", "n_head", "n_kv_head", "n_embd")},
        "data": {"tokenizer": manifest.get("tokenizer"), "tokens": manifest.get("tokens")},
        "commands": [" ".join(prep), "gptforge pretrain --params params.yaml " + " ".join(f"-S {o}" for o in over)],
        "first_batch": {
            "tokens": first["tokens"],
            "loss_ours": first["ours"],
            "loss_transformers": first["transformers"],
            "abs_difference": abs(first["ours"] - first["transformers"]),
            "run_step0_train_loss": step0,
            "run_step0_abs_difference": abs(step0 - first["transformers"]),
        },
        "val_loss_first_eval_steps_batches": val,
        "val_loss_falls": val[last] < val[0],
        "val_loss_whole_split_after_last_step": whole[-1] if whole else None,
        "seconds": {"fetch": round(fetch_s, 1), "prepare": round(prepare_s, 1), "pretrain": round(train_s, 1)},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    fb = result["first_batch"]
    print(
        f"first batch ({fb['tokens']} tokens): ours {fb['loss_ours']:.6f}, "
        f"transformers {fb['loss_transformers']:.6f} (|diff| {fb['abs_difference']:.2e}); "
        f"the run's step 0 {step0:.6f} (|diff| {fb['run_step0_abs_difference']:.2e})"
    )
    print(f"val loss (first batches): step 0 {val[0]:.4f} -> step {last} {val[last]:.4f}; whole split {whole}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
