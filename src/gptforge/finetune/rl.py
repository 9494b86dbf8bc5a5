"""`gptforge finetune rl`: online RL on the instruction prompts through trl (GRPO, or RLOO).

RLHF's second half as a stage: the instruction prompts of data/instruct/train.jsonl (the first
`rl.max_prompts`), each in the SFT stage's template (the prompt part of `templates.encode`) ->
`rl.num_generations` sampled answers per prompt (a group) of up to `rl.max_completion_length`
tokens -> each answer scored by the rewards of `rl.rewards` (rewards.py: the reward model, a
length rule, a format rule, the judge endpoint), weighted and summed -> trl's `GRPOTrainer`
(advantage (r - group mean) / (group std + 1e-4)) or `RLOOTrainer` (r - the mean of the other
answers of the group), which own the loss, the clipping and the KL to the frozen reference
(weight `rl.beta`; trl's GRPO default 0 would skip the reference). No vLLM: transformers'
`generate` samples.

The policy starts from `rl.init_from` (the SFT model; checkpoints/preference/final for RL after
DPO). gptforge's GPT goes to trl as transformers' GPT-2 (`to_hf`) and comes back (`from_hf`);
another Hugging Face causal LM stays one. The reference is the starting model, frozen: under
`method: full` trl loads it from the folder in the policy's `config._name_or_path` (for our
GPT, its Hugging Face form written to the run's temporary folder), under `method: lora` it is
the policy with the adapter off. trl gets the prompts as our template's token ids
(`_tokenize_prompts` is the one method overridden), so they are exactly the SFT stage's.

Held-out figures: all prompts of data/instruct/test.jsonl that fit (not only the first
`n_responses`: a reward averaged over 5 answers is noise), answered greedily (deterministic) in
left-padded batches, up to `max_completion_length` tokens as in training, and scored by the
same rewards: `heldout_reward` (the weighted sum the training optimizes) and each reward
`heldout_NAME` after training, and the same with `_before` for the starting model.

What it writes:
- `checkpoints/rl/final/`: the trained model (LoRA merged), a gptforge checkpoint or a Hugging
  Face folder as the model it started from; `checkpoints/rl/adapter/` under lora;
- `metrics/rl.json`: the held-out rewards before and after, train_prompts, heldout_prompts,
  skipped_too_long, steps, train_seconds, trainable_params, total_params;
- `plots/rl.csv` (per step: mean reward and its std over the batch's answers, KL to the
  reference, answer length, PPO clip ratio, share of answers cut at max_completion_length) and
  `plots/rl.png`; per step the MLflow run gets these and each reward's mean (`train_NAME`);
- `reports/rl_responses.jsonl`: the first `n_responses` test prompts with the reference and the
  SFT (the starting model; for RL after DPO, `preference.init_from`), the DPO
  (checkpoints/preference/final, when there) and the RL model's greedy answers side by side.
  `rl.max_heldout` limits the held-out prompts to the test split's first N.

The prompts are encoded in `rl_prompts.py`; the models loaded in `rl_models.py`, their greedy
answers made by `hf_models.batched_greedy`; the rewards are in `rewards.py`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn

from gptforge.config.schema import Config
from gptforge.errors import BadInput
from gptforge.finetune import rewards as R
from gptforge.finetune import trl_policy
from gptforge.finetune.common import check_max_length, check_whole_batch, runtime, save_png, trainable_params
from gptforge.finetune.hf_models import batched_greedy as greedy
from gptforge.finetune.instruct import read_split
from gptforge.finetune.preference_models import model_family
from gptforge.finetune.rl_models import PARAM, Models, answer, decode, load_models, load_other, make_answers
from gptforge.finetune.rl_prompts import FIELDS, Prompts, encode_prompts
from gptforge.finetune.templates import chat_template_tokenizer
from gptforge.finetune.trl_records import records_callback as trl_records
from gptforge.finetune.trl_records import write_csv
from gptforge.io import atomic_file
from gptforge.modeling.hf_causal import hf_source
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics
from gptforge.training.runtime import Runtime

log = logging.getLogger("gptforge")

CURVES = (
    "train_reward",
    "train_reward_std",
    "train_kl",
    "train_answer_length",
    "train_clip_ratio",
    "train_truncated_ratio",
)
# trl's log names -> ours, logged as train_<ours> (the rewards' own: rewards/NAME/mean -> train_NAME)
METRIC_NAMES = {
    "reward": "reward",
    "reward_std": "reward_std",
    "kl": "kl",
    "completions/mean_length": "answer_length",
    "clip_ratio/region_mean": "clip_ratio",
    "completions/clipped_ratio": "truncated_ratio",
    "loss": "loss",
    "entropy": "entropy",
    "frac_reward_zero_std": "frac_reward_zero_std",
}


# ---------------------------------------------------------------------------------------------
# trl


def trainer_class(algorithm: str, prompt_ids: Mapping[str, list[int]]):
    """trl's GRPOTrainer (grpo) or RLOOTrainer (rloo) taking the prompts as our template's ids:
    `_tokenize_prompts` maps each prompt text of the dataset to them. Everything else is trl's."""
    if algorithm == "grpo":
        from trl import GRPOTrainer as Base
    else:
        from trl import RLOOTrainer as Base

    class PretokenizedTrainer(Base):
        def _tokenize_prompts(self, prompts):
            return [list(prompt_ids[p]) for p in prompts], None, {}

        def _generate_single_turn(self, *args, **kwargs):
            # trl samples outside the trainer's autocast: a bf16 model with fp32 LoRA weights
            # (peft keeps adapters in fp32) fails there ("expected m1 and m2 to have the same
            # dtype"). Under the accelerator's autocast they meet in bf16, as in training.
            with self.accelerator.autocast():
                return super()._generate_single_turn(*args, **kwargs)

    return PretokenizedTrainer


def make_trainer(s: Session, cfg: Config, callbacks: Sequence[Any] = ()):
    """The trainer over the first `max_prompts` training prompts, one reward function per
    named reward, weighted by `rl.rewards`."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    c, rt, models = cfg.rl, s.rt, s.models
    if c.algorithm == "grpo":
        from trl import GRPOConfig as ArgsClass
    else:
        from trl import RLOOConfig as ArgsClass
    args = ArgsClass(
        output_dir=s.workdir,
        report_to="none",
        save_strategy="no",
        seed=c.seed,
        data_seed=c.seed,
        # rl.batch_size answers (batch_size / num_generations prompts) per step, shared by the processes
        per_device_train_batch_size=c.batch_size // rt.world_size,
        num_train_epochs=c.epochs,
        learning_rate=c.lr,
        weight_decay=c.weight_decay,
        lr_scheduler_type="constant",
        logging_steps=1,
        num_generations=c.num_generations,
        max_completion_length=c.max_completion_length,
        temperature=c.temperature,
        beta=c.beta,
        reward_weights=[c.rewards[n] for n in s.rewards.names],
        disable_dropout=True,
        activation_checkpointing=c.gradient_checkpointing,
        remove_unused_columns=False,
        bf16=rt.precision == "bf16",
        fp16=rt.precision == "fp16",
        use_cpu=rt.device.type == "cpu",
        dataloader_pin_memory=rt.device.type == "cuda",
        disable_tqdm=True,
    )
    prompts = s.prompts["train"]
    by_text = dict(zip(prompts.texts, prompts.ids))

    def answers_of(prompts_, completions, completion_ids, instruction, input, output, **_):
        return [
            answer({"instruction": i, "input": n, "output": o}, p, ids, models)
            for p, ids, i, n, o in zip(prompts_, completion_ids, instruction, input, output)
        ]

    trainer = trainer_class(c.algorithm, by_text)(
        model=models.policy,
        reward_funcs=s.rewards.trl_functions(answers_of),
        args=args,
        train_dataset=Dataset.from_list(prompts.rows(c.max_prompts)),
        processing_class=models.tokenizer,
        callbacks=list(callbacks),
    )
    for cb in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(cb)  # they print every log dict; Records shows a bar instead
    if trainer.ref_model is not None:  # trl only runs it under no_grad: frozen it is, and says so
        trainer.ref_model.eval().requires_grad_(False)
    return trainer


def records_callback(run, reward_names: Sequence[str], total_steps: int):
    """trl_records.records_callback with the RL stage's names (METRIC_NAMES, and each reward's
    mean as train_NAME): trl's per-step logs to the MLflow run, kept for the plot, and a progress
    bar with the loss and the mean reward."""

    names = {**METRIC_NAMES, **{f"rewards/{n}/mean": n for n in reward_names}}
    return trl_records(run, total_steps, names=names, desc="rl", shown=("reward", "train_reward"))


# ---------------------------------------------------------------------------------------------
# The recipe


@dataclass
class Session:
    """What the recipe's steps hand each other."""

    models: Models
    prompts: dict[str, Prompts]
    rewards: R.Rewards
    rt: Runtime
    template: str
    workdir: str
    n_responses: int = 0
    before_ids: list[list[int]] = field(default_factory=list)  # the starting model's held-out answers
    before_display: list[list[int]] = field(default_factory=list)  # ... to the first n_responses, max_new_tokens
    before: dict[str, float] = field(default_factory=dict)
    trainer: Any = None
    callback: Any = None
    train_seconds: float = 0.0


def comparison_folders(cfg: Config, out_dir: Path) -> dict[str, Path]:
    """The SFT and DPO models whose answers go beside the RL model's: the SFT is the model RL
    starts from (or, for RL after DPO, the one DPO started from); the DPO model is
    checkpoints/preference/final beside checkpoints/rl."""
    dpo = out_dir.parent / "preference" / "final"
    start = Path(cfg.rl.init_from).expanduser()
    after_dpo = dpo.is_dir() and start.resolve() == dpo.resolve()
    return {"sft": Path(cfg.preference.init_from).expanduser() if after_dpo else start, "dpo": dpo}


def display_answers(model: nn.Module, s: Session, cfg: Config, scored: Sequence[list[int]] | None = None):
    """The answers for the responses file: the first n_responses held-out prompts, up to
    max_new_tokens (the scored answers cut, when they are long enough: greedy is a prefix)."""
    c, test = cfg.rl, s.prompts["test"]
    if scored is not None and c.max_new_tokens <= c.max_completion_length:
        return [a[: c.max_new_tokens] for a in scored[: s.n_responses]]
    return greedy(
        model,
        test.ids[: s.n_responses],
        limit=c.max_new_tokens,
        stops=s.models.stops,
        pad_id=s.models.tokenizer.pad_token_id,
        rt=s.rt,
    )


def heldout(model: nn.Module, s: Session, cfg: Config) -> list[list[int]]:
    return greedy(
        model,
        s.prompts["test"].ids,
        limit=cfg.rl.max_completion_length,
        stops=s.models.stops,
        pad_id=s.models.tokenizer.pad_token_id,
        rt=s.rt,
    )


def setup(cfg: Config, data_dir: str | os.PathLike, run=NullRun()) -> Session:
    """Input checks (before any model loads), the models, the rewards, the encoded prompts, and
    the starting model's held-out answers and rewards."""
    c = cfg.rl
    rt = runtime(c.device, c.precision, param=PARAM)
    check_whole_batch(PARAM, c.batch_size, rt.world_size)
    R.check(c, cfg.instruct.judge)
    records = {name: read_split(Path(data_dir) / f"{name}.jsonl") for name in ("train", "test")}
    model_family(c.init_from, param=f"{PARAM}.init_from")  # a missing folder: one line, before loading
    template = c.template or cfg.instruct.template
    if template == "chat" and hf_source(c.init_from) is None:
        chat_template_tokenizer(None)  # raises: our GPT's tokenizer (tiktoken) has no chat template

    workdir = tempfile.mkdtemp(prefix="gptforge-rl-")  # trl's output_dir (nothing saved) and the reference
    try:
        return _setup(cfg, rt, records, template, workdir, run)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


def _setup(cfg: Config, rt: Runtime, records: dict, template: str, workdir: str, run) -> Session:
    c = cfg.rl
    models = load_models(cfg, rt, workdir)
    max_length = check_max_length(c.max_length, models.policy, f"{PARAM}.max_length")
    if c.max_completion_length >= max_length:
        raise BadInput(
            f"{PARAM}.max_completion_length ({c.max_completion_length}) leaves no room for a prompt in "
            f"{PARAM}.max_length ({max_length})"
        )
    prompts = {
        k: encode_prompts(v, template, models.enc, max_length - c.max_completion_length) for k, v in records.items()
    }
    for name, p in prompts.items():
        if not p.ids:
            raise BadInput(
                f"instruct data: none of the {len(p.records)} {name} prompts leaves "
                f"{PARAM}.max_completion_length={c.max_completion_length} tokens in {PARAM}.max_length="
                f"{max_length}"
            )
        if p.skipped_too_long:
            log.warning(
                "rl: skipped %d %s prompt(s) longer than max_length - max_completion_length = %d tokens",
                p.skipped_too_long,
                name,
                max_length - c.max_completion_length,
            )
    prompts["test"] = prompts["test"].head(c.max_heldout)  # rl.max_heldout: the first N answered
    reward_model = R.RewardModel(c.reward_model, rt.device) if "reward_model" in c.rewards else None
    rewards = R.Rewards(c.rewards, length_target=c.length_target, reward_model=reward_model, judge=cfg.instruct.judge)
    s = Session(models, prompts, rewards, rt, template, workdir)
    if rt.master:  # under torchrun process 0 answers (before and after) and writes
        n = len(prompts["test"].ids)
        s.n_responses = n if c.n_responses is None else min(c.n_responses, n)
        s.before_ids = heldout(models.policy, s, cfg)
        s.before = R.summary(rewards, make_answers(prompts["test"], s.before_ids, models), "_before")
        s.before_display = display_answers(models.policy, s, cfg, s.before_ids)
    if models.gpt is not None:
        models.gpt.to("cpu")  # only its config is needed from here on
    n_train, n_total = trainable_params(models.policy)
    log.info(
        "rl: %s (%s, beta %g, %d answers per prompt, rewards %s), %d of %d parameters train; template %s; "
        "%d train prompts, %d held out",
        c.algorithm.upper(),
        c.method,
        c.beta,
        c.num_generations,
        ", ".join(f"{k} x {w:g}" for k, w in c.rewards.items()),
        n_train,
        n_total,
        template,
        min(len(prompts["train"].ids), c.max_prompts or len(prompts["train"].ids)),
        len(prompts["test"].ids),
    )
    run.log_metrics({"trainable_params": n_train, "total_params": n_total})
    return s


def train(s: Session, cfg: Config, run=NullRun()) -> Session:
    """trl's RL epochs over the training prompts."""
    import math

    c = cfg.rl
    torch.manual_seed(c.seed)
    if s.trainer is None:  # (a test may have made it, to look at it first)
        n_prompts = min(len(s.prompts["train"].ids), c.max_prompts or len(s.prompts["train"].ids))
        s.callback = records_callback(
            run, s.rewards.names, math.ceil(n_prompts * c.num_generations / c.batch_size) * c.epochs
        )
        s.trainer = make_trainer(s, cfg, callbacks=[s.callback])
    s.rt.sync()
    t0 = time.perf_counter()
    s.trainer.train()
    s.rt.sync()
    s.train_seconds = time.perf_counter() - t0
    return s


def answer_scores(rows: list[dict]) -> dict:
    """Token F1 against the reference and the distinct-token share of the SFT, DPO and RL
    answers in the responses file (`token_f1_sft`, `distinct_share_rl`, ...): whether each stage
    kept its answers answers while the reward moved."""
    from gptforge.finetune.answer_quality import reference_scores

    out = {}
    for key in ("sft", "dpo", "rl"):
        scored = [
            {"response": r[f"{key}_response"], "reference": r["output"]}
            for r in rows
            if r.get(f"{key}_response") is not None
        ]
        if scored:
            scores = reference_scores(scored)
            out.update({f"token_f1_{key}": scores["token_f1"], f"distinct_share_{key}": scores["distinct_share"]})
    return out


def finish(
    s: Session,
    cfg: Config,
    run=NullRun(),
    out_dir: str | os.PathLike = "checkpoints/rl",
    metrics_path: str | os.PathLike = "metrics/rl.json",
    responses_path: str | os.PathLike = "reports/rl_responses.jsonl",
    plots_dir: str | os.PathLike = "plots",
) -> dict:
    """Save the adapter, merge it, score the held-out answers, answer beside the SFT and DPO
    models, and write the model, the records and the metrics."""
    c, out_dir, plots_dir = cfg.rl, Path(out_dir), Path(plots_dir)
    if not s.rt.master:  # under torchrun trl's trainer has kept every process's copy equal
        shutil.rmtree(s.workdir, ignore_errors=True)
        return {}
    n_train, n_total = trainable_params(s.trainer.model)
    trained = trl_policy.merged(s.trainer.model, method=c.method, out_dir=out_dir, started_as=s.models.gpt)
    model = trained.model
    after_ids = heldout(model, s, cfg)
    after = R.summary(s.rewards, make_answers(s.prompts["test"], after_ids, s.models))
    rl_display = display_answers(model, s, cfg, after_ids)

    others = {}
    for key, folder in comparison_folders(cfg, out_dir).items():
        if folder.is_dir() and folder.resolve() == Path(c.init_from).expanduser().resolve():
            others[key] = s.before_display
        elif folder.is_dir():
            other = load_other(folder, cfg, s.models, s.rt)
            others[key] = None if other is None else display_answers(other, s, cfg)
            del other
        else:
            others[key] = s.before_display if key == "sft" else None
    rows = []
    with atomic_file(responses_path, "w", encoding="utf-8") as f:
        test = s.prompts["test"]
        for j in range(s.n_responses):
            rec = test.records[test.kept[j]]
            row = {k: rec[k] for k in FIELDS}
            for key in ("sft", "dpo"):
                row[f"{key}_response"] = None if others[key] is None else decode(others[key][j], s.models).strip()
            row["rl_response"] = decode(rl_display[j], s.models).strip()
            rows.append(row)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    final = trl_policy.save(trained, s.models.tokenizer, out_dir / "final")

    history = s.callback.train
    write_csv(plots_dir / "rl.csv", history, ["step", *CURVES])
    png = plot_rl(history, plots_dir / "rl.png")

    steps = s.trainer.state.global_step
    metrics = {
        **after,
        **s.before,
        **answer_scores(rows),
        "train_prompts": min(len(s.prompts["train"].ids), c.max_prompts or len(s.prompts["train"].ids)),
        "heldout_prompts": len(s.prompts["test"].ids),
        "skipped_too_long": sum(p.skipped_too_long for p in s.prompts.values()),
        "steps": steps,
        "train_seconds": s.train_seconds,
        "trainable_params": n_train,
        "total_params": n_total,
    }
    publish_metrics(run, metrics, metrics_path)
    run.log_artifact(responses_path)
    for path in (plots_dir / "rl.csv", png):
        if path is not None:
            run.log_artifact(path)
    trl_policy.log(run, trained, final)
    shutil.rmtree(s.workdir, ignore_errors=True)
    log.info(
        "rl done: %d steps over %d prompts in %.1f s; held-out reward %.4f -> %.4f",
        steps,
        metrics["train_prompts"],
        s.train_seconds,
        metrics.get("heldout_reward_before", float("nan")),
        metrics.get("heldout_reward", float("nan")),
    )
    return metrics


def plot_rl(history: Sequence[dict], path: Path) -> Path | None:
    """Three panels over the steps: mean reward (and its std band), KL to the reference, answer
    length; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    steps = [r["step"] for r in history]
    for ax, key, label in zip(
        axes,
        ("train_reward", "train_kl", "train_answer_length"),
        ("mean reward (weighted sum)", "KL to the reference", "answer length (tokens)"),
    ):
        ys = [r.get(key, float("nan")) for r in history]
        ax.plot(steps, ys, "o-" if len(steps) < 30 else "-", markersize=3, linewidth=0.9)
        if key == "train_reward":
            std = [r.get("train_reward_std", 0.0) for r in history]
            ax.fill_between(steps, [y - d for y, d in zip(ys, std)], [y + d for y, d in zip(ys, std)], alpha=0.2)
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    return save_png(fig, path)


def finetune_rl(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run=NullRun(),
    data_dir: str | os.PathLike = "data/instruct",
    out_dir: str | os.PathLike = "checkpoints/rl",
    metrics_path: str | os.PathLike = "metrics/rl.json",
    responses_path: str | os.PathLike = "reports/rl_responses.jsonl",
    plots_dir: str | os.PathLike = "plots",
) -> dict:
    """The stage: set up, train, finish (each a step: a Prefect task under PrefectSteps)."""
    session = steps(setup, cfg, data_dir, run)
    session = steps(train, session, cfg, run)
    return steps(finish, session, cfg, run, out_dir, metrics_path, responses_path, plots_dir)
