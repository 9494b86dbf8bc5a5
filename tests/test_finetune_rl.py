"""The RL stage (GRPO and RLOO through trl): GRPO's advantages against their formula, the frozen
reference left untouched while the KL grows, the rewards against their formulas, what the stage
writes, and its bad inputs.

Models are tiny: gptforge's GPT (2 layers, 32 wide, 128 positions) over the embedded GPT-2
tokenizer as the policy, and a random 1-layer `GPT2ForSequenceClassification` with the GPT-2
tokenizer as the reward model (not the train_reward stage's, so this file stands alone).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_support import cli_env, run_cli
from fixture_data import FakeRun
from hf_models import make_tokenizer

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.finetune import rewards as R
from gptforge.finetune import rl as RL
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.weights import load_model, save_model

TOKENIZER = "sample://gpt2_tokenizer"
TOPICS = ["the sky", "a cat", "the sea", "bread", "a song", "the moon", "rain", "a tree"]


def records(n: int, offset: int = 0) -> list[dict]:
    return [
        {
            "instruction": f"Describe {TOPICS[i % len(TOPICS)]} in a few words.",
            "input": "" if i % 2 else f"Case {i}.",
            "output": f"It is calm, like {TOPICS[i % len(TOPICS)]}.",
        }
        for i in range(offset, offset + n)
    ]


def write_splits(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, recs in (("train", records(16)), ("val", records(4, 100)), ("test", records(4, 200))):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return folder


def tiny_gpt(folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    return save_model(
        GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=128, vocab_size=50304, n_vocab=50257)), folder
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """checkpoints/instruct/final (the SFT model and the policy's start), checkpoints/preference/
    final (another tiny GPT: the DPO column), a reward model folder and the instruct splits."""
    root = tmp_path_factory.mktemp("rl")
    tiny_gpt(root / "checkpoints" / "instruct" / "final")
    tiny_gpt(root / "checkpoints" / "preference" / "final", seed=1)
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(2)
    reward = GPT2ForSequenceClassification(
        GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=256, vocab_size=50257, num_labels=1, pad_token_id=50256)
    )
    reward.save_pretrained(str(root / "reward"))
    make_tokenizer(root / "reward", chat_template=None)
    write_splits(root / "data")
    return root


def config(world: Path, *extra: str):
    return load_config(
        None,
        [
            f"tokenizer.path={TOKENIZER}",
            f"rl.init_from={world / 'checkpoints/instruct/final'}",
            f"rl.reward_model={world / 'reward'}",
            "rl.template=phi3",
            "rl.num_generations=2",
            "rl.batch_size=4",
            "rl.max_completion_length=8",
            "rl.max_new_tokens=6",
            "rl.n_responses=2",
            "rl.lr=1e-3",
            "rl.max_prompts=6",
            "rl.length_target=4",
            "rl.rewards={reward_model: 1.0, length: 0.5, format: 1.0}",
            "tracking.enabled=false",
            *extra,
        ],
    )


# ---------------------------------------------------------------------------------------------
# GRPO's advantages against the formula


def test_grpo_advantages_of_a_group_are_the_rewards_standardized_within_it(world):
    cfg = config(world, "rl.rewards={reward_model: 1.0, length: 0.5}")
    s = RL.setup(cfg, world / "data")
    trainer = RL.make_trainer(s, cfg)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    out = trainer._generate_and_score_completions(batch)

    # The rewards again, from the completions' tokens: the reward model's logit on the text,
    # and -|n - 4| / 4 with n the tokens before the end of text.
    reward_model = s.rewards.reward_model
    ids, mask = out["completion_ids"], out["completion_mask"].bool()
    rewards = []
    for row, example in zip(range(len(ids)), batch):
        answer = ids[row][mask[row]].tolist()
        ended = bool(answer) and answer[-1] == 50256
        content = answer[:-1] if ended else answer
        text = example["prompt"] + s.models.enc.decode(content) + ("<|endoftext|>" if ended else "")
        enc = reward_model.tokenizer([text], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            score = float(reward_model.model(**enc).logits[0, 0])
        rewards.append(score + 0.5 * -abs(len(content) - 4) / 4)
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, 2)  # groups of num_generations=2
    std = r.std(dim=1, keepdim=True)  # trl's nanstd: Bessel's correction (n - 1)
    expected = ((r - r.mean(dim=1, keepdim=True)) / (std + 1e-4)).flatten()
    assert torch.allclose(out["advantages"].double(), expected, atol=1e-4), (out["advantages"], expected)
    assert expected.abs().max() > 0.1  # the answers of a group did differ
    # trl's logged mean reward is the weighted sum over the batch
    assert trainer._metrics["train"]["reward"][-1] == pytest.approx(sum(rewards) / len(rewards), abs=1e-4)


# ---------------------------------------------------------------------------------------------
# The stage


def test_grpo_run_keeps_the_reference_grows_the_kl_and_writes_its_records(world, tmp_path):
    cfg = config(world, "rl.beta=0.1", "rl.max_prompts=4")  # 4 prompts x 2 answers / 4 a step: 2 steps
    s = RL.setup(cfg, world / "data")
    run = FakeRun()
    s.callback = RL.records_callback(run, s.rewards.names, 2)
    s.trainer = RL.make_trainer(s, cfg, callbacks=[s.callback])
    ref = s.trainer.ref_model
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    start = {k: v.clone() for k, v in s.trainer.model.state_dict().items()}
    assert all(torch.equal(before[k], start[k]) for k in start)  # the reference is the starting model
    s = RL.train(s, cfg, run)
    out = world / "checkpoints" / "rl"  # beside the SFT and the DPO model: their answers in the responses file
    metrics = RL.finish(
        s,
        cfg,
        run,
        out,
        tmp_path / "metrics" / "rl.json",
        tmp_path / "reports" / "rl_responses.jsonl",
        tmp_path / "plots",
    )

    after = s.trainer.ref_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bitwise unchanged
    assert any(not torch.equal(start[k], v) for k, v in s.trainer.model.state_dict().items())
    history = s.callback.train
    assert [r["step"] for r in history] == [1, 2]
    assert abs(history[0]["train_kl"]) < 1e-6  # policy = reference before the first update
    assert history[1]["train_kl"] > 1e-7  # after it, the KL the loss pays

    assert metrics["steps"] == 2 and metrics["train_prompts"] == 4 and metrics["heldout_prompts"] == 4
    for name in ("reward", "reward_model", "length", "format"):
        assert f"heldout_{name}" in metrics and f"heldout_{name}_before" in metrics
    assert json.loads((tmp_path / "metrics" / "rl.json").read_text()) == metrics
    logged = {k for m in run.metrics for k in m}
    assert {
        "train_reward",
        "train_reward_std",
        "train_kl",
        "train_answer_length",
        "train_clip_ratio",
        "train_reward_model",
        "train_length",
        "train_format",
    } <= logged
    csv = (tmp_path / "plots" / "rl.csv").read_text().splitlines()
    assert (
        csv[0]
        == ("step,train_reward,train_reward_std,train_kl,train_answer_length,train_clip_ratio,train_truncated_ratio")
        and len(csv) == 3
    )
    assert (tmp_path / "plots" / "rl.png").stat().st_size > 1000

    rows = [json.loads(line) for line in (tmp_path / "reports" / "rl_responses.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and set(rows[0]) == {
        "instruction",
        "input",
        "output",
        "sft_response",
        "dpo_response",
        "rl_response",
    }
    assert rows[0]["instruction"] == records(4, 200)[0]["instruction"]
    assert all(isinstance(r[k], str) for r in rows for k in ("sft_response", "dpo_response", "rl_response"))
    from gptforge.finetune.answer_quality import distinct_share, token_f1

    for key in ("sft", "dpo", "rl"):  # each stage's answers against the references, as the file has them
        assert metrics[f"token_f1_{key}"] == pytest.approx(
            sum(token_f1(r[f"{key}_response"], r["output"]) for r in rows) / len(rows)
        )
        assert metrics[f"distinct_share_{key}"] == pytest.approx(
            sum(distinct_share(r[f"{key}_response"]) for r in rows) / len(rows)
        )

    model = load_model(out / "final")  # a gptforge checkpoint again, with the trained weights
    from gptforge.modeling.hf_convert import to_hf

    ids = torch.tensor([[464, 3290, 318, 257]])
    with torch.no_grad():
        assert torch.allclose(
            to_hf(model)(input_ids=ids).logits, s.trainer.model.eval()(input_ids=ids).logits, atol=1e-5
        )


def test_rloo_with_lora_trains_the_adapter_against_the_base(world, tmp_path):
    cfg = config(
        world, "rl.algorithm=rloo", "rl.method=lora", "rl.max_prompts=2", "rl.lr=5e-3", "rl.rewards={length: 1.0}"
    )
    s = RL.setup(cfg, world / "data")
    base = {k: v.clone() for k, v in s.models.policy.get_base_model().state_dict().items() if "lora_" not in k}
    s = RL.train(s, cfg)
    assert s.trainer.ref_model is None  # the policy with its adapter disabled is the reference
    assert all(torch.equal(v, s.trainer.model.get_base_model().state_dict()[k]) for k, v in base.items())
    metrics = RL.finish(
        s, cfg, FakeRun(), tmp_path / "rl", tmp_path / "m.json", tmp_path / "r.jsonl", tmp_path / "plots"
    )
    assert metrics["steps"] == 1 and metrics["trainable_params"] < metrics["total_params"] / 10
    assert (tmp_path / "rl" / "adapter" / "adapter_config.json").is_file()
    load_model(tmp_path / "rl" / "final")  # merged into a gptforge checkpoint
    row = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])
    assert row["dpo_response"] is None  # no checkpoints/preference/final beside tmp_path/rl


def test_a_hugging_face_policy_stays_one_and_its_folder_is_the_reference(world, tmp_path):
    from hf_models import make_tiny_causal_lm
    from transformers import AutoModelForCausalLM

    llama = make_tiny_causal_lm(tmp_path / "llama")
    cfg = config(world, f"rl.init_from={llama}", "rl.template=chat", "rl.max_prompts=2")
    s = RL.train(RL.setup(cfg, world / "data"), cfg)
    assert s.trainer.ref_model.config._name_or_path == str(llama)  # trl loaded the starting folder, frozen
    metrics = RL.finish(
        s, cfg, FakeRun(), tmp_path / "rl", tmp_path / "m.json", tmp_path / "r.jsonl", tmp_path / "plots"
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "rl" / "final")
    assert model.config.model_type == "llama" and (tmp_path / "rl" / "final" / "tokenizer_config.json").is_file()
    assert metrics["steps"] == 1 and "heldout_reward_before" in metrics


def test_bf16_lora_on_a_hugging_face_policy_samples_and_trains(world, tmp_path):
    """A bf16 base with peft's fp32 adapters: trl samples outside the trainer's autocast, where
    the two dtypes met in one matmul and the stage died ("expected m1 and m2 to have the same
    dtype") until sampling ran under the accelerator's autocast too."""
    from hf_models import make_tiny_causal_lm

    llama = make_tiny_causal_lm(tmp_path / "llama")
    cfg = config(
        world, f"rl.init_from={llama}", "rl.template=chat", "rl.method=lora", "rl.precision=bf16", "rl.max_prompts=2"
    )
    s = RL.setup(cfg, world / "data")
    params = dict(s.models.policy.named_parameters())
    # the case itself: bf16 linears of the base under fp32 adapters
    assert {p.dtype for n, p in params.items() if "lora_" in n} == {torch.float32}
    assert any(p.dtype == torch.bfloat16 for n, p in params.items() if n.endswith("base_layer.weight"))
    s = RL.train(s, cfg)
    assert s.trainer.state.global_step == 1


# ---------------------------------------------------------------------------------------------
# The rewards against their formulas


def test_weighted_reward_is_the_sum_of_weight_times_each_reward(world, monkeypatch):
    from gptforge.finetune import answer_quality

    rec = {"instruction": "Describe the sky in a few words.", "input": "", "output": "Blue and wide."}
    answers = [
        R.Answer(rec, "Q: ", "Blue and wide.", 4, True),
        R.Answer(rec, "Q: ", " It goes on", 3, False),  # cut at the limit: not ended
        R.Answer(rec, "Q: ", "describe the SKY in a few   words. Blue.", 10, True),  # repeats the prompt
        R.Answer(rec, "Q: ", "Blue.\n### Instruction:\nMore", 7, True),  # a template marker
        R.Answer(rec, "Q: ", "", 0, True),
    ]
    assert [R.format_reward(a) for a in answers] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [R.length_reward(a, 4) for a in answers] == [0.0, -0.25, -1.5, -0.75, -1.0]

    judged = iter([[80, None, 20, 0, 100]])
    monkeypatch.setattr(
        answer_quality, "judge_scores", lambda rows, **kw: answer_quality.JudgeResult(scores=next(judged))
    )
    weights = {"reward_model": 0.5, "length": 2.0, "format": 1.5, "judge": 3.0}
    judge = type("Judge", (), {"url": "http://127.0.0.1:9/v1", "model": "m"})()
    rm = R.RewardModel(str(world / "reward"), torch.device("cpu"))
    rewards = R.Rewards(weights, length_target=4, reward_model=rm, judge=judge)
    components = rewards.components(answers)

    texts = [
        "Q: Blue and wide.<|endoftext|>",
        "Q:  It goes on",
        "Q: describe the SKY in a few   words. Blue.<|endoftext|>",
        "Q: Blue.\n### Instruction:\nMore<|endoftext|>",
        "Q: <|endoftext|>",
    ]
    with torch.no_grad():
        scores = [float(rm.model(**rm.tokenizer([t], return_tensors="pt")).logits[0, 0]) for t in texts]
    assert components["reward_model"] == pytest.approx(scores, abs=1e-5)
    assert components["judge"] == [0.8, None, 0.2, 0.0, 1.0]
    expected = [
        0.5 * scores[i]
        + 2.0 * R.length_reward(a, 4)
        + 1.5 * R.format_reward(a)
        + (3.0 * components["judge"][i] if components["judge"][i] is not None else 0.0)
        for i, a in enumerate(answers)
    ]
    assert rewards.weighted(components) == pytest.approx(expected, abs=1e-6)
    assert R.weighted_sum({"length": [None], "format": [None]}, {"length": 1, "format": 1}) == [None]


# ---------------------------------------------------------------------------------------------
# Bad input: one line, before any model loads


def no_models(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(RL, "load_models", refuse)
    monkeypatch.setattr(R.RewardModel, "__init__", refuse)


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", r"rl.reward_model: .*missing not found; run `gptforge finetune reward` first"),
        ("no_tokenizer", r"rl.reward_model: .* has no tokenizer"),
        ("causal_lm", r"rl.reward_model: .* is a GPT2LMHeadModel, not a sequence classifier"),
        ("judge", r"rl.rewards: judge needs an endpoint: set instruct.judge.url and instruct.judge.model"),
        ("chat", r"instruct.template: chat uses the model's own chat template; gptforge's GPT models have none"),
    ],
)
def test_bad_inputs_are_one_line_before_any_model_loads(world, tmp_path, monkeypatch, case, match):
    no_models(monkeypatch)
    folder = tmp_path / case
    extra = [f"rl.reward_model={folder}"]
    if case == "no_tokenizer":
        folder.mkdir()
        (folder / "config.json").write_text((world / "reward" / "config.json").read_text())
    elif case == "causal_lm":
        folder.mkdir()
        hf_config = json.loads((world / "reward" / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**hf_config, "architectures": ["GPT2LMHeadModel"]}))
    elif case == "judge":
        extra = ["rl.rewards={length: 1.0, judge: 1.0}"]
    elif case == "chat":
        extra = ["rl.template=chat"]
    with pytest.raises(BadInput, match=match) as err:
        RL.setup(config(world, *extra), world / "data")
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_cli_runs_the_stage(world, tmp_path):
    """`gptforge finetune rl` in a folder with the pipeline's layout writes the stage's outputs."""
    import shutil

    for sub in ("checkpoints/instruct/final", "reward"):
        shutil.copytree(world / sub, tmp_path / sub)
    shutil.copytree(world / "data", tmp_path / "data" / "instruct")
    args = [
        "finetune",
        "rl",
        "-S",
        f"tokenizer.path={TOKENIZER}",
        "-S",
        "tracking.enabled=false",
        "-S",
        "rl.reward_model=reward",
        "-S",
        "rl.template=phi3",
        "-S",
        "rl.num_generations=2",
        "-S",
        "rl.batch_size=2",
        "-S",
        "rl.max_completion_length=6",
        "-S",
        "rl.max_new_tokens=6",
        "-S",
        "rl.max_prompts=2",
        "-S",
        "rl.n_responses=1",
    ]
    out = run_cli(args, tmp_path, cli_env(GPTFORGE_PREFECT="0"))
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics" / "rl.json").read_text())
    assert metrics["steps"] == 2 and "heldout_reward" in metrics and "heldout_reward_before" in metrics
    assert (tmp_path / "reports" / "rl_responses.jsonl").is_file() and (tmp_path / "plots" / "rl.csv").is_file()
    load_model(tmp_path / "checkpoints" / "rl" / "final")


@pytest.mark.slow
def test_dvc_repro_trains_a_reward_model_that_ranks_better_and_rl_that_raises_the_heldout_reward(repo_copy):
    """The two stages as `dvc repro` runs them, on fixtures (the quickstart's chain is minutes
    here; `make run` shows the same two conditions on it): the reward model ranks held-out pairs
    better than before training and above chance, and GRPO against it raises the held-out
    reward of the starting model's greedy answers."""
    import test_finetune_preference as pref
    from cli_support import set_params
    from test_dvc import dvc, ran_stages

    repo = repo_copy
    sft = tiny_gpt(repo / "checkpoints" / "instruct" / "final")
    tiny_gpt(repo / "checkpoints" / "preference" / "final", seed=1)  # the DPO column of the responses
    pref.write_splits(repo / "data" / "preference")  # polite chosen, rude rejected answers
    write_splits(repo / "data" / "instruct")
    set_params(
        repo,
        **{
            "tokenizer.path": TOKENIZER,
            "tracking.enabled": False,
            "instruct.template": "phi3",
            # the quickstart's alignment runs on SmolLM2 (chat template, LoRA, 160 positions): the
            # tiny GPT here takes the instruct stage's template and its own positions
            "reward.template": None,
            "reward.method": "full",
            "reward.max_length": None,
            "reward.max_samples": None,
            "rl.template": None,
            "rl.method": "full",
            "rl.max_heldout": None,
            "reward.init_from": str(sft),
            "reward.batch_size": 4,
            "reward.lr": 1e-3,
            "reward.epochs": 2,
            "reward.eval_interval": 1000,
            "rl.init_from": str(sft),
            "rl.num_generations": 4,
            "rl.batch_size": 8,
            "rl.max_prompts": 16,
            "rl.max_completion_length": 8,
            "rl.max_new_tokens": 8,
            "rl.lr": 1e-3,
            "rl.n_responses": 2,
        },
    )
    env = cli_env(GPTFORGE_PREFECT="0")
    for stage in ("train_reward", "finetune_rl"):  # --single-item: the fixtures stand in for the stages before
        out = dvc(repo, "repro", "--single-item", stage, env=env, timeout=600)
        assert out.returncode == 0 and ran_stages(out.stdout) == [stage], out.stdout[-3000:] + out.stderr[-3000:]

    reward = json.loads((repo / "metrics" / "reward.json").read_text())
    assert reward["val_accuracy"] > max(0.6, reward["val_accuracy_before"]), reward
    rl = json.loads((repo / "metrics" / "rl.json").read_text())
    print(
        f"reward model {reward['val_accuracy_before']:.3f} -> {reward['val_accuracy']:.3f}; held-out reward "
        f"{rl['heldout_reward_before']:.4f} -> {rl['heldout_reward']:.4f}"
    )
    assert rl["heldout_reward"] > rl["heldout_reward_before"], rl
    assert rl["steps"] == 8 and (repo / "plots" / "rl.png").is_file()
    shown = dvc(repo, "metrics", "show", "--json", env=env)
    assert "heldout_reward_before" in shown.stdout and "val_accuracy_before" in shown.stdout


def test_the_sft_beside_rl_is_where_rl_or_dpo_started(tmp_path):
    from gptforge.config.load import load_config
    from gptforge.finetune.rl import comparison_folders

    out = tmp_path / "checkpoints" / "rl"
    dpo = tmp_path / "checkpoints" / "preference" / "final"
    dpo.mkdir(parents=True)
    sft = str(tmp_path / "checkpoints" / "instruct_smollm2" / "final")
    # the quickstart: RL from the SFT, the DPO model beside it
    cfg = load_config(None, [f"rl.init_from={sft}", f"preference.init_from={sft}"])
    assert comparison_folders(cfg, out) == {"sft": Path(sft), "dpo": dpo}
    # RL after DPO: the SFT is the model DPO started from
    cfg = load_config(None, [f"rl.init_from={dpo}", "preference.init_from=checkpoints/instruct/final"])
    assert comparison_folders(cfg, out) == {"sft": Path("checkpoints/instruct/final"), "dpo": dpo}
