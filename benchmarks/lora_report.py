"""The parent's report of bench_lora.py: the model's shape for the JSON, the medians over the
repeats, the checks that every run trained alike, the targets, and the markdown table written next
to the JSON (`--out`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

# The goals: on the random tiny Llama (Python overhead dominates) and on a real folder (--model:
# SmolLM2-135M, where the matrix products do and the loss must agree more closely).
TARGET = {"speedup_min": 1.3, "heldout_loss_rel_diff_max": 0.02}
TARGET_REAL_MODEL = {"speedup_min": 1.5, "heldout_loss_rel_diff_max": 0.01}


def model_settings(args, model_dir: Path) -> dict:
    """The model's shape for the JSON: the random Llama's flags, or the folder's config."""
    if not args.model:
        return {
            "arch": "llama",
            "hidden": args.hidden,
            "layers": args.layers,
            "intermediate": args.intermediate,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "positions": args.positions,
            "vocab": 50257,
        }
    cfg = json.loads((model_dir / "config.json").read_text())
    return {
        "folder": args.model,
        "arch": cfg.get("model_type"),
        "hidden": cfg.get("hidden_size"),
        "layers": cfg.get("num_hidden_layers"),
        "intermediate": cfg.get("intermediate_size"),
        "heads": cfg.get("num_attention_heads"),
        "kv_heads": cfg.get("num_key_value_heads"),
        "vocab": cfg.get("vocab_size"),
        "saved_dtype": cfg.get("dtype") or cfg.get("torch_dtype"),
        "trained_in": f"{args.precision} (both recipes)",
    }


MEDIAN_KEYS = (
    "tokens_per_sec",
    "padding_fraction",
    "peak_rss_growth_mb",
    "peak_rss_mb",
    "heldout_loss",
    "timed_s",
    "train_wall_s",
)


def summarize(runs: dict[str, list[dict]], initial: float) -> dict:
    out = {}
    for name, rs in runs.items():
        median = {k: round(statistics.median(r[k] for r in rs), 5) for k in MEDIAN_KEYS}
        median["heldout_loss_drop"] = round(initial - median["heldout_loss"], 5)
        out[name] = {"median": median, "real_tokens": rs[0]["real_tokens"], "steps": rs[0]["steps"], "runs": rs}
    return out


def check_same(runs: dict[str, list[dict]], key: str) -> bool:
    return len({json.dumps(r[key], sort_keys=True) for rs in runs.values() for r in rs}) == 1


def model_words(model: dict) -> str:
    """How the report names the model: the folder it was read from, or the random Llama."""
    if model.get("folder"):
        return f"`{model['folder']}` ({model['arch']}, saved in {model.get('saved_dtype')})"
    return "random Llama with the GPT-2 tokenizer"


def markdown(result: dict) -> str:
    s, rec = result["settings"], result["recipes"]
    lines = [
        "# LoRA fine-tuning on the CPU: gptforge's instruct recipe vs transformers Trainer + peft",
        "",
        f"- date: {result['date']}; machine: {result['machine']['cpu']}, {result['machine']['cores']} cores "
        f"({result['machine']['arch']}); load average (1 min) before/after: {result['load_average_1min']}",
        f"- torch {result['torch']}, transformers {result['transformers']}, peft {result['peft']}; "
        f"{s['threads']} threads per run",
        f"- model: {model_words(s['model'])}, hidden {s['model']['hidden']}, {s['model']['layers']} layers, "
        f"intermediate {s['model']['intermediate']}, {s['model']['heads']} heads / {s['model']['kv_heads']} KV heads, "
        f"vocab {s['model']['vocab']}, {s['total_params'] / 1e6:.1f}M parameters, "
        f"{s['trainable_params'] / 1e6:.2f}M LoRA",
        f"- LoRA r {s['lora']['r']}, alpha {s['lora']['alpha']}, dropout {s['lora']['dropout']} on "
        f"{', '.join(s['lora']['target_modules'])}; Alpaca template, loss on the response; AdamW (fused) lr {s['lr']}, "
        f"weight decay {s['weight_decay']}, constant, no clipping; {s.get('precision', 'fp32')}",
        f"- data: {s['train_records']} training records of LLMs-from-scratch ch. 7 (1 epoch, batch {s['batch_size']}, "
        f"{s['steps']} steps), {s['heldout_records']} held out; {s['repeats']} runs per recipe, alternating; "
        f"tokens/s over steps {s['warmup_steps'] + 1}-{s['steps']}",
        "",
        f"Held-out loss before training: {result['heldout_loss_initial']:.4f}"
        + ("" if s["model"].get("folder") else " (random weights: about ln 50257 = 10.82)")
        + "; the drop is what the adapters learned.",
        "",
        "| recipe | real tokens/s (median) | vs stock | padding | peak RSS growth (MB) | held-out loss | loss drop "
        "| real tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = rec["stock"]["median"]["tokens_per_sec"] if "stock" in rec else None
    for name, r in rec.items():
        m = r["median"]
        vs = f"{m['tokens_per_sec'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {m['tokens_per_sec']:.0f} | {vs} | {100 * m['padding_fraction']:.1f}% | "
            f"{m['peak_rss_growth_mb']:.0f} | {m['heldout_loss']:.4f} | {m['heldout_loss_drop']:.4f} | "
            f"{r['real_tokens']} |"
        )
    lines += [
        "",
        f"Speedup (ours / stock real tokens/s): {result.get('speedup')}; held-out loss ratio (ours / stock): "
        f"{result.get('heldout_loss_ratio')} (ratio of the drops: {result.get('heldout_loss_drop_ratio')}); "
        f"same real tokens in every run: {result['same_real_tokens']}; "
        f"target (>= {result.get('target', TARGET)['speedup_min']}x, loss within "
        f"{100 * result.get('target', TARGET)['heldout_loss_rel_diff_max']:.0f}%) "
        f"met: {result.get('target_met')}.",
        "",
    ]
    if "stock_grouped" in rec:
        lines += [
            f'`stock_grouped` is the stock recipe with `train_sampling_strategy="group_by_length"`: ours / '
            f"stock_grouped = {result.get('speedup_vs_stock_grouped')}.",
            "",
        ]
    lines += [f"Command: `{result['command']}`", ""]
    return "\n".join(lines)
