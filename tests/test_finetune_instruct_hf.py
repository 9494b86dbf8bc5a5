"""Instruction fine-tuning of Hugging Face causal LMs (tiny random Llama and Qwen2 folders with the
GPT-2 tokenizer and a ChatML template, tests/hf_models.py): the chat template and its prompt
mask, LoRA on every linear layer of the blocks, length-grouped batches, the adapter and the
merged standard folder, the bad inputs, and the whole path through `dvc repro`."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from cli_support import cli_env, last_error_line, run_cli, set_params, snapshot, write_hellaswag
from hf_models import make_tiny_causal_lm, make_tiny_encoder
from test_dvc import dvc
from test_evaluate import scores_from_samples
from test_hf_downstream import lm_eval_pair, load, raw_loglikelihood

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.finetune.common import epoch_batches, length_grouped_batches
from gptforge.finetune.instruct import finetune_instruct, padding_stats
from gptforge.finetune.templates import IGNORE_INDEX, collate, encode
from gptforge.modeling.hf_causal import HFTokenizer

RECORDS = [
    {
        "instruction": f"Name a colour, number {i}.",
        "input": "" if i % 2 else f"hint {i}",
        "output": f"The colour is {'red' if i % 3 else 'blue'}" + " indeed" * (i % 7),
    }
    for i in range(48)
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "llama", "llama")


def write_splits(folder: Path, records=RECORDS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    parts = {"train": records[:32], "val": records[32:40], "test": records[40:]}
    for name, recs in parts.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return folder


def config(init_from, *extra: str):
    return load_config(
        None,
        [
            f"instruct.init_from={init_from}",
            "instruct.method=lora",
            "instruct.template=chat",
            "instruct.mask_prompt=true",
            "instruct.epochs=1",
            "instruct.batch_size=4",
            "instruct.lr=0.003",
            "instruct.eval_interval=4",
            "instruct.eval_batches=1",
            "instruct.n_responses=3",
            "instruct.max_new_tokens=6",
            "instruct.device=cpu",
            "tracking.enabled=false",
            "tokenizer.path=sample://gpt2_tokenizer",
            *extra,
        ],
    )


def hf_tokenizer(folder: Path) -> HFTokenizer:
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(folder)))


# ---------------------------------------------------------------------------------------------
# The chat template and its prompt mask


def test_chat_template_prompt_and_response_are_the_rendered_conversation(llama):
    enc = hf_tokenizer(llama)
    record = {"instruction": "Say hi.", "input": "to Bob", "output": "Hi Bob!"}
    prompt, response = encode(record, "chat", enc)
    tok = enc.tokenizer
    # independently: the template rendered as text by transformers, tokenized as a whole
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi.\n\nto Bob"}, {"role": "assistant", "content": "Hi Bob!"}], tokenize=False
    )
    assert text == "<|im_start|>user\nSay hi.\n\nto Bob<|endoftext|>\n<|im_start|>assistant\nHi Bob!<|endoftext|>\n"
    assert prompt + response == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(prompt) == "<|im_start|>user\nSay hi.\n\nto Bob<|endoftext|>\n<|im_start|>assistant\n"
    # with mask_prompt, the loss covers the assistant's turn only: its answer and end of turn
    inputs, targets = collate([(prompt, response)], pad_id=enc.eot_token, max_length=256, mask_prompt=True)
    kept = [t for t in targets[0].tolist() if t != IGNORE_INDEX]
    assert tok.decode(kept) == "Hi Bob!<|endoftext|>\n"
    assert kept == response


def test_chat_needs_a_chat_template(tmp_path):
    plain = make_tiny_causal_lm(tmp_path / "plain", "llama", chat_template=None)
    with pytest.raises(BadInput, match=r"^instruct\.template: chat: the tokenizer of .* has no chat template"):
        encode(RECORDS[0], "chat", hf_tokenizer(plain))


# ---------------------------------------------------------------------------------------------
# Batches of similar lengths


def test_length_grouped_batches_cut_padding_and_keep_every_example():
    from gptforge.data.sources import read_records
    from gptforge.samples import resolve

    records = list(read_records(Path(resolve("sample://instruction-data.json.gz")), param="test"))
    examples = [(list(range(10 + len(r["instruction"]) // 4)), list(range(1 + len(r["output"]) // 4))) for r in records]
    length = lambda e: len(e[0]) + len(e[1])  # noqa: E731

    def padding(batches):
        padded = total = 0
        for b in batches:
            width = max(length(e) - 1 for e in b)
            real, pad = padding_stats(b, width)
            padded, total = padded + pad, total + real + pad
        return padded / total

    grouped = length_grouped_batches(examples, 8, seed=1, epoch=1, length=length)
    plain = epoch_batches(examples, 8, seed=1, epoch=1)
    assert sorted(map(id, (e for b in grouped for e in b))) == sorted(map(id, examples))  # each once
    assert padding(grouped) < 0.5 * padding(plain)
    assert grouped == length_grouped_batches(examples, 8, seed=1, epoch=1, length=length)  # (seed, epoch) fixes it
    assert grouped != length_grouped_batches(examples, 8, seed=1, epoch=2, length=length)


# ---------------------------------------------------------------------------------------------
# LoRA on a Hugging Face model: adapter, merged folder, metrics


def test_lora_on_llama_writes_adapter_and_merged_standard_folder(llama, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_splits(tmp_path / "data")
    out = tmp_path / "out"
    cfg = config(llama)
    metrics = finetune_instruct(
        cfg, data_dir=data, out_dir=out, metrics_path=tmp_path / "m.json", responses_path=tmp_path / "r.jsonl"
    )

    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]  # auto: every Linear of the blocks, not lm_head
    final = out / "final"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"} <= {
        p.name for p in final.iterdir()
    }
    assert AutoTokenizer.from_pretrained(str(final)).chat_template == hf_tokenizer(llama).tokenizer.chat_template

    merged = AutoModelForCausalLM.from_pretrained(str(final)).eval()
    with_adapter = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(llama)), str(out / "adapter")
    ).eval()
    base = AutoModelForCausalLM.from_pretrained(str(llama)).eval()
    idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, before = with_adapter(input_ids=idx).logits, merged(input_ids=idx).logits, base(input_ids=idx).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (want - before).abs().max() > 1e-3  # the adapter learned something: the check above can fail

    assert 0 < metrics["padding_fraction"] < 0.5 and metrics["train_tokens"] > 0
    assert {"exact_match", "token_f1", "rouge_l", "response_tokens_per_sec", "val_loss"} <= set(metrics)
    assert "judge_score" not in metrics  # no judge configured
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["reference"] == RECORDS[40]["output"]
    assert json.loads((tmp_path / "m.json").read_text())["val_loss"] == pytest.approx(metrics["val_loss"])


def test_the_judge_endpoint_scores_the_stage_s_responses(llama, tmp_path, fake_judge):
    data = write_splits(tmp_path / "data")
    cfg = config(
        llama,
        f"instruct.judge.url={fake_judge.url}",
        "instruct.judge.model=judge-7b",
        "instruct.n_responses=2",
        "instruct.max_new_tokens=2",
    )
    metrics = finetune_instruct(
        cfg,
        data_dir=data,
        out_dir=tmp_path / "out",
        metrics_path=tmp_path / "m.json",
        responses_path=tmp_path / "r.jsonl",
    )
    asked = [r["body"] for r in fake_judge.requests]
    assert [b["model"] for b in asked] == ["judge-7b", "judge-7b"]
    assert RECORDS[40]["output"] in asked[0]["messages"][0]["content"]
    # the fake judge gives 12 to a response that differs from its reference (a random model's)
    assert metrics["judge_score"] == 12.0 and metrics["judge_unscored"] == 0
    assert json.loads((tmp_path / "m.json").read_text())["judge_score"] == 12.0


def test_qwen2_with_alpaca_template_and_full_fine_tuning(tmp_path):
    qwen = make_tiny_causal_lm(tmp_path / "qwen", "qwen2")
    data = write_splits(tmp_path / "data")
    cfg = config(
        qwen,
        "instruct.method=full",
        "instruct.template=alpaca",
        "instruct.gradient_checkpointing=true",
        "instruct.lr=0.001",
    )
    metrics = finetune_instruct(
        cfg,
        data_dir=data,
        out_dir=tmp_path / "out",
        metrics_path=tmp_path / "m.json",
        responses_path=tmp_path / "r.jsonl",
    )
    assert not (tmp_path / "out" / "adapter").exists()
    assert json.loads((tmp_path / "out" / "final" / "config.json").read_text())["model_type"] == "qwen2"
    assert metrics["trainable_params"] == metrics["total_params"]


# ---------------------------------------------------------------------------------------------
# Bad input: one line, nothing written


@pytest.mark.parametrize(
    "case", ["hub_offline", "no_config", "bert", "chat_without_template", "chat_on_gpt", "4bit_on_cpu"]
)
def test_bad_starting_points_fail_in_one_line_before_writing(case, tmp_path, llama):
    data = write_splits(tmp_path / "data")
    extra = []
    if case == "hub_offline":
        init, want = (
            "Qwen/Qwen2.5-0.5B-Instruct",
            (
                r"^instruct\.init_from: cannot fetch Qwen/Qwen2\.5-0\.5B-Instruct "
                r"from the Hugging Face hub .*; a local folder works"
            ),
        )
    elif case == "no_config":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
        init, want = tmp_path / "empty", r"^instruct\.init_from: .* (not found|no config\.json)"
    elif case == "bert":
        init, want = (
            make_tiny_encoder(tmp_path / "bert"),
            r"^instruct\.init_from: .*bert is a BertModel model, not a causal",
        )
    elif case == "chat_without_template":
        init = make_tiny_causal_lm(tmp_path / "plain", "llama", chat_template=None)
        want = r"^instruct\.template: chat: the tokenizer of .* has no chat template"
    elif case == "chat_on_gpt":
        from gptforge.modeling.gpt import GPT, GPTConfig
        from gptforge.modeling.weights import save_model

        init = tmp_path / "gpt"
        save_model(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=50304, n_vocab=50257)), init)
        want = r"^instruct\.template: chat uses the model's own"
    else:
        init, extra = llama, ["instruct.quantize=4bit"]
        want = r"^instruct\.quantize: 4bit \(QLoRA\) needs CUDA"
    out = tmp_path / "out"
    with pytest.raises(BadInput, match=want) as err:
        finetune_instruct(
            config(init, *extra),
            data_dir=data,
            out_dir=out,
            metrics_path=tmp_path / "m.json",
            responses_path=tmp_path / "r.jsonl",
        )
    assert "\n" not in str(err.value)
    assert not out.exists() and not (tmp_path / "m.json").exists() and not (tmp_path / "r.jsonl").exists()


@pytest.mark.slow
def test_cli_bad_start_is_the_last_line_and_exit_2(tmp_path, llama):
    write_splits(tmp_path / "data" / "instruct")
    before = snapshot(tmp_path)
    proc = run_cli(
        ["finetune", "instruct", "-S", "instruct.init_from=Qwen/Qwen2.5-0.5B-Instruct", "-S", "tracking.enabled=false"],
        cwd=tmp_path,
        env=cli_env(GPTFORGE_PREFECT="0"),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "instruct.init_from: cannot fetch Qwen/Qwen2.5-0.5B-Instruct" in last_error_line(proc.stderr)
    assert "a local folder works" in last_error_line(proc.stderr)
    after = {k: v for k, v in snapshot(tmp_path).items() if not k.startswith(".gptforge/locks/")}  # the stage lock
    assert after == before


# ---------------------------------------------------------------------------------------------
# The whole path through dvc repro


@pytest.mark.slow
def test_dvc_repro_lora_on_a_hugging_face_model_then_generate_and_evaluate(repo_copy, tmp_path, prefect_api):
    llama = make_tiny_causal_lm(tmp_path / "llama", "llama")
    records = RECORDS * 2
    random.Random(0).shuffle(records)
    (tmp_path / "qa.json").write_text(json.dumps(records))
    hellaswag = write_hellaswag(tmp_path / "hellaswag.jsonl", 4)
    set_params(
        repo_copy,
        **{
            "data.instruct.source": str(tmp_path / "qa.json"),
            "base.models": {"tiny": str(llama)},
            "instruct.init_from": "checkpoints/base/tiny",
            "instruct.template": "chat",
            "instruct.method": "lora",
            "instruct.mask_prompt": True,
            "instruct.epochs": 1,
            "instruct.batch_size": 8,
            "instruct.lr": 0.003,
            "instruct.eval_interval": 5,
            "instruct.eval_batches": 1,
            "instruct.n_responses": 2,
            "instruct.max_new_tokens": 6,
            "tracking.enabled": False,
            "evaluate.models": {"instruct": "checkpoints/instruct/final"},
            "evaluate.tasks": ["hellaswag"],
            "evaluate.hellaswag.source": str(hellaswag),
            "evaluate.batch_size": 4,
            "evaluate.precision": "fp32",  # scored as the direct fp32 computation it is checked against
        },
    )
    env = cli_env(PREFECT_API_URL=prefect_api)
    first = dvc(repo_copy, "repro", "finetune_instruct", env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    final = repo_copy / "checkpoints/instruct/final"
    assert json.loads((final / "config.json").read_text())["model_type"] == "llama"
    assert (repo_copy / "checkpoints/instruct/adapter/adapter_model.safetensors").is_file()
    metrics = json.loads((repo_copy / "metrics/instruct.json").read_text())
    assert {"padding_fraction", "rouge_l", "response_tokens_per_sec"} <= set(metrics)

    gen = run_cli(
        [
            "generate",
            "Name a colour.",
            "--checkpoint",
            str(final),
            "--chat",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
        ],
        cwd=repo_copy,
        env=env,
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert "tokens/s" in gen.stderr.strip().splitlines()[-1]

    # The instruct model's evaluation (evaluate@instruct) needs nothing of the classifier, DPO or
    # RL stages: with the instruct chain done, it is the one stage that runs
    ev = dvc(repo_copy, "repro", "evaluate@instruct", env=env)
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    assert re.findall(r"Running stage '([^']+)'", ev.stdout) == ["evaluate@instruct"]
    evaluated = json.loads((repo_copy / "metrics/evaluate/instruct.json").read_text())
    # the score as transformers' own logits of the fine-tuned folder give it, request by request
    model, tok = load(final)
    direct = scores_from_samples(
        repo_copy / "reports/evaluate/instruct",
        lambda context, continuation: (raw_loglikelihood(model, *lm_eval_pair(tok, context, continuation)), None),
        tol=1e-3,
    )
    assert evaluated["hellaswag.n"] == direct["hellaswag"]["n"] == 4
    assert evaluated["hellaswag.acc_norm"] == pytest.approx(direct["hellaswag"]["acc_norm"])
    again = dvc(repo_copy, "repro", "finetune_instruct", env=env)
    assert again.returncode == 0 and "Running stage" not in again.stdout


def test_loss_on_targeted_positions_only_equals_the_full_logits_loss(llama):
    import peft
    from transformers import AutoModelForCausalLM

    from gptforge.finetune.hf_models import full_logits_loss, lm_loss, targeted_logits

    model = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(llama)),
        peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
    )
    inputs = torch.randint(0, 50257, (3, 20), generator=torch.Generator().manual_seed(0))
    targets = inputs.roll(-1, 1).clone()
    targets[:, :7] = IGNORE_INDEX  # a masked prompt
    targets[2, 15:] = IGNORE_INDEX  # padding
    assert targeted_logits(model, inputs, targets != IGNORE_INDEX).shape == (3 * 13 - 5, 50257)
    fast, plain = lm_loss(model, inputs, targets), full_logits_loss(model, inputs, targets)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=0)
    trained = [p for p in model.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(fast, trained), torch.autograd.grad(plain, trained)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
