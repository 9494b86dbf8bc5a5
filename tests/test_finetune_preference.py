"""The preference stage (DPO through trl): trl's loss against its formula, the reference left
untouched, what the stage writes, LoRA's adapter-disabled reference, a Hugging Face model, and
its bad inputs.

Models are tiny: gptforge's GPT (2 layers, 32 wide, 128 positions) over the embedded GPT-2
tokenizer, and a random Llama (tests/hf_models.py). The pairs are short hand-written records
with a polite chosen and a rude rejected answer, as in LLMs-from-scratch ch. 7's data.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cli_support import cli_env, last_error_line, run_cli
from cli_support import snapshot as snapshot_all
from fixture_data import FakeRun
from hf_models import make_tiny_causal_lm

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.finetune import preference as P
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.weights import load_model, save_model

TOKENIZER = "sample://gpt2_tokenizer"
TOPICS = [
    "the sky",
    "a cat",
    "the sea",
    "bread",
    "a song",
    "the moon",
    "rain",
    "a tree",
    "coffee",
    "snow",
    "a river",
    "the sun",
]


def records(n: int, offset: int = 0) -> list[dict]:
    out = []
    for i in range(offset, offset + n):
        topic = TOPICS[i % len(TOPICS)]
        out.append(
            {
                "instruction": f"Describe {topic} in a few words.",
                "input": "" if i % 2 else f"Case {i}.",
                "chosen": f"It is calm and lovely, like {topic}.",
                "rejected": f"Ugh, stop asking me about {topic}, it is boring.",
            }
        )
    return out


def write_splits(folder: Path, train=None, val=None, test=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, recs in (
        ("train", train or records(24)),
        ("val", val or records(8, 100)),
        ("test", test or records(4, 200)),
    ):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def sft_gpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=128, vocab_size=50304, n_vocab=50257))
    return save_model(model, tmp_path_factory.mktemp("sft") / "final")


def config(init_from, *extra: str):
    return load_config(
        None,
        [
            f"tokenizer.path={TOKENIZER}",
            f"preference.init_from={init_from}",
            "preference.template=phi3",
            "preference.batch_size=4",
            "preference.lr=1e-3",
            "preference.n_responses=2",
            "preference.max_new_tokens=6",
            "tracking.enabled=false",
            *extra,
        ],
    )


def run_stage(cfg, tmp_path: Path, data: Path, run=None) -> dict:
    return P.finetune_preference(
        cfg,
        run=run or FakeRun(),
        data_dir=data,
        out_dir=tmp_path / "out",
        metrics_path=tmp_path / "metrics" / "preference.json",
        responses_path=tmp_path / "reports" / "preference_responses.jsonl",
        plots_dir=tmp_path / "plots",
    )


# ---------------------------------------------------------------------------------------------
# trl's loss against the formula


def sequence_logps(model, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Sum over each row's completion tokens of log p(token | what precedes it), in float64 from
    the model's plain logits (no fused head)."""
    logits = model(input_ids=input_ids).logits.double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (logp * completion_mask[:, 1:].double()).sum(dim=1)


def test_trl_dpo_loss_of_a_batch_equals_the_formula_in_float64(sft_gpt, tmp_path):
    cfg = config(sft_gpt, "preference.beta=0.3")
    session = P.setup(cfg, write_splits(tmp_path / "data"))
    # A policy that differs from the reference, so the log-ratios are not all zero.
    with torch.no_grad():
        for p in session.models.policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    trainer = P.make_trainer(session.models, session.pairs, cfg, session.rt, str(tmp_path / "trl"), session.max_length)
    batch = next(iter(trainer.get_eval_dataloader()))
    trainer.model.eval()
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model, dict(batch)))
        ids, mask = batch["input_ids"], batch["completion_mask"]
        policy = sequence_logps(session.models.policy, ids, mask)
        reference = sequence_logps(session.models.reference, ids, mask)
    chosen, rejected = (policy - reference).chunk(2)
    expected = float(-F.logsigmoid(0.3 * (chosen - rejected)).mean())
    assert abs(loss - expected) < 1e-5, (loss, expected)
    assert abs(expected - math.log(2)) > 1e-3  # the ratios really differ from zero


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_validation_before_training_is_what_trl_measures(sft_gpt, tmp_path, method):
    # start_validation writes SAME_AS_REFERENCE without scoring: trl's own evaluation of the
    # untrained policy against its reference must give exactly those figures.
    cfg = config(sft_gpt, f"preference.method={method}")
    session = P.setup(cfg, write_splits(tmp_path / "data"))
    trainer = P.make_trainer(session.models, session.pairs, cfg, session.rt, str(tmp_path / "trl"), session.max_length)
    measured = trainer.evaluate()
    for key, value in P.SAME_AS_REFERENCE.items():
        assert measured[key] == pytest.approx(value, abs=1e-6), key
    assert P.start_validation(trainer, cfg) == P.SAME_AS_REFERENCE
    assert trainer.state.log_history[-1]["eval_loss"] == pytest.approx(math.log(2))  # logged as trl logs one
    other = config(sft_gpt, f"preference.method={method}", "preference.loss_type=hinge")
    assert P.start_validation(trainer, other)["eval_loss"] == pytest.approx(measured["eval_loss"])  # measured


# ---------------------------------------------------------------------------------------------
# The stage


@pytest.mark.slow
def test_full_dpo_trains_the_policy_leaves_the_reference_and_writes_its_records(sft_gpt, tmp_path):
    cfg = config(sft_gpt, "preference.epochs=2", "preference.eval_interval=4")
    data = write_splits(tmp_path / "data")
    session = P.setup(cfg, data)
    reference_before = {k: v.clone() for k, v in session.models.reference.state_dict().items()}
    policy_before = {k: v.clone() for k, v in session.models.policy.state_dict().items()}
    run = FakeRun()
    session = P.train(session, cfg, run)
    metrics = P.finish(
        session, cfg, run, tmp_path / "out", tmp_path / "metrics.json", tmp_path / "responses.jsonl", tmp_path / "plots"
    )

    after = session.models.reference.state_dict()
    assert all(torch.equal(reference_before[k], after[k]) for k in reference_before)  # bitwise unchanged
    changed = session.trainer.model.state_dict()
    assert any(not torch.equal(policy_before[k], changed[k]) for k in policy_before)

    # Before training the policy is the reference: every reward is zero.
    assert metrics["val_reward_margin_before"] == 0 and metrics["val_reward_accuracy_before"] == 0
    assert metrics["val_loss_before"] == pytest.approx(math.log(2), abs=1e-6)
    # A strong signal (rude vs polite, the same in every pair) is learned at lr 1e-3.
    assert metrics["val_reward_accuracy"] > 0.5 and metrics["val_reward_margin"] > 0
    assert metrics["train_pairs"] == 24 and metrics["val_pairs"] == 8 and metrics["steps"] == 12
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    logged = {k for m in run.metrics for k in m}
    assert {
        "train_loss",
        "train_rewards_chosen",
        "train_rewards_rejected",
        "train_reward_accuracy",
        "train_reward_margin",
        "val_reward_margin",
        "val_reward_accuracy",
    } <= logged

    # The model: a gptforge checkpoint again, with the trained weights.
    model = load_model(tmp_path / "out" / "final")
    assert model.config.n_layer == 2 and model.config.vocab_size == 50304
    from gptforge.modeling.hf_convert import to_hf

    ids = torch.tensor([[464, 3290, 318, 257]])
    with torch.no_grad():
        ours = to_hf(model)(input_ids=ids).logits
        trained = session.trainer.model.eval()(input_ids=ids).logits
    assert torch.allclose(ours, trained, atol=1e-5)

    rows = [json.loads(line) for line in (tmp_path / "responses.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and set(rows[0]) == {
        "instruction",
        "input",
        "chosen",
        "rejected",
        "sft_response",
        "dpo_response",
    }
    assert rows[0]["instruction"] == records(4, 200)[0]["instruction"]
    train_csv = (tmp_path / "plots" / "preference.csv").read_text().splitlines()
    assert train_csv[0] == "step,train_loss,train_reward_margin,train_reward_accuracy" and len(train_csv) == 13
    val_csv = (tmp_path / "plots" / "preference_val.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in val_csv[1:]] == ["0", "4", "8", "12"]  # before, every 4, after (once)
    assert (tmp_path / "plots" / "preference_margins.png").stat().st_size > 1000


@pytest.mark.slow
def test_pairs_identical_within_max_length_are_dropped_and_counted(sft_gpt, tmp_path):
    same_start = {
        "instruction": "Say hi.",
        "input": "",
        "chosen": "Hi there " * 30 + "friend.",
        "rejected": "Hi there " * 30 + "you fool.",
    }
    cfg = config(sft_gpt, "preference.max_length=48", "preference.max_samples=4")
    train = records(6) + [same_start]
    metrics = run_stage(cfg, tmp_path, write_splits(tmp_path / "data", train=train))
    assert metrics["dropped_identical_after_truncation"] == 1 and metrics["train_pairs"] == 4
    assert metrics["skipped_too_long"] == 0


@pytest.mark.slow
def test_lora_uses_the_policy_without_its_adapter_as_the_reference(sft_gpt, tmp_path):
    cfg = config(sft_gpt, "preference.method=lora", "preference.max_samples=8", "preference.lr=5e-3")
    session = P.setup(cfg, write_splits(tmp_path / "data"))
    assert session.models.reference is None  # trl disables the adapter instead
    base_before = {
        k: v.clone() for k, v in session.models.policy.get_base_model().state_dict().items() if "lora_" not in k
    }
    session = P.train(session, cfg)
    base_after = session.trainer.model.get_base_model().state_dict()
    assert all(torch.equal(v, base_after[k]) for k, v in base_before.items())  # the frozen weights: the reference
    metrics = P.finish(
        session, cfg, FakeRun(), tmp_path / "out", tmp_path / "m.json", tmp_path / "r.jsonl", tmp_path / "plots"
    )
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    assert metrics["trainable_params"] < metrics["total_params"] / 10
    assert metrics["val_reward_margin"] != 0
    load_model(tmp_path / "out" / "final")  # merged into a gptforge checkpoint


def test_a_hugging_face_policy_stays_a_hugging_face_model(tmp_path):
    llama = make_tiny_causal_lm(tmp_path / "llama")
    cfg = config(llama, "preference.template=chat", "preference.max_samples=8")
    metrics = run_stage(cfg, tmp_path, write_splits(tmp_path / "data"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")
    assert model.config.model_type == "llama" and (tmp_path / "out" / "final" / "tokenizer_config.json").is_file()
    assert metrics["steps"] == 2 and metrics["val_reward_accuracy_before"] == 0


# ---------------------------------------------------------------------------------------------
# Bad input


def test_reference_of_another_architecture_is_one_line_before_loading(sft_gpt, tmp_path):
    llama = make_tiny_causal_lm(tmp_path / "llama")
    with pytest.raises(BadInput, match=r"preference.reference: .* is a llama model, the policy .* a gpt2 model"):
        P.setup(config(sft_gpt, f"preference.reference={llama}"), write_splits(tmp_path / "data"))
    with pytest.raises(BadInput, match=r"preference.reference: .* is a gpt2 model, the policy .* a llama model"):
        P.setup(config(llama, f"preference.reference={sft_gpt}"), write_splits(tmp_path / "data"))


def test_reference_with_another_vocabulary_is_refused(sft_gpt, tmp_path):
    other = save_model(
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=128, vocab_size=320, n_vocab=281)), tmp_path / "other"
    )
    with pytest.raises(BadInput, match=r"vocabulary of 281 tokens, the policy .* 50257"):
        P.setup(config(sft_gpt, f"preference.reference={other}"), write_splits(tmp_path / "data"))


def test_a_reference_of_the_same_family_is_used_as_given(sft_gpt, tmp_path):
    torch.manual_seed(1)
    other = save_model(
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=128, vocab_size=50304, n_vocab=50257)),
        tmp_path / "ref",
    )
    cfg = config(sft_gpt, f"preference.reference={other}", "preference.max_samples=4")
    session = P.setup(cfg, write_splits(tmp_path / "data"))
    assert len(session.models.reference.transformer.h) == 1
    session = P.train(session, cfg)
    assert session.before["val_reward_margin_before"] != 0  # another model: the rewards start apart


def test_missing_split_names_the_stage_to_run(sft_gpt, tmp_path):
    with pytest.raises(BadInput, match=r"data/train.jsonl not found; run `gptforge prepare preference` first"):
        P.setup(config(sft_gpt), tmp_path / "data")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file but the stage locks (`.gptforge/locks`, made empty on first use)."""
    return {k: v for k, v in snapshot_all(folder).items() if not k.startswith(".gptforge/")}


def test_cli_bad_inputs_are_one_line_exit_2_and_write_nothing(sft_gpt, tmp_path):
    """The data stage refuses pairs without `rejected` and pairs that are all identical; the
    stage refuses a reference of another architecture; each the last line, exit 2, no file."""
    env = cli_env(GPTFORGE_PREFECT="0")
    base = ["-S", f"tokenizer.path={TOKENIZER}", "-S", "tracking.enabled=false"]
    no_rejected = tmp_path / "no_rejected.json"
    no_rejected.write_text(json.dumps([{k: v for k, v in r.items() if k != "rejected"} for r in records(10)]))
    identical = tmp_path / "identical.json"
    identical.write_text(json.dumps([{**r, "rejected": r["chosen"]} for r in records(10)]))
    for source, expected in ((no_rejected, "no 'rejected'"), (identical, "identical chosen and rejected")):
        before = snapshot(tmp_path)
        out = run_cli(["prepare", "preference", *base, "-S", f"data.preference.source={source}"], tmp_path, env)
        assert out.returncode == 2, out.stderr[-2000:]
        line = last_error_line(out.stderr)
        assert line.startswith("gptforge: error: data.preference.source") and expected in line, line
        assert snapshot(tmp_path) == before

    write_splits(tmp_path / "data" / "preference")
    llama = make_tiny_causal_lm(tmp_path / "llama")
    before = snapshot(tmp_path)
    out = run_cli(
        [
            "finetune",
            "preference",
            *base,
            "-S",
            f"preference.init_from={sft_gpt}",
            "-S",
            f"preference.reference={llama}",
        ],
        tmp_path,
        env,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "preference.reference" in last_error_line(out.stderr) and "llama" in last_error_line(out.stderr)
    assert snapshot(tmp_path) == before
