"""LoRA instruction fine-tuning on the CPU: gptforge's instruct recipe against transformers' Trainer + peft.

    python benchmarks/bench_lora.py [--steps N] [--repeats 3] [--threads 2] [--warmup 3]
        [--hidden 256 --layers 4 --intermediate 688 --heads 4 --kv-heads 2]
        [--recipes ours,stock,stock_grouped] [--model DIR] [--precision fp32|bf16]
        [--out docs/results/lora_tiny_llama_cpu.json]

The model is a random Llama (transformers' LlamaConfig, default hidden 256, 4 layers,
intermediate 688, 4 heads / 2 KV heads, 256 positions, untied head) with the GPT-2 tokenizer of
tests/hf_models.py (`make_tokenizer`), saved once in a temporary folder; `--model DIR` fine-tunes
a Hugging Face folder instead (checkpoints/base/smollm2), loaded in float32 by the stock recipe (and
by ours, except that its bf16 LoRA keeps the frozen base in bf16). The data are the
package's 1,100 embedded Alpaca records (LLMs-from-scratch ch. 7), shuffled with `--seed` and
split into `--heldout` held-out records and the training records (the first `--steps` x
`--batch-size` of them when `--steps` is given; all 1,000 otherwise), written as jsonl.
Every recipe trains one epoch over exactly those training examples, so all of them take the
same number of optimizer steps on the same real tokens (in their own order).

Recipes (each LoRA r 16, alpha/dropout from params.yaml unless given, on q/k/v/o/gate/up/down
projections, Alpaca template, loss on the response only, AdamW fused, constant lr, no warm-up,
no gradient clipping, `--precision` (fp32, or bf16 autocast), one epoch of `--batch-size`):
- `ours`: `gptforge.finetune.instruct.setup` + `train`, configured from params.yaml with -S
  overrides (init_from the folder, method lora, target_modules auto, group_by_length true,
  mask_prompt true, device cpu, precision as given, tracking off, no evaluation during training);
  its loss runs the output head only at the positions that have a target (`hf_models.lm_loss`),
  and its batches are grouped by length (`common.length_grouped_batches`);
- `stock`: what a user writes with transformers and peft: `get_peft_model` (the same LoraConfig),
  the same token ids (input_ids = prompt + response + eos, labels -100 on the prompt),
  `DataCollatorForSeq2Seq` (pads each batch to its longest row), `Trainer` with its defaults
  except: the same lr, weight decay, constant schedule, `max_grad_norm=0` (ours does not clip),
  `save_strategy="no"`, `report_to=[]`, no eval, `dataloader_num_workers=0`, `use_cpu=True`,
  random order (`train_sampling_strategy="random"`, the default);
- `stock_grouped`: `stock` with `train_sampling_strategy="group_by_length"`, the one switch a
  Trainer user flips to cut padding (transformers' LengthGroupedSampler): how much of the
  difference is padding alone. Its megabatches are min(50, examples / (4 x batch)) batches,
  ours' groups 50 batches: on a short `--steps` run ours sorts over more examples, so the full
  epoch (no `--steps`) is the fairest comparison of the two groupings.

Each run is its own subprocess (this script with `--recipe NAME`), `torch.set_num_threads
(--threads)`, and the runs alternate ours / stock / stock_grouped for `--repeats` rounds, so a
slow spell of the machine hits them alike; the JSON reports medians and every run.

What is measured, per run:
- real tokens/s: a global `torch.optim` step post-hook stamps `time.perf_counter()` after every
  optimizer step of the run's optimizer; the timed window runs from the end of step `--warmup`
  to the end of the last step (the first steps, with their one-off allocations, are left out).
  Real tokens are the positions that predict a next token (len(prompt + response) - 1 per
  example, the count ours logs as `train_tokens`), counted per step for the timed steps. The
  stock rows carry one more position each (the final eos, whose prediction is unused): counted
  as processed, not as real;
- padding fraction: padded positions / positions the model processed, over the whole epoch
  (the stock rows' extra eos position counts as processed, not as padding);
- peak memory: the subprocess's RSS high-water mark during training minus its resident set
  right after the model (with its adapters) and the tokenized data were loaded
  (`rss_after_load_mb`; `peak_while_loading_mb`: loading's own peak). The high-water mark is
  the address space's VmHWM, reset after loading (see `PeakRSS`: `ru_maxrss` inherits the
  parent's peak across fork/exec); `ru_maxrss_mb` is recorded too;
- held-out loss: mean cross-entropy per response token over the held-out split, computed by one
  function (`heldout_loss`: gptforge's `split_loss`, batches of 8 in file order) on both trained
  peft models; `heldout_loss_initial` is the base model's (LoRA starts as the identity), so
  `heldout_loss_drop` is what each run learned: on random weights every loss is near ln 50257,
  and the ratio of the drops is the sharper check that the recipes train alike.
Both recipes start from the same LoRA initialisation (`torch.manual_seed(--seed)` before the
model loads; the JSON records a checksum of the initial adapters) and the same token ids
(digest recorded), and the parent checks that every recipe saw the same number of real tokens.

What the recipes share (the model folder, the splits, the encoding, the held-out loss) is in
lora_common.py, the report (medians, checks, targets, the markdown table) in lora_report.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meters import PeakRSS, StepClock, machine  # noqa: E402
from lora_common import (  # noqa: E402
    ROOT,
    build_model,
    digest,
    encode_split,
    heldout_loss,
    initial_heldout_loss,
    lora_checksum,
    write_splits,
)
from lora_report import TARGET, TARGET_REAL_MODEL, check_same, markdown, model_settings, summarize  # noqa: E402

RECIPES = ("ours", "stock", "stock_grouped")
RESULT_MARK = "BENCH_LORA_RESULT "  # the child's result line (Trainer prints its logs on stdout too)
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------------------------------------
# The recipes (each runs in its own subprocess)


def run_ours(args, model_dir: Path, data_dir: Path) -> dict:
    import torch

    from gptforge.config.load import load_config
    from gptforge.finetune import instruct

    overrides = [
        f"instruct.init_from={model_dir}",
        "instruct.method=lora",
        "instruct.lora.target_modules=auto",
        f"instruct.lora.r={args.lora_r}",
        "instruct.template=alpaca",
        "instruct.mask_prompt=true",
        "instruct.group_by_length=true",
        "tracking.enabled=false",
        "instruct.device=cpu",
        f"instruct.precision={args.precision}",
        "instruct.epochs=1",
        f"instruct.batch_size={args.batch_size}",
        f"instruct.lr={args.lr}",
        f"instruct.weight_decay={args.weight_decay}",
        f"instruct.seed={args.seed}",
        "instruct.eval_interval=1000000000",
        "instruct.eval_batches=1",
        "instruct.gradient_checkpointing=false",
    ]
    if args.lora_alpha is not None:
        overrides.append(f"instruct.lora.alpha={args.lora_alpha}")
    if args.lora_dropout is not None:
        overrides.append(f"instruct.lora.dropout={args.lora_dropout}")
    cfg = load_config(ROOT / "params.yaml", overrides)
    torch.manual_seed(args.seed)  # the adapters' initialisation, as in the stock run
    s = instruct.setup(cfg, data_dir)
    memory = PeakRSS()
    memory.loaded()
    tokenizer = s.enc.tokenizer
    train = encode_split(tokenizer, instruct.read_split(data_dir / "train.jsonl"), s.max_length)
    if s.data["train"] != train:
        raise RuntimeError("bench_lora: ours encoded the training split differently from encode_split")
    heldout = encode_split(tokenizer, instruct.read_split(data_dir / "val.jsonl"), s.max_length)
    init = lora_checksum(s.model)
    clock = StepClock(next(p for p in s.model.parameters() if p.requires_grad), lambda: s.real_tokens)

    t0 = time.perf_counter()
    instruct.train(s, cfg)
    wall = time.perf_counter() - t0
    per_step = [b - a for a, b in zip([0] + clock.tokens[:-1], clock.tokens)]
    timing = clock.window(per_step, args.warmup)
    peak = memory.result()
    t1 = time.perf_counter()
    loss, n = heldout_loss(s.model, heldout, tokenizer.eos_token_id, s.max_length, args.precision)
    eval_s = time.perf_counter() - t1
    lora = cfg.instruct.lora
    return {
        **timing,
        "real_tokens": s.real_tokens,
        "positions": s.real_tokens + s.padded,
        "padding_fraction": round(s.padded / (s.real_tokens + s.padded), 4),
        "train_wall_s": round(wall, 3),
        "final_train_loss": round(s.history.train_loss[-1][1], 4),
        **peak,
        "heldout_loss": round(loss, 5),
        "heldout_tokens": n,
        "heldout_eval_s": round(eval_s, 2),
        "lora_init_checksum": init,
        "data_digest": digest(train),
        "lora": {
            "r": lora.r,
            "alpha": lora.alpha,
            "dropout": lora.dropout,
            "target_modules": sorted(s.model.peft_config["default"].target_modules),
        },
        "trainable_params": sum(p.numel() for p in s.model.parameters() if p.requires_grad),
        "total_params": sum(p.numel() for p in s.model.parameters()),
        "max_length": s.max_length,
    }


def run_stock(args, model_dir: Path, data_dir: Path, grouped: bool) -> dict:
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from gptforge.config.load import load_config
    from gptforge.finetune.instruct import read_split
    from gptforge.finetune.templates import render

    defaults = load_config(ROOT / "params.yaml").instruct.lora  # alpha and dropout as ours reads them
    alpha = args.lora_alpha if args.lora_alpha is not None else defaults.alpha
    dropout = args.lora_dropout if args.lora_dropout is not None else defaults.dropout

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.pad_token = tokenizer.eos_token
    # float32 as ours (transformers 5 would keep a bf16 folder in bf16)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lora_config = peft.LoraConfig(
        r=args.lora_r, lora_alpha=alpha, lora_dropout=dropout, target_modules=LLAMA_LINEARS, task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(model, lora_config)
    max_length = model.config.max_position_embeddings

    def tokenize(record: dict) -> dict:  # the Alpaca prompt, the output, eos; labels only on the response
        prompt, response = render(record, "alpaca")
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return {"input_ids": p + r, "attention_mask": [1] * (len(p) + len(r)), "labels": [-100] * len(p) + r}

    train_records = read_split(data_dir / "train.jsonl")
    features = [tokenize(r) for r in train_records]
    memory = PeakRSS()
    memory.loaded()
    used = [(f["input_ids"][: f["labels"].count(-100)], f["input_ids"][f["labels"].count(-100) :]) for f in features]
    if used != encode_split(tokenizer, train_records, max_length):
        raise RuntimeError("bench_lora: the stock tokenization differs from gptforge's encoding")
    heldout = encode_split(tokenizer, read_split(data_dir / "val.jsonl"), max_length)
    init = lora_checksum(model)

    collator = DataCollatorForSeq2Seq(tokenizer=tokenizer, padding=True, label_pad_token_id=-100)
    real, positions = [], []

    def counting_collator(batch):  # the same collator; records what each batch holds
        out = collator(batch)
        real.append(sum(len(f["input_ids"]) - 1 for f in batch))
        positions.append(out["input_ids"].numel())
        return out

    with tempfile.TemporaryDirectory(prefix="bench_lora_trainer_") as out_dir:
        training_args = TrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=args.batch_size,
            num_train_epochs=1,
            learning_rate=args.lr,
            weight_decay=args.weight_decay,
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim="adamw_torch_fused",
            max_grad_norm=0.0,
            seed=args.seed,
            report_to=[],
            eval_strategy="no",
            save_strategy="no",
            dataloader_num_workers=0,
            use_cpu=True,
            bf16=args.precision == "bf16",
            fp16=False,
            train_sampling_strategy="group_by_length" if grouped else "random",
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=features,
            data_collator=counting_collator,
            processing_class=tokenizer,
        )
        clock = StepClock(next(p for p in model.parameters() if p.requires_grad))
        t0 = time.perf_counter()
        result = trainer.train()
        wall = time.perf_counter() - t0
    steps = len(clock.times)
    timing = clock.window(real[:steps], args.warmup)
    peak = memory.result()
    t1 = time.perf_counter()
    loss, n = heldout_loss(trainer.model, heldout, tokenizer.eos_token_id, max_length, args.precision)
    eval_s = time.perf_counter() - t1
    real_tokens, processed = sum(real[:steps]), sum(positions[:steps])
    padded = processed - sum(len(f["input_ids"]) for f in features)
    return {
        **timing,
        "real_tokens": real_tokens,
        "positions": processed,
        "padding_fraction": round(padded / processed, 4),
        "train_wall_s": round(wall, 3),
        "trainer_train_loss": round(result.training_loss, 4),
        **peak,
        "heldout_loss": round(loss, 5),
        "heldout_tokens": n,
        "heldout_eval_s": round(eval_s, 2),
        "lora_init_checksum": init,
        "data_digest": digest(used),
        "lora": {
            "r": args.lora_r,
            "alpha": alpha,
            "dropout": dropout,
            "target_modules": sorted(model.peft_config["default"].target_modules),
        },
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "total_params": sum(p.numel() for p in model.parameters()),
        "max_length": max_length,
    }


def child(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    model_dir, data_dir = Path(args.model_dir), Path(args.data_dir)
    if args.recipe == "ours":
        result = run_ours(args, model_dir, data_dir)
    else:
        result = run_stock(args, model_dir, data_dir, grouped=args.recipe == "stock_grouped")
    result.update(recipe=args.recipe, threads=torch.get_num_threads())
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The parent: build, run the recipes in turn, report


def child_command(args, recipe: str, model_dir: Path, data_dir: Path) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--recipe",
        recipe,
        "--model-dir",
        str(model_dir),
        "--data-dir",
        str(data_dir),
        "--threads",
        str(args.threads),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        repr(args.lr),
        "--weight-decay",
        repr(args.weight_decay),
        "--lora-r",
        str(args.lora_r),
        "--seed",
        str(args.seed),
        "--precision",
        args.precision,
    ]
    if args.lora_alpha is not None:
        cmd += ["--lora-alpha", repr(args.lora_alpha)]
    if args.lora_dropout is not None:
        cmd += ["--lora-dropout", repr(args.lora_dropout)]
    return cmd


def run_child(cmd: list[str]) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"bench_lora: {' '.join(cmd[2:4])} failed (exit {proc.returncode})")
    return {**json.loads(lines[-1][len(RESULT_MARK) :]), "subprocess_s": round(wall, 2)}


def parent(args) -> int:
    import peft
    import torch
    import transformers

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        raise SystemExit(f"--recipes: choose among {', '.join(RECIPES)}")
    load_before = round(os.getloadavg()[0], 2)
    runs: dict[str, list[dict]] = {r: [] for r in recipes}
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        model_dir = Path(args.model) if args.model else build_model(Path(tmp) / "model", args)
        data_dir = Path(tmp) / "data"
        sizes = write_splits(data_dir, args)
        torch.set_num_threads(args.threads)
        initial = initial_heldout_loss(model_dir, data_dir, args.precision)
        for repeat in range(args.repeats):
            for recipe in recipes:
                r = run_child(child_command(args, recipe, model_dir, data_dir))
                r["repeat"] = repeat + 1
                runs[recipe].append(r)
                print(
                    f"bench_lora: {recipe} run {repeat + 1}: {r['tokens_per_sec']:.0f} real tokens/s, padding "
                    f"{100 * r['padding_fraction']:.1f}%, held-out loss {r['heldout_loss']:.4f}",
                    file=sys.stderr,
                )
    first = next(iter(runs.values()))[0]
    result = {
        "benchmark": "lora_instruct_finetune",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_1min": [load_before, round(os.getloadavg()[0], 2)],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "settings": {
            "model": model_settings(args, model_dir),
            "total_params": first["total_params"],
            "trainable_params": first["trainable_params"],
            "lora": first["lora"],
            "template": "alpaca",
            "mask_prompt": True,
            "batch_size": args.batch_size,
            "steps": first["steps"],
            "warmup_steps": args.warmup,
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "precision": args.precision,
            "threads": args.threads,
            "repeats": args.repeats,
            "seed": args.seed,
            **sizes,
            "timing": "perf_counter after each optimizer step; real tokens/s over the steps after the first "
            f"{args.warmup}; medians over the repeats",
        },
        "heldout_loss_initial": initial,
        "recipes": summarize(runs, initial),
        "same_real_tokens": check_same(runs, "real_tokens"),
        "same_data": check_same(runs, "data_digest"),
        "same_lora_init": check_same(runs, "lora_init_checksum"),
        "same_lora_config": check_same(runs, "lora"),
        "command": "python benchmarks/bench_lora.py " + " ".join(sys.argv[1:]),
    }
    med = {name: r["median"] for name, r in result["recipes"].items()}
    if "ours" in med and "stock" in med:
        result["speedup"] = round(med["ours"]["tokens_per_sec"] / med["stock"]["tokens_per_sec"], 3)
        result["heldout_loss_ratio"] = round(med["ours"]["heldout_loss"] / med["stock"]["heldout_loss"], 4)
        result["heldout_loss_drop_ratio"] = round(
            med["ours"]["heldout_loss_drop"] / med["stock"]["heldout_loss_drop"], 4
        )
        target = TARGET_REAL_MODEL if args.model else TARGET
        result["target"] = target
        result["target_met"] = bool(
            result["speedup"] >= target["speedup_min"]
            and abs(result["heldout_loss_ratio"] - 1) <= target["heldout_loss_rel_diff_max"]
        )
    if "ours" in med and "stock_grouped" in med:
        result["speedup_vs_stock_grouped"] = round(
            med["ours"]["tokens_per_sec"] / med["stock_grouped"]["tokens_per_sec"], 3
        )
        result["heldout_loss_ratio_vs_stock_grouped"] = round(
            med["ours"]["heldout_loss"] / med["stock_grouped"]["heldout_loss"], 4
        )
    if not (result["same_real_tokens"] and result["same_data"] and result["same_lora_config"]):
        raise SystemExit(
            "bench_lora: the recipes did not train on the same tokens with the same LoRA config: "
            + json.dumps({k: result[k] for k in ("same_real_tokens", "same_data", "same_lora_config")})
        )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
        out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train on steps x batch-size records (default: all 1,000 training records, 125 steps)",
    )
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing (at least 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=None, help="default: params.yaml's instruct.lora.alpha")
    ap.add_argument("--lora-dropout", type=float, default=None, help="default: params.yaml's instruct.lora.dropout")
    ap.add_argument("--heldout", type=int, default=100, help="held-out records (of 1,100)")
    ap.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a Hugging Face Llama-family folder to fine-tune (checkpoints/base/smollm2) instead of "
        "the random Llama of --hidden ... --positions",
    )
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="both recipes: fp32, or bf16 autocast (Trainer's bf16=True on a float32 model; ours "
        "keeps the frozen base in bf16, as its LoRA runs do)",
    )
    ap.add_argument("--out", default=None, help="also write this JSON and a markdown table next to it (.md)")
    ap.add_argument("--recipe", choices=RECIPES, default=None, help=argparse.SUPPRESS)  # a child run
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warmup < 1:
        ap.error("--warmup must be at least 1")
    if args.recipe is not None:
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
