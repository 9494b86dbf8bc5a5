"""The reward-model stage (trl's RewardTrainer): its loss against -log sigmoid(r_chosen - r_rejected)
from plain forward passes, training that ranks held-out pairs better, the saved Hugging Face folder
scoring as the stage reported, a Hugging Face init_from, a folder without a tokenizer, the CLI.

Models are tiny: gptforge's GPT (2 layers, 32 wide, 128 positions) over the embedded GPT-2
tokenizer, and a random Llama (tests/hf_models.py); the pairs are the preference stage's test
records (a polite chosen, a rude rejected answer).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cli_support import cli_env, last_error_line, run_cli
from fixture_data import FakeRun
from hf_models import make_tiny_causal_lm
from test_finetune_preference import TOKENIZER, sft_gpt, write_splits  # noqa: F401 - sft_gpt: a fixture

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.finetune import reward as R


def config(init_from, *extra: str):
    return load_config(
        None,
        [
            f"tokenizer.path={TOKENIZER}",
            f"reward.init_from={init_from}",
            "reward.template=phi3",
            "reward.batch_size=4",
            "reward.lr=1e-3",
            "tracking.enabled=false",
            *extra,
        ],
    )


def run_stage(cfg, tmp_path: Path, data: Path, run=None) -> dict:
    return R.train_reward(
        cfg,
        run=run or FakeRun(),
        data_dir=data,
        out_dir=tmp_path / "out",
        metrics_path=tmp_path / "metrics" / "reward.json",
        plots_dir=tmp_path / "plots",
    )


def plain_rewards(model, rows: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence alone, unpadded, its trailing end-of-text ids (the pad id) dropped, through a
    float64 copy of the model: the score head's output at its last position."""
    model = copy.deepcopy(model).double().eval()

    def reward(ids: list[int]) -> torch.Tensor:
        while ids and ids[-1] == pad_id:
            ids = ids[:-1]
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, 0]

    return (
        torch.stack([reward(r["chosen_ids"]) for r in rows]),
        torch.stack([reward(r["rejected_ids"]) for r in rows]),
    )


# ---------------------------------------------------------------------------------------------
# trl's loss against the formula


def test_trl_reward_loss_of_a_batch_equals_minus_log_sigmoid_in_float64(sft_gpt, tmp_path):
    cfg = config(sft_gpt)
    session = R.setup(cfg, write_splits(tmp_path / "data"))
    model = session.rm.model
    with torch.no_grad():  # a head that separates the rewards, so the loss is not log 2
        model.score.weight.copy_(torch.randn_like(model.score.weight))
    trainer = R.make_trainer(session.rm, session.rows, cfg, session.rt, str(tmp_path / "trl"))
    rows = session.rows["val"][:4]
    batch = trainer.data_collator(rows)
    assert batch["input_ids"].shape[0] == 8 and (batch["input_ids"] == 50256).any()  # padded with end of text
    trainer.model.eval()
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model, dict(batch)))
    chosen, rejected = plain_rewards(model, rows, session.rm.pad_id)
    expected = float(-F.logsigmoid(chosen - rejected).mean())
    assert abs(loss - expected) < 1e-5, (loss, expected)
    assert abs(expected - math.log(2)) > 1e-2
    # The stage's own scores (batched, padded) are the same rewards.
    ours = R.score_pairs(model, rows, session.rm.pad_id, 3, session.rt)
    assert torch.allclose(ours[0], chosen, atol=1e-5) and torch.allclose(ours[1], rejected, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The stage


def test_training_ranks_held_out_pairs_better_and_the_saved_folder_scores_the_same(sft_gpt, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = config(sft_gpt, "reward.epochs=2", "reward.eval_interval=4")
    data = write_splits(tmp_path / "data")
    run = FakeRun()
    metrics = run_stage(cfg, tmp_path, data, run)

    assert metrics["val_accuracy"] > metrics["val_accuracy_before"], metrics
    assert metrics["val_accuracy"] == 1.0 and metrics["val_margin"] > metrics["val_margin_before"]
    assert metrics["train_pairs"] == 24 and metrics["val_pairs"] == 8 and metrics["steps"] == 12
    assert metrics["trainable_params"] == metrics["total_params"] and metrics["pairs_per_sec"] > 0
    assert json.loads((tmp_path / "metrics" / "reward.json").read_text()) == metrics
    logged = {k for m in run.metrics for k in m}
    assert {
        "train_loss",
        "train_accuracy",
        "train_margin",
        "val_accuracy",
        "val_margin",
        "val_accuracy_before",
    } <= logged

    # An ordinary Hugging Face folder: it loads, and its scores give the reported accuracy.
    final = tmp_path / "out" / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert type(model).__name__ == "GPT2ForSequenceClassification" and model.config.num_labels == 1
    assert model.config.pad_token_id == 50256 == tokenizer.pad_token_id
    assert (final / "model.safetensors").is_file()
    session = R.setup(cfg, data)  # the same rows, encoded again
    chosen, rejected = R.score_pairs(model, session.rows["val"], 50256, 8, session.rt)
    assert R.pair_metrics(chosen, rejected)["val_accuracy"] == metrics["val_accuracy"]
    assert R.pair_metrics(chosen, rejected)["val_margin"] == pytest.approx(metrics["val_margin"], abs=1e-5)
    # Text in, reward out: the tokenizer saved with it encodes as the stage did.
    rec = json.loads((data / "val.jsonl").read_text().splitlines()[0])
    from gptforge.finetune.templates import render

    prompt, answer = render({**rec, "output": rec["chosen"]}, "phi3")
    ids = tokenizer(prompt + answer, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert float(model(input_ids=ids).logits[0, 0]) == pytest.approx(float(chosen[0]), abs=1e-4)

    train_csv = (tmp_path / "plots" / "reward.csv").read_text().splitlines()
    assert train_csv[0] == "step,train_loss,train_accuracy,train_margin" and len(train_csv) == 13
    val_csv = (tmp_path / "plots" / "reward_val.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in val_csv[1:]] == ["0", "4", "8", "12"]  # before, every 4, after
    assert (tmp_path / "plots" / "reward_margins.png").stat().st_size > 1000
    assert final in run.artifacts


def test_lora_trains_adapters_and_the_head_and_saves_them_merged(sft_gpt, tmp_path):
    from transformers import AutoModelForSequenceClassification

    cfg = config(sft_gpt, "reward.method=lora", "reward.max_samples=8", "reward.lr=5e-3")
    session = R.setup(cfg, write_splits(tmp_path / "data"))
    head = session.rm.model.get_base_model().score.weight.detach().clone()
    session = R.train(session, cfg)
    metrics = R.finish(session, cfg, FakeRun(), tmp_path / "out", tmp_path / "m.json", tmp_path / "plots")
    assert metrics["trainable_params"] < metrics["total_params"] / 10
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "final")  # merged: no adapter
    assert not torch.equal(model.score.weight, head)
    chosen, rejected = R.score_pairs(model, session.rows["val"], 50256, 8, session.rt)
    assert R.pair_metrics(chosen, rejected)["val_margin"] == pytest.approx(metrics["val_margin"], abs=1e-5)


def test_a_hugging_face_causal_lm_becomes_a_reward_model_with_its_tokenizer(tmp_path):
    from transformers import AutoModelForSequenceClassification

    llama = make_tiny_causal_lm(tmp_path / "llama")
    cfg = config(llama, "reward.template=chat", "reward.max_samples=8")
    metrics = run_stage(cfg, tmp_path, write_splits(tmp_path / "data"))
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "final")
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    assert (tmp_path / "out" / "final" / "tokenizer_config.json").is_file()
    assert metrics["steps"] == 2 and metrics["train_pairs"] == 8


def test_a_folder_without_a_tokenizer_is_one_line_before_any_model_loads(tmp_path, monkeypatch):
    import transformers

    llama = make_tiny_causal_lm(tmp_path / "llama")
    for f in llama.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "chat_template")):
            f.unlink()

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", no_loading)
    with pytest.raises(BadInput, match=r"reward.init_from: .*llama has no tokenizer") as e:
        R.setup(config(llama, "reward.template=chat"), write_splits(tmp_path / "data"))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_cli_trains_and_writes_the_stage_outputs(sft_gpt, tmp_path):
    write_splits(tmp_path / "data" / "preference")
    env = cli_env(GPTFORGE_PREFECT="0")
    base = ["-S", f"tokenizer.path={TOKENIZER}", "-S", "tracking.enabled=false", "-S", "reward.template=phi3"]
    out = run_cli(
        [
            "finetune",
            "reward",
            *base,
            "-S",
            f"reward.init_from={sft_gpt}",
            "-S",
            "reward.batch_size=4",
            "-S",
            "reward.max_samples=8",
        ],
        tmp_path,
        env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads((tmp_path / "metrics" / "reward.json").read_text())
    assert metrics["steps"] == 2 and {"val_accuracy", "val_accuracy_before", "val_margin"} <= set(metrics)
    assert (tmp_path / "checkpoints" / "reward" / "final" / "config.json").is_file()
    assert (tmp_path / "plots" / "reward.csv").is_file()

    bare = tmp_path / "bare"  # a model folder with no tokenizer: exit 2, one line, nothing written
    make_tiny_causal_lm(bare)
    for f in bare.iterdir():
        if not f.name.startswith(("config", "model", "generation")):
            f.unlink()
    shutil.rmtree(tmp_path / "checkpoints")
    out = run_cli(["finetune", "reward", *base, "-S", f"reward.init_from={bare}"], tmp_path, env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "has no tokenizer" in last_error_line(out.stderr)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_register_logs_the_reward_model_as_a_pipeline_that_returns_its_raw_score(tmp_path, monkeypatch, mlflow_uri):
    """The register stage's MLflow model of the reward model: text in, the score head's logit out
    (no sigmoid or softmax over the one label), as the RL stage reads it."""
    import mlflow
    from hf_models import make_tokenizer
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from gptforge.register import log_model
    from gptforge.runtime import mlflow_values, tracking

    torch.manual_seed(3)
    folder = tmp_path / "reward"
    model = GPT2ForSequenceClassification(
        GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64, vocab_size=50257, num_labels=1, pad_token_id=50256)
    ).eval()
    model.save_pretrained(str(folder))
    tokenizer = make_tokenizer(folder, chat_template=None)
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_uri[len("sqlite:///") :], db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.delenv(mlflow_values.PARENT_ENV, raising=False)
    with tracking.start_run(enabled=True, experiment="t", stage="register") as run:
        uri = log_model("reward", folder, config(folder), run)
    texts = ["A calm answer.", "Go away, I will not help."]
    predicted = mlflow.pyfunc.load_model(uri).predict(texts)
    with torch.no_grad():
        logits = [float(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in texts]
    assert list(predicted["score"]) == pytest.approx(logits, abs=1e-5)
    assert abs(logits[0] - logits[1]) > 1e-4  # the texts score differently
