"""Instruction fine-tuning: templates, batching, the recipe (full and LoRA) and its bad inputs.

The model is tiny (2 layers, 32 wide, 64 positions) over the 281-token test tokenizer, so the
Phi-3 template (~40 prompt tokens here) fits its window and Alpaca's (~130) does not: the
recipe runs use Phi-3, the Alpaca strings are checked as text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from fixture_data import FakeRun

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.finetune import instruct as I
from gptforge.finetune.templates import collate, encode, encode_all, render
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.hf_convert import to_hf
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.modeling.weights import load_model, save_model

E = 50256  # GPT-2's <|endoftext|>, the pad id in the hand-computed batches

# ---------------------------------------------------------------------------------------------
# Templates


def test_alpaca_template_with_and_without_input():
    prompt, response = render({"instruction": "Name a color.", "input": "sky", "output": "Blue."}, "alpaca")
    assert prompt == (
        "Below is an instruction that describes a task, paired with an input that provides further "
        "context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nName a color.\n\n### Input:\nsky\n\n### Response:\n"
    )
    assert response == "Blue."
    prompt, response = render({"instruction": "Name a color.", "input": "", "output": "Red."}, "alpaca")
    assert prompt == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nName a color.\n\n### Response:\n"
    )
    assert response == "Red."


def test_phi3_template_with_and_without_input():
    prompt, _ = render({"instruction": "Name a color.", "input": "sky", "output": "Blue."}, "phi3")
    assert prompt == "<|user|>\nName a color.\n\nsky<|end|>\n<|assistant|>\n"
    prompt, response = render({"instruction": "Name a color.", "input": "", "output": "Red."}, "phi3")
    assert prompt == "<|user|>\nName a color.<|end|>\n<|assistant|>\n"
    assert response == "Red."


def test_unknown_template_is_bad_input():
    with pytest.raises(BadInput, match=r"unknown template 'chatml'; choose one of alpaca, phi3"):
        render({"instruction": "x", "input": "", "output": "y"}, "chatml")


def test_encode_appends_eot_as_an_id_and_never_reads_it_from_text(small_tokenizer):
    enc = load_tokenizer(str(small_tokenizer))
    ex = {"instruction": "Say <|endoftext|> twice.", "input": "", "output": "ok <|endoftext|>"}
    prompt_ids, response_ids = encode(ex, "phi3", enc)
    assert response_ids[-1] == enc.eot_token == 280
    # The string in the data is plain text: eot occurs exactly once, as the response's end.
    assert enc.eot_token not in prompt_ids and enc.eot_token not in response_ids[:-1]
    assert enc.decode(prompt_ids) == render(ex, "phi3")[0]
    assert enc.decode(response_ids[:-1]) == "ok <|endoftext|>"


# ---------------------------------------------------------------------------------------------
# Collate: hand-computed batches

# Row A: prompt [1, 2, 3], response [4, 5, E] -> seq 1 2 3 4 5 E (6 tokens, 5 positions)
# Row B: prompt [6, 7],    response [8, E]    -> seq 6 7 8 E     (4 tokens, 3 positions)
BATCH = [([1, 2, 3], [4, 5, E]), ([6, 7], [8, E])]
X = -100


def test_collate_pads_and_keeps_each_rows_eot_target():
    inputs, targets = collate(BATCH, pad_id=E, max_length=64, mask_prompt=False)
    assert inputs.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, E, E]]
    # Row B's eot target stays (the model learns to stop); only the padding after it is ignored.
    assert targets.tolist() == [[2, 3, 4, 5, E], [7, 8, E, X, X]]
    assert inputs.dtype == targets.dtype == torch.long


def test_collate_mask_prompt_ignores_targets_that_predict_prompt_tokens():
    _, targets = collate(BATCH, pad_id=E, max_length=64, mask_prompt=True)
    # A: targets 0..1 predict prompt tokens 2, 3; target 2 (after the last prompt token) is the answer.
    assert targets.tolist() == [[X, X, 4, 5, E], [X, 8, E, X, X]]


def test_collate_truncates_rows_after_building():
    inputs, targets = collate(BATCH, pad_id=E, max_length=3, mask_prompt=False)
    assert inputs.tolist() == [[1, 2, 3], [6, 7, 8]]
    assert targets.tolist() == [[2, 3, 4], [7, 8, E]]
    inputs, targets = collate(BATCH, pad_id=E, max_length=2, mask_prompt=True)
    assert inputs.tolist() == [[1, 2], [6, 7]]
    assert targets.tolist() == [[X, X], [X, 8]]


def raschka_collate(batch, pad_token_id=E, ignore_index=-100, allowed_max_length=None):
    """LLMs-from-scratch ch. 7 `custom_collate_fn` (token lists without the eot), transcribed."""
    batch_max_length = max(len(item) + 1 for item in batch)
    inputs_lst, targets_lst = [], []
    for item in batch:
        new_item = item.copy() + [pad_token_id]
        padded = new_item + [pad_token_id] * (batch_max_length - len(new_item))
        inputs, targets = torch.tensor(padded[:-1]), torch.tensor(padded[1:])
        indices = torch.nonzero(targets == pad_token_id).squeeze()
        if indices.numel() > 1:
            targets[indices[1:]] = ignore_index
        if allowed_max_length is not None:
            inputs, targets = inputs[:allowed_max_length], targets[:allowed_max_length]
        inputs_lst.append(inputs)
        targets_lst.append(targets)
    return torch.stack(inputs_lst), torch.stack(targets_lst)


@pytest.mark.parametrize("max_length", [None, 7])
def test_collate_equals_llms_from_scratch(max_length):
    rng = random.Random(0)
    for _ in range(20):
        rows = [[rng.randrange(100) for _ in range(rng.randint(2, 12))] for _ in range(rng.randint(1, 5))]
        # Our rows: any split into prompt/response, the response ending in eot.
        ours = []
        for r in rows:
            cut = rng.randint(1, len(r) - 1)
            ours.append((r[:cut], r[cut:] + [E]))
        got = collate(ours, pad_id=E, max_length=max_length or 10**6, mask_prompt=False)
        want = raschka_collate(rows, allowed_max_length=max_length)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_prompts_that_fill_max_length_are_skipped_and_counted(small_tokenizer):
    enc = load_tokenizer(str(small_tokenizer))
    records = [
        {"instruction": "Hi.", "input": "", "output": "Yo."},
        {"instruction": "x" * 200, "input": "", "output": "long"},
        {"instruction": "Bye.", "input": "", "output": "Ok."},
    ]
    limit = max(len(encode(r, "phi3", enc)[0]) for r in (records[0], records[2])) + 1  # 2 is 200 bytes longer
    examples, kept = encode_all(records, "phi3", enc, limit)
    assert kept == [0, 2] and len(examples) == 2
    # A prompt of exactly max_length tokens is skipped too: its answer would start outside the window.
    exact = len(encode(records[0], "phi3", enc)[0])
    assert encode_all(records[:1], "phi3", enc, exact) == ([], [])
    assert encode_all(records[:1], "phi3", enc, exact + 1)[1] == [0]


# ---------------------------------------------------------------------------------------------
# The recipe

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=320, n_vocab=281, dropout=0.0)
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "sea", "hat"]


def records(n: int, offset: int = 0) -> list[dict]:
    """Short Phi-3-sized tasks with a learnable answer: repeat the word (twice with an input)."""
    out = []
    for i in range(offset, offset + n):
        w = WORDS[i % len(WORDS)]
        if i % 2:
            out.append({"instruction": f"Say {w}.", "input": "", "output": w})
        else:
            out.append({"instruction": "Say it twice.", "input": w, "output": f"{w} {w}"})
    return out


def write_jsonl(path: Path, recs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")


@pytest.fixture
def workspace(tmp_path, small_tokenizer):
    """A saved tiny base model and a 40-record dataset (32 train + 3 too long, 4 val, 4 test)."""
    torch.manual_seed(0)
    save_model(GPT(TINY), tmp_path / "base")
    long = [{"instruction": "Please " * 20, "input": "", "output": "no"} for _ in range(3)]
    write_jsonl(tmp_path / "data" / "train.jsonl", records(32) + long)
    write_jsonl(tmp_path / "data" / "val.jsonl", records(4, 100))
    write_jsonl(tmp_path / "data" / "test.jsonl", records(4, 205))
    return tmp_path


def make_cfg(ws: Path, small_tokenizer, *extra: str):
    return load_config(
        None,
        [
            f"tokenizer.path={small_tokenizer}",
            f"instruct.init_from={ws / 'base'}",
            "instruct.template=phi3",
            "instruct.device=cpu",
            "instruct.precision=fp32",
            "instruct.batch_size=8",
            "instruct.epochs=3",
            "instruct.lr=0.003",
            "instruct.eval_interval=4",
            "instruct.eval_batches=1",
            "instruct.n_responses=3",
            "instruct.max_new_tokens=8",
            *extra,
        ],
    )


def run_recipe(ws: Path, cfg, run=None, **kw) -> dict:
    return I.finetune_instruct(
        cfg,
        run=run or FakeRun(),
        data_dir=ws / "data",
        out_dir=ws / "ckpt",
        metrics_path=ws / "metrics.json",
        responses_path=ws / "responses.jsonl",
        **kw,
    )


def base_val_loss(ws: Path, small_tokenizer, cfg) -> float:
    enc = load_tokenizer(str(small_tokenizer))
    val, _ = encode_all(I.read_split(ws / "data" / "val.jsonl"), "phi3", enc, 64)
    rt = I.runtime("cpu", "fp32", param="instruct")
    return I.split_loss(
        load_model(ws / "base"), val, batch_size=8, pad_id=enc.eot_token, max_length=64, mask_prompt=False, rt=rt
    )


def forced(token: int) -> GPT:
    """A tiny GPT whose greedy choice is always `token`: ln_f outputs that token's embedding."""
    model = GPT(TINY)
    with torch.no_grad():
        wte = model.transformer.wte.weight
        wte[token] *= 10
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(wte[token])
    return model.eval()


def test_responses_stop_at_eot_and_stay_inside_the_window(small_tokenizer):
    enc = load_tokenizer(str(small_tokenizer))
    rt = I.runtime("cpu", "fp32", param="instruct")
    short, long = ([1, 2, 3], [E]), ([5] * 60, [E])
    texts, tokens_per_sec = I.respond(forced(enc.eot_token), [short, long], enc=enc, max_new_tokens=8, rt=rt)
    assert texts == ["", ""] and tokens_per_sec > 0  # the eot ends the answer and is not part of its text
    # Without an eot the answer runs to max_new_tokens, or to the end of the 64 positions.
    texts, _ = I.respond(forced(ord("a")), [short, long], enc=enc, max_new_tokens=8, rt=rt)
    assert texts == ["a" * 8, "a" * 4]


def test_full_finetuning_lowers_val_loss_and_writes_everything(workspace, small_tokenizer):
    ws = workspace
    cfg = make_cfg(ws, small_tokenizer, "instruct.method=full")
    run = FakeRun()
    metrics = run_recipe(ws, cfg, run)

    assert set(metrics) >= {
        "val_loss",
        "test_loss",
        "val_perplexity",
        "response_tokens_per_sec",
        "trainable_params",
        "skipped_too_long",
    }
    assert json.loads((ws / "metrics.json").read_text()) == pytest.approx(metrics)
    before = base_val_loss(ws, small_tokenizer, cfg)
    assert metrics["val_loss"] < before - 1.0, (before, metrics["val_loss"])
    assert metrics["val_perplexity"] == pytest.approx(torch.tensor(metrics["val_loss"]).exp().item(), rel=1e-6)
    assert metrics["skipped_too_long"] == 3
    assert metrics["trainable_params"] == load_model(ws / "base").num_params(non_embedding=False)
    assert metrics["response_tokens_per_sec"] > 0

    lines = (ws / "responses.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(x) for x in lines]
    assert len(rows) == 3
    test = records(4, 205)
    for row, rec in zip(rows, test):
        assert set(row) == {"instruction", "input", "reference", "response"}
        assert (row["instruction"], row["input"], row["reference"]) == (rec["instruction"], rec["input"], rec["output"])
        assert isinstance(row["response"], str) and "<|endoftext|>" not in row["response"]

    # Logged per step: train loss every step (35 - 3 skipped = 32 examples, 4 batches, 3 epochs),
    # validation loss and perplexity every 4 steps.
    train_losses = [m["train_loss"] for m in run.metrics if "train_loss" in m]
    assert len(train_losses) == 12
    evals = [m for m in run.metrics if "val_perplexity" in m and "epoch" in m]
    assert len(evals) == 3 and evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert {p.name for p in run.artifacts} >= {"responses.jsonl", "metrics.json", "final"}

    final = load_model(ws / "ckpt" / "final")
    assert final.config == TINY
    assert not (ws / "ckpt" / "adapter").exists()


# peft says so when it loads the adapter onto HF's Conv1D: the switch this test checks.
@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False")
@pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)  # peft meets transformers 5
def test_lora_trains_only_adapters_and_the_adapter_loads_in_hugging_face(workspace, small_tokenizer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ws = workspace
    cfg = make_cfg(
        ws,
        small_tokenizer,
        "instruct.method=lora",
        "instruct.lora.r=4",
        "instruct.lora.alpha=8",
        "instruct.lr=0.01",
        "instruct.epochs=2",
    )
    run = FakeRun()
    session = I.setup(cfg, ws / "data", run)
    before = {k: v.detach().clone() for k, v in session.model.named_parameters()}
    session = I.train(session, cfg, run)
    after = dict(session.model.named_parameters())
    lora = [k for k in before if "lora_" in k]
    assert lora and all(k.endswith(("lora_A.default.weight", "lora_B.default.weight")) for k in lora)
    for k in before:
        if "lora_" in k:
            assert not torch.equal(before[k], after[k]), f"{k} did not train"
        else:
            assert torch.equal(before[k], after[k]), f"base weight {k} changed"

    # r * (in + out) per adapted Linear: c_attn 32->96, attn.c_proj 32->32, c_fc 32->128, mlp.c_proj 128->32.
    expected = TINY.n_layer * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))
    logged = [m for m in run.metrics if "trainable_params" in m]
    assert logged and logged[0]["trainable_params"] == expected

    x = torch.randint(0, TINY.n_vocab, (2, 20), generator=torch.Generator().manual_seed(1))
    session.model.eval()
    with torch.no_grad():
        adapter_logits = session.model(x)[0][..., : TINY.n_vocab].clone()
    metrics = I.finish(session, cfg, run, ws / "ckpt", ws / "metrics.json", ws / "responses.jsonl")
    assert metrics["trainable_params"] == expected and metrics["skipped_too_long"] == 3

    # The merged checkpoint gives the adapter model's logits.
    merged = load_model(ws / "ckpt" / "final").eval()
    with torch.no_grad():
        merged_logits = merged(x)[0][..., : TINY.n_vocab]
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-5, rtol=0)
    # Only the adapted matrices differ from the base: embeddings, LayerNorms and biases are bitwise equal.
    base_state = load_model(ws / "base").state_dict()
    for k, v in merged.state_dict().items():
        adapted = k.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight"))
        assert torch.equal(v, base_state[k]) != adapted, k

    adapter_dir = ws / "ckpt" / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter_dir.iterdir()}
    # peft's own loader on our GPT ...
    ours = PeftModel.from_pretrained(load_model(ws / "base"), str(adapter_dir)).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0][..., : TINY.n_vocab], adapter_logits, atol=1e-5, rtol=0)
    # ... and on Hugging Face's GPT-2 made from the same base (export_hf's model half: the test
    # tokenizer is a .tiktoken file, not the encoder.json/vocab.bpe folder export needs).
    to_hf(load_model(ws / "base")).save_pretrained(tmp_path / "hf_base")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_base")
    hf_lora = PeftModel.from_pretrained(hf, str(adapter_dir)).eval()
    # HF's GPT-2 uses Conv1D (weights stored in x out): peft must have switched fan_in_fan_out on.
    assert hf_lora.peft_config["default"].fan_in_fan_out is True
    with torch.no_grad():
        torch.testing.assert_close(hf_lora(x).logits, adapter_logits, atol=1e-4, rtol=0)
    assert {p.name for p in run.artifacts} >= {"adapter", "final"}


# ---------------------------------------------------------------------------------------------
# Bad inputs


def test_empty_split_is_bad_input_naming_it(workspace, small_tokenizer):
    (workspace / "data" / "val.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(BadInput, match=r"val\.jsonl has no examples"):
        run_recipe(workspace, make_cfg(workspace, small_tokenizer))


def test_missing_split_is_bad_input_naming_it(workspace, small_tokenizer):
    (workspace / "data" / "test.jsonl").unlink()
    with pytest.raises(BadInput, match=r"test\.jsonl not found; run `gptforge prepare instruct` first"):
        run_recipe(workspace, make_cfg(workspace, small_tokenizer))


def test_max_length_above_the_models_positions_is_bad_input(workspace, small_tokenizer):
    cfg = make_cfg(workspace, small_tokenizer, "instruct.max_length=65")
    with pytest.raises(BadInput, match=r"instruct\.max_length \(65\) is above the model's 64 positions"):
        run_recipe(workspace, cfg)


def test_a_split_with_no_prompt_that_fits_is_bad_input(workspace, small_tokenizer):
    # Alpaca's preamble alone is ~130 tokens of the test tokenizer: nothing fits 64 positions.
    cfg = make_cfg(workspace, small_tokenizer, "instruct.template=alpaca")
    with pytest.raises(BadInput, match=r"every one of the 35 train prompts is 64 tokens or longer"):
        run_recipe(workspace, cfg)
    assert not (workspace / "ckpt").exists() and not (workspace / "metrics.json").exists()


def test_a_record_without_an_output_is_bad_input_naming_the_file(workspace, small_tokenizer):
    write_jsonl(workspace / "data" / "val.jsonl", [{"instruction": "Say hi.", "input": ""}])
    with pytest.raises(BadInput, match=r"val\.jsonl record 1 is not an object with string"):
        run_recipe(workspace, make_cfg(workspace, small_tokenizer))
