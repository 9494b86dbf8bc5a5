"""The RL stage's rewards (`rl.rewards`: NAME -> weight): each reward by name, and their weighted sum.

An answer (`Answer`) is scored by every named reward; each returns one number per answer, or
None where it cannot score it (a judge reply that is not a number):

- `reward_model`: the score (the one logit) of the sequence-classification folder
  `rl.reward_model` on the prompt's text followed by the answer's, tokenized by the reward
  model's own tokenizer, with that tokenizer's eos appended when the answer ended on its own
  (trl's RewardTrainer appends it to the pairs it trains on: a finished answer ends in eos);
  a text longer than the reward model's positions loses the start of its prompt.
- `length`: -|n - length_target| / length_target, n the answer's tokens (its stop token not
  counted): 0 at the target, -1 for an empty answer or one twice the target.
- `format`: 1 when the answer (a) ended on its own (an end-of-text or end-of-turn id within
  `rl.max_completion_length` tokens), (b) has text, and (c) does not repeat the prompt: neither
  the instruction (when it has 12 characters or more, compared lowercased with spaces folded)
  nor a template marker (`### Instruction:`, `### Input:`, `### Response:`, `<|user|>`,
  `<|assistant|>`, `<|end|>`) appears in it; else 0.
- `judge`: the 0-100 score of the endpoint `instruct.judge` (answer_quality.judge_scores:
  LLMs-from-scratch ch. 7's prompt, with the record's reference output) / 100; None unscored.

`weighted` is what the training optimizes: sum over k of weight_k x reward_k per answer, a
missing reward counted as 0 (trl's `nansum`), None when every reward is missing. A reward with
weight 0 is computed and logged but does not move the policy.

`check` says in one line (BadInput) what is wrong with the rewards' inputs before any model
loads: a reward model folder that is missing, is not a sequence classifier or has no tokenizer;
`judge` named with no endpoint.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gptforge.errors import BadInput

log = logging.getLogger("gptforge")

MARKERS = ("### Instruction:", "### Input:", "### Response:", "<|user|>", "<|assistant|>", "<|end|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
MIN_ECHO = 12  # characters: shorter instructions ("Sort.") may well be part of a good answer


@dataclass(frozen=True)
class Answer:
    """One answer to score: the prompt's record and text, the answer's text (special tokens
    left out), its token count without the stop token, and whether it ended on its own."""

    record: Mapping[str, str]  # instruction, input, output (the reference answer)
    prompt: str
    text: str
    tokens: int
    ended: bool


def answer_from_ids(record: Mapping[str, str], prompt: str, text: str, ids: Sequence[int], stops) -> Answer:
    """An Answer from the generated ids (cut after the first stop id, which they keep)."""
    ended = bool(ids) and int(ids[-1]) in stops
    return Answer(record, prompt, text, len(ids) - int(ended), ended)


# ---------------------------------------------------------------------------------------------
# The rules


def length_reward(answer: Answer, target: int) -> float:
    return -abs(answer.tokens - target) / target


def _fold(text: str) -> str:
    return " ".join(text.lower().split())


def format_reward(answer: Answer) -> float:
    text = answer.text.strip()
    if not (answer.ended and text):
        return 0.0
    if any(marker in text for marker in MARKERS):
        return 0.0
    instruction = _fold(answer.record.get("instruction", ""))
    if len(instruction) >= MIN_ECHO and instruction in _fold(text):
        return 0.0
    return 1.0


# ---------------------------------------------------------------------------------------------
# The reward model


def check_reward_model(folder: str, param: str = "rl.reward_model") -> Path:
    """The folder, when it holds a Hugging Face sequence classifier with one score and its
    tokenizer; BadInput in one line otherwise. Reads config.json only: no model loads."""
    from gptforge.modeling.hf_causal import hf_config_dict

    path = Path(folder).expanduser()
    if not path.is_dir():
        raise BadInput(
            f"{param}: {folder} not found; run `gptforge finetune reward` first, or name a Hugging Face "
            "sequence-classification folder with its tokenizer"
        )
    config = hf_config_dict(path / "config.json")
    if config is None:
        raise BadInput(
            f"{param}: {folder} is not a Hugging Face model folder (no readable config.json with a model_type)"
        )
    archs = config.get("architectures") or []
    if archs and not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise BadInput(
            f"{param}: {folder} is a {archs[0]}, not a sequence classifier (a model with a scalar reward "
            "head: the train_reward stage writes one)"
        )
    labels = config.get("id2label")
    if isinstance(labels, dict) and len(labels) != 1:
        raise BadInput(f"{param}: {folder} has {len(labels)} labels; a reward model has one score (num_labels 1)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise BadInput(
            f"{param}: {folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}); the reward model scores "
            "text in its own tokenizer: save it with the model (the train_reward stage does)"
        )
    return path


class RewardModel:
    """A sequence classifier scoring prompt + answer texts in its own tokenizer (frozen, eval)."""

    def __init__(self, folder: str, device, batch_size: int = 32) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_reward_model(folder)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
            self.model = AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=1)
        except Exception as e:  # noqa: BLE001 - unreadable weights or tokenizer: one line
            raise BadInput(f"rl.reward_model: cannot load {folder} ({' '.join(str(e).split())[:200]})") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # the score is read at the last token that is not padding (transformers' rule): the model
        # must know the pad id, as trl's GRPOTrainer sets it
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.batch_size, self.torch = device, batch_size, torch
        # a text longer than the model's positions loses its start (the prompt's preamble), not
        # the answer's end, where the score is read
        positions = [getattr(self.model.config, k, None) for k in ("max_position_embeddings", "n_positions")]
        self.max_length = min([int(self.tokenizer.model_max_length)] + [p for p in positions if p])
        self.tokenizer.truncation_side = "left"

    def text(self, answer: Answer) -> str:
        eos = self.tokenizer.eos_token if answer.ended and self.tokenizer.eos_token else ""
        return answer.prompt + answer.text + eos

    def __call__(self, answers: Sequence[Answer]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(answers), self.batch_size):
            texts = [self.text(a) for a in answers[start : start + self.batch_size]]
            batch = self.tokenizer(
                texts,
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
                truncation=True,
                max_length=self.max_length,
            )
            with self.torch.inference_mode():
                logits = self.model(**{k: v.to(self.device) for k, v in batch.items()}).logits
            scores += [float(x) for x in logits[:, 0].float().cpu()]
        return scores


# ---------------------------------------------------------------------------------------------
# All of them


def check(rl, judge) -> None:
    """The rewards' inputs (`rl` the config's rl section, `judge` instruct.judge), before any
    model loads. Unknown names are already refused by the config."""
    if "reward_model" in rl.rewards:
        check_reward_model(rl.reward_model)
    if "judge" in rl.rewards and not (judge.url and judge.model):
        raise BadInput(
            "rl.rewards: judge needs an endpoint: set instruct.judge.url and instruct.judge.model (an "
            "OpenAI-compatible server), or drop judge from rl.rewards"
        )


class Rewards:
    """The named rewards of `rl.rewards` with their weights: `components` scores answers by
    each, `weighted` sums them, `trl_functions` hands them to trl's trainers."""

    def __init__(
        self, weights: Mapping[str, float], *, length_target: int, reward_model: RewardModel | None = None, judge=None
    ) -> None:
        self.weights = dict(weights)
        self.names = list(self.weights)
        self.length_target = length_target
        self.reward_model = reward_model
        self.judge = judge  # instruct.judge (url, model)
        if "reward_model" in self.weights and reward_model is None:
            raise ValueError("Rewards: reward_model is weighted but no RewardModel was given")

    def score(self, name: str, answers: Sequence[Answer]) -> list[float | None]:
        if name == "length":
            return [length_reward(a, self.length_target) for a in answers]
        if name == "format":
            return [format_reward(a) for a in answers]
        if name == "reward_model":
            return list(self.reward_model(answers))
        if name == "judge":
            from gptforge.finetune.answer_quality import judge_scores

            rows = [
                {
                    "instruction": a.record.get("instruction", ""),
                    "input": a.record.get("input", ""),
                    "reference": a.record.get("output", ""),
                    "response": a.text,
                }
                for a in answers
            ]
            result = judge_scores(rows, url=self.judge.url, model=self.judge.model)
            return [None if s is None else s / 100 for s in result.scores]
        raise ValueError(f"unknown reward {name!r}")

    def components(self, answers: Sequence[Answer]) -> dict[str, list[float | None]]:
        return {name: self.score(name, answers) for name in self.names}

    def weighted(self, components: Mapping[str, Sequence[float | None]]) -> list[float | None]:
        return weighted_sum(components, self.weights)

    def trl_functions(self, make_answers: Callable[..., list[Answer]]) -> list[Callable]:
        """One function per reward, named by it (trl logs `rewards/NAME/mean`), taking trl's
        arguments (prompts, completions, completion_ids and the dataset's columns);
        `make_answers(prompts, completions, completion_ids, **columns)` makes the Answers."""
        functions = []
        for name in self.names:

            def reward(prompts, completions, completion_ids, _name=name, **columns: Any) -> list[float | None]:
                return self.score(_name, make_answers(prompts, completions, completion_ids, **columns))

            reward.__name__ = name
            functions.append(reward)
        return functions


def weighted_sum(components: Mapping[str, Sequence[float | None]], weights: Mapping[str, float]) -> list[float | None]:
    """Per answer, sum of weight x reward over the rewards that scored it (trl's nansum); None
    when none did."""
    n = len(next(iter(components.values()))) if components else 0
    out: list[float | None] = []
    for i in range(n):
        scored = [(weights[k], v[i]) for k, v in components.items() if v[i] is not None and not math.isnan(v[i])]
        out.append(sum(w * r for w, r in scored) if scored else None)
    return out


def mean(values: Sequence[float | None]) -> float | None:
    """The mean of the scored values (None and NaN left out); None when there are none."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else None


def summary(rewards: Rewards, answers: Sequence[Answer], suffix: str = "") -> dict[str, float]:
    """heldout_reward{suffix} (the mean weighted sum) and heldout_NAME{suffix} (each reward's
    mean) over the answers; a reward that scored none of them is left out."""
    components = rewards.components(answers)
    out = {}
    total = mean(rewards.weighted(components))
    if total is not None:
        out[f"heldout_reward{suffix}"] = total
    for name, values in components.items():
        m = mean(values)
        if m is not None:
            out[f"heldout_{name}{suffix}"] = m
    return out
