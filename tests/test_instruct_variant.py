"""Instruct variants (`instruct_variants`, stage finetune_instruct_variant@NAME): one more
instruction fine-tuning with its keys over the instruct section, the starting model scored
before training (`score_before`), a training subset (`max_samples`), `precision: auto-bf16`,
the closing summary's before -> after lines and what `gptforge serve` offers first.

The before-training figures are checked against an independent computation: the starting
folder loaded on its own, its test loss computed from the formula (mean cross-entropy over the
answer tokens) and its greedy answers scored with the reference scorer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from cli_support import last_error_line
from hf_models import make_tiny_causal_lm
from test_finetune_instruct_hf import config, write_splits

from gptforge.config.load import load_config
from gptforge.errors import BadInput

REPO = Path(__file__).resolve().parents[1]

VARIANT = {
    "init_from": None,
    "method": "lora",
    "template": "chat",
    "mask_prompt": True,
    "max_samples": 12,
    "score_before": True,
    "n_responses": 2,
    "max_new_tokens": 6,
    "lr": 0.003,
    "epochs": 1,
    "batch_size": 4,
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "llama", "llama", seed=3)


def variant_config(init_from: Path, **changes):
    models = {"tiny": {**VARIANT, "init_from": str(init_from), **changes}}
    return load_config(
        None,
        [
            "tracking.enabled=false",
            "tokenizer.path=sample://gpt2_tokenizer",
            "instruct.device=cpu",
            f"instruct_variants.models={json.dumps(models)}",
            "instruct_variants.only=tiny",
        ],
    )


# ---------------------------------------------------------------------------------------------
# The config


def test_a_variant_is_the_instruct_section_with_its_keys_over_it(tmp_path):
    cfg = load_config(
        None,
        [
            "instruct.lora.alpha=32",
            "instruct.lr=0.002",
            'instruct_variants.models={"v": {"init_from": "x", "lora": {"r": 4}, "epochs": 3}}',
        ],
    )
    v = cfg.instruct_variant("v")
    assert (v.lora.r, v.lora.alpha, v.epochs, v.lr, v.init_from) == (4, 32.0, 3, 0.002, "x")
    assert cfg.instruct.epochs != 3 and cfg.instruct.lora.r == 8  # the section itself is unchanged


@pytest.mark.parametrize(
    "models, message",
    [
        ({"v": {"init_from": "x", "epoch": 2}}, r"instruct_variants.models.v.epoch: Extra inputs are not permitted"),
        (
            {"v": {"init_from": "x", "lora": {"r": 0}}},
            r"instruct_variants.models.v.lora.r: Input should be greater than 0",
        ),
        ({"v": {"epochs": 2}}, r"instruct_variants.models.v.init_from: set it"),
        ({"v": {"init_from": "x", "nproc_per_node": 2}}, r"a variant trains in one process"),
        ({"a.b": {"init_from": "x"}}, r"name 'a.b' must be letters"),
        ({"v": "checkpoints/base/x"}, r"instruct_variants.models.v: Input should be a valid dictionary"),
    ],
)
def test_bad_variants_are_one_line(models, message):
    with pytest.raises(BadInput, match=message) as info:
        load_config(None, [f"instruct_variants.models={json.dumps(models)}"])
    assert "\n" not in str(info.value)


def test_auto_bf16_is_bf16_where_the_cpu_has_it(monkeypatch):
    import torch

    from gptforge.evaluate import scoring_dtype
    from gptforge.finetune import common
    from gptforge.modeling import hf_causal

    monkeypatch.setattr(hf_causal, "cpu_has_native_bf16", lambda: True)
    assert common.runtime("cpu", "auto-bf16", param="instruct").precision == "bf16"
    assert common.runtime("cpu", "auto", param="instruct").precision == "fp32"
    assert scoring_dtype("auto-bf16", torch.device("cpu")) == torch.bfloat16  # evaluate.precision
    monkeypatch.setattr(hf_causal, "cpu_has_native_bf16", lambda: False)
    assert common.runtime("cpu", "auto-bf16", param="instruct").precision == "fp32"
    assert scoring_dtype("auto-bf16", torch.device("cpu")) == torch.float32


def test_a_bf16_lora_base_computes_what_the_float32_model_does_under_autocast(tmp_path):
    """Under LoRA in bf16 the frozen base keeps its linears in bf16 and everything else in
    float32 (`common.bf16_linears`): under autocast, the logits of Trainer's way (a float32 model,
    autocast casting each weight) bit for bit, on a folder saved in bf16 as prepare_base saves;
    pure bf16 (the residual stream rounded) is not that function."""
    from transformers import AutoModelForCausalLM

    from gptforge.finetune import common

    folder = make_tiny_causal_lm(tmp_path / "llama")
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(folder)  # bf16 on disk
    rt = common.runtime("cpu", "bf16", param="instruct")
    ours, _ = common.load_hf_base(str(folder), rt, param="instruct", lora=True)
    linears = {n for n, m in ours.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, p in ours.named_parameters():
        assert p.dtype == (torch.bfloat16 if name.rsplit(".", 1)[0] in linears else torch.float32), name
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    pure = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).train()
    ids = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), rt.autocast():
        expected = stock(input_ids=ids).logits
        assert torch.equal(ours(input_ids=ids).logits, expected)
        assert not torch.equal(pure(input_ids=ids).logits.float(), expected.float())


# ---------------------------------------------------------------------------------------------
# The stage


def test_length_grouped_batches_weigh_every_target_token_alike(llama, tmp_path, monkeypatch):
    # Over an epoch of length-grouped batches, the weighted batch losses average to the per-token
    # mean cross-entropy over the whole training split, computed here one example at a time; the
    # plain mean of the batches' means (what grouping gave before) does not.
    from test_finetune_instruct_hf import RECORDS

    from gptforge.finetune import instruct

    records = [{**r, "output": r["output"] * (1 + 6 * (i % 3 == 0))} for i, r in enumerate(RECORDS)]  # mixed lengths
    cfg = config(llama, "instruct.group_by_length=true", "instruct.lora.dropout=0.0")
    s = instruct.setup(cfg, write_splits(tmp_path / "data", records))
    seen = {}
    monkeypatch.setattr(
        instruct,
        "train_epochs",
        lambda model, opt, loss_fn, batches, **kw: seen.update(loss_fn=loss_fn, batches=batches),
    )
    instruct.train(s, cfg)
    shape = dict(pad_id=s.enc.eot_token, max_length=s.max_length, mask_prompt=True)
    batches = seen["batches"](0)
    assert len({len(b) for b in batches}) <= 2 and len(batches) == math.ceil(len(s.data["train"]) / 4)
    with torch.no_grad():
        weighted = sum(seen["loss_fn"](b).item() for b in batches) / len(batches)
        means = [instruct.batch_loss(s.model, *instruct.collate(b, **shape)).item() for b in batches]
        total, count = 0.0, 0
        for example in s.data["train"]:
            inputs, targets = instruct.collate([example], **shape)
            logits = s.model(input_ids=inputs).logits.double()
            mask = targets != -100
            total += torch.nn.functional.cross_entropy(logits[mask], targets[mask], reduction="sum").item()
            count += int(mask.sum())
    assert weighted == pytest.approx(total / count, rel=1e-5)
    assert abs(sum(means) / len(means) - total / count) > 1e-3


def test_variant_stage_scores_the_start_and_the_result(llama, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptforge.finetune.answer_quality import reference_scores
    from gptforge.finetune.instruct import finetune_instruct_variant
    from gptforge.finetune.templates import collate, encode

    data = write_splits(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    metrics = finetune_instruct_variant(variant_config(llama), data_dir=data)

    out = Path("checkpoints/instruct_tiny")
    assert (out / "final" / "model.safetensors").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    assert json.loads(Path("metrics/instruct_tiny.json").read_text()) == pytest.approx(metrics)
    assert not Path("checkpoints/instruct").exists() and not Path("metrics/instruct.json").exists()
    assert metrics["steps"] == 3  # max_samples 12 of the 32 train records, batches of 4

    # Before training, independently: the starting folder's mean cross-entropy over the answer
    # tokens of the whole test split, and its greedy answers scored by the reference scorer.
    tok = AutoTokenizer.from_pretrained(llama)
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    from gptforge.modeling.hf_causal import HFTokenizer

    enc = HFTokenizer(tok)
    test = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()]
    total, count = 0.0, 0
    for record in test:
        prompt, response = encode(record, "chat", enc)
        inputs, targets = collate([(prompt, response)], pad_id=enc.eot_token, max_length=256, mask_prompt=True)
        with torch.no_grad():
            logits = model(inputs).logits[0]
        for pos, target in enumerate(targets[0].tolist()):
            if target != -100:
                total -= torch.log_softmax(logits[pos].double(), -1)[target].item()
                count += 1
    assert metrics["test_loss_before"] == pytest.approx(total / count, rel=1e-5)

    rows = [json.loads(line) for line in Path("reports/instruct_tiny_responses.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("response_before" in r for r in rows)
    answers = []
    for record in test[:2]:
        prompt, _ = encode(record, "chat", enc)
        with torch.no_grad():
            out_ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        answers.append(tok.decode(out_ids[0, len(prompt) :], skip_special_tokens=True).strip())
    assert [r["response_before"] for r in rows] == answers
    before = reference_scores([{**r, "response": r["response_before"]} for r in rows])
    for key in ("exact_match", "token_f1", "rouge_l"):
        assert metrics[f"{key}_before"] == pytest.approx(before[key])
        assert metrics[key] == pytest.approx(reference_scores(rows)[key])
    assert math.isfinite(metrics["test_loss"]) and metrics["test_loss"] != metrics["test_loss_before"]


def test_unknown_variant_is_one_line(llama, tmp_path):
    from gptforge.finetune.instruct import finetune_instruct_variant

    cfg = variant_config(llama).model_copy(deep=True)
    cfg.instruct_variants.only = "other"
    with pytest.raises(BadInput, match=r"instruct_variants.models has no entry 'other' \(entries: tiny\)"):
        finetune_instruct_variant(cfg, data_dir=tmp_path)


def test_cli_refuses_a_missing_start_folder_in_one_line(tmp_path):
    from cli_support import cli_env, run_cli

    models = {"tiny": {**VARIANT, "init_from": str(tmp_path / "absent")}}
    write_splits(tmp_path / "data" / "instruct")
    (tmp_path / "params.yaml").write_text("{}\n")
    proc = run_cli(
        [
            "finetune",
            "instruct-variant",
            "-S",
            f"instruct_variants.models={json.dumps(models)}",
            "-S",
            "instruct_variants.only=tiny",
            "-S",
            "tracking.enabled=false",
            "-S",
            "tokenizer.path=sample://gpt2_tokenizer",
        ],
        tmp_path,
        cli_env(GPTFORGE_PREFECT="0"),
    )
    assert proc.returncode == 2 and "instruct.init_from" in last_error_line(proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------
# What the user sees after the pipeline


def test_closing_summary_shows_each_variant_before_and_after(tmp_path):
    from gptforge.pipeline.run import PipelineReport, StageReport
    from gptforge.pipeline.summary import closing_summary

    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "instruct_smollm2.json").write_text(
        json.dumps(
            {
                "test_loss": 0.972,
                "test_loss_before": 1.203,
                "token_f1": 0.815,
                "token_f1_before": 0.518,
                "rouge_l": 0.76,
                "rouge_l_before": 0.42,
                "exact_match": 0.0,
                "exact_match_before": 0.0,
            }
        )
    )
    report = PipelineReport(stages=[StageReport("finetune_instruct_variant@smollm2", "ran")])
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    lines = closing_summary(report, tmp_path)
    # one variant: its lines under its family's title, the quickstart's base model
    assert lines[2] == "  smollm2 (packaged://smollm2-135m-instruct):"
    assert "    SFT test loss                  1.203 -> 0.972" in lines
    assert "    SFT token F1                   0.518 -> 0.815" in lines
    assert "    SFT ROUGE-L                    0.420 -> 0.760" in lines
    assert not any("exact match" in line for line in lines)  # 0.000 -> 0.000 says nothing


def test_serve_offers_the_variants_first(tmp_path, monkeypatch):
    from gptforge.serve.sources import default_specs

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ['instruct_variants.models={"smollm2": {"init_from": "checkpoints/base/smollm2"}}'])
    for folder in ("checkpoints/instruct_smollm2/final", "checkpoints/instruct/final", "checkpoints/classify/final"):
        Path(folder).mkdir(parents=True)
    assert default_specs(cfg) == [
        "smollm2=checkpoints/instruct_smollm2/final",
        "instruct=checkpoints/instruct/final",
        "classify=checkpoints/classify/final",
    ]
    assert default_specs(cfg, language_models_only=True)[0] == "smollm2=checkpoints/instruct_smollm2/final"
    Path("checkpoints/instruct_smollm2/final").rmdir()
    assert default_specs(cfg)[0] == "instruct=checkpoints/instruct/final"


def test_serve_offers_the_aligned_hugging_face_model_first(tmp_path, monkeypatch):
    from gptforge.serve.sources import default_specs

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ['instruct_variants.models={"smollm2": {"init_from": "checkpoints/base/smollm2"}}'])
    for folder in ("checkpoints/instruct_smollm2/final", "checkpoints/instruct/final", "checkpoints/rl/final"):
        Path(folder).mkdir(parents=True)
    # a gptforge GPT's RL copy (its config has no model_type) is not offered first
    Path("checkpoints/rl/final/config.json").write_text(json.dumps({"n_layer": 2}))
    assert default_specs(cfg, language_models_only=True)[0] == "smollm2=checkpoints/instruct_smollm2/final"
    # a Hugging Face one (the quickstart's SmolLM2 after GRPO) is, before its SFT
    Path("checkpoints/rl/final/config.json").write_text(json.dumps({"model_type": "llama"}))
    assert default_specs(cfg)[:3] == [
        "rl=checkpoints/rl/final",
        "smollm2=checkpoints/instruct_smollm2/final",
        "instruct=checkpoints/instruct/final",
    ]
