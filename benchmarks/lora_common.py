"""What every recipe of bench_lora.py shares: the model folder (a random Llama with the GPT-2
tokenizer), the train/held-out splits of the embedded Alpaca records, gptforge's encoding of them,
and the held-out loss both trained models are scored with (and the LoRA checksum of their start).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = "sample://instruction-data.json.gz"


def build_model(folder: Path, args) -> Path:
    """A random Llama of the requested shape with the GPT-2 tokenizer (tests/hf_models.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("_bench_hf_models", ROOT / "tests" / "hf_models.py")
    hf_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_models)
    config = LlamaConfig(
        vocab_size=50257,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.positions,
        bos_token_id=50256,
        eos_token_id=50256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    folder.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    hf_models.make_tokenizer(folder)
    return folder


def write_splits(data_dir: Path, args) -> dict:
    """train/val/test jsonl from the embedded records: `--heldout` shuffled records are the
    held-out split (val), the next `--steps` x `--batch-size` (all the rest
    without `--steps`) the training split."""
    from gptforge.data.sources import read_records
    from gptforge.samples import resolve

    records = [
        {"instruction": r["instruction"], "input": r.get("input") or "", "output": r["output"]}
        for r in read_records(resolve(SAMPLE), param="bench_lora")
    ]
    random.Random(args.seed).shuffle(records)
    heldout, train = records[: args.heldout], records[args.heldout :]
    if args.steps is not None:
        if args.steps * args.batch_size > len(train):
            raise SystemExit(
                f"--steps {args.steps} x --batch-size {args.batch_size} is more than the {len(train)} training records"
            )
        train = train[: args.steps * args.batch_size]
    data_dir.mkdir(parents=True, exist_ok=True)
    # test: a few records only, which `setup` wants and nothing here uses
    for name, recs in (("train", train), ("val", heldout), ("test", heldout[:8])):
        with open(data_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
    return {"train_records": len(train), "heldout_records": len(heldout)}


def encode_split(tokenizer, records, max_length: int):
    """gptforge's encoding (Alpaca template, response + eos) of `records`; every one must fit
    whole, so that no recipe truncates."""
    from gptforge.finetune.templates import encode_all
    from gptforge.modeling.hf_causal import HFTokenizer

    examples, kept = encode_all(records, "alpaca", HFTokenizer(tokenizer), max_length)
    longest = max(len(p) + len(r) for p, r in examples)
    if len(kept) != len(records) or longest > max_length:
        raise SystemExit(
            f"bench_lora: an example does not fit {max_length} positions (longest {longest}); raise --positions"
        )
    return examples


def digest(examples) -> str:
    """A short hash of (prompt ids, response ids) pairs in order."""
    return hashlib.sha256(json.dumps([[list(p), list(r)] for p, r in examples]).encode()).hexdigest()[:16]


def heldout_loss(model, examples, pad_id: int, max_length: int, precision: str) -> tuple[float, int]:
    """(mean cross-entropy per response token, response tokens) over `examples`: the one
    function both trained models are scored with (gptforge's split_loss, batches of 8 in order,
    under the runs' autocast `precision`)."""
    from gptforge.finetune.common import runtime
    from gptforge.finetune.instruct import split_loss

    loss = split_loss(
        model,
        examples,
        batch_size=8,
        pad_id=pad_id,
        max_length=max_length,
        mask_prompt=True,
        rt=runtime("cpu", precision, param="bench_lora"),
    )
    return loss, sum(len(r) for _, r in examples)


def initial_heldout_loss(model_dir: Path, data_dir: Path, precision: str) -> float:
    """The held-out loss before training: the base model's (LoRA starts with B = 0, so the
    adapted model computes the base model's function)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptforge.finetune.instruct import read_split

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    max_length = model.config.max_position_embeddings
    heldout = encode_split(tokenizer, read_split(data_dir / "val.jsonl"), max_length)
    return round(heldout_loss(model, heldout, tokenizer.eos_token_id, max_length, precision)[0], 5)


def lora_checksum(model) -> float:
    """Sum of |w| over the LoRA A matrices: equal when two runs start from the same adapters."""
    return round(float(sum(p.detach().abs().sum() for n, p in model.named_parameters() if "lora_A" in n)), 4)
