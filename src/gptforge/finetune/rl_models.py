"""The RL stage's models: the policy from `rl.init_from` (and the folder trl loads the frozen
reference from), the pipeline's other models (SFT, DPO) that answer the same prompts, and answers
made into the rewards' `Answer`s (the greedy answers themselves: `hf_models.batched_greedy`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn

from gptforge.config.schema import Config
from gptforge.errors import BadInput
from gptforge.finetune import rewards as R
from gptforge.finetune.common import apply_lora, load_base, load_hf_base
from gptforge.finetune.preference_models import model_family
from gptforge.finetune.rl_prompts import Prompts
from gptforge.modeling.hf_causal import HFTokenizer, hf_source, stop_ids
from gptforge.training.runtime import Runtime

log = logging.getLogger("gptforge")

PARAM = "rl"


# ---------------------------------------------------------------------------------------------
# Models


@dataclass
class Models:
    """The policy trl trains (a transformers model; a peft model under lora), the encoder the
    templates use, the tokenizer trl is given, and our GPT as loaded (None for a Hugging Face
    model): its config goes back out."""

    policy: nn.Module
    enc: Any
    tokenizer: Any
    gpt: Any = None
    stops: list[int] = field(default_factory=list)


def load_models(cfg: Config, rt: Runtime, workdir: str) -> Models:
    """The policy for `rl.init_from`; under method full with beta > 0, the folder trl loads the
    frozen reference from is set in `config._name_or_path`."""
    c = cfg.rl
    source = hf_source(c.init_from)
    reference = c.method == "full" and c.beta > 0
    if source is None:  # our GPT, trained by trl as transformers' GPT-2 with the same weights
        from gptforge.modeling.export import hf_tokenizer
        from gptforge.modeling.hf_convert import to_hf
        from gptforge.modeling.tokenizer import load_tokenizer

        enc = load_tokenizer(cfg.tokenizer.path)
        gpt = load_base(c.init_from, enc.n_vocab, param=f"{PARAM}.init_from")
        policy = to_hf(gpt).train()
        tokenizer = hf_tokenizer(cfg.tokenizer.path, gpt.config.block_size)
    else:
        policy, tokenizer = load_hf_base(source, rt, param=PARAM, lora=c.method == "lora")
        enc, gpt = HFTokenizer(tokenizer), None
    if reference and source is not None and Path(source).is_dir():
        policy.config._name_or_path = str(source)
    elif reference:  # our GPT has no Hugging Face folder; a hub id: the weights as loaded, not a second fetch
        folder = write_reference(policy, Path(workdir) / "reference")
        policy.config._name_or_path = str(folder)
    if tokenizer.pad_token is None:  # trl's rule too: pad with eos (padding is masked out)
        tokenizer.pad_token = tokenizer.eos_token
    stops = stop_ids(tokenizer, policy)
    policy.to(rt.device)
    if c.method == "lora":
        torch.manual_seed(c.seed)  # the adapters' init: the same in every run and on every process
        policy = apply_lora(policy, c.lora, task_type="CAUSAL_LM")
    return Models(policy, enc, tokenizer, gpt, stops)


def write_reference(policy: nn.Module, folder: Path) -> Path:
    """The starting model as the Hugging Face folder trl loads the frozen reference from, written
    by this process into its own temporary folder: transformers' save_pretrained writes on
    process 0 only once torch.distributed is up, which under torchrun left the other processes'
    folders empty. The config and the weights (safetensors drops the tied head, which loading
    ties again) are all from_pretrained needs."""
    from safetensors.torch import save_model as save_safetensors

    folder.mkdir(parents=True, exist_ok=True)
    policy.config.save_pretrained(str(folder))
    save_safetensors(policy, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def load_other(folder: Path, cfg: Config, models: Models, rt: Runtime) -> nn.Module | None:
    """Another model of the pipeline (the SFT or the DPO model) in its transformers form, to
    answer the same prompts; None (and a log line) when it is not of the policy's family."""
    try:
        family = model_family(str(folder), param=str(folder))
        if family != model_family(cfg.rl.init_from, param=f"{PARAM}.init_from"):
            log.warning("rl: %s is a %s model, not of the policy's family: its answers are left out", folder, family[0])
            return None
        if models.gpt is not None:
            from gptforge.modeling.hf_convert import to_hf

            return to_hf(load_base(str(folder), models.enc.n_vocab, param=str(folder))).to(rt.device)
        return load_hf_base(str(folder), rt, param=str(folder), lora=False)[0]
    except BadInput as e:
        log.warning("rl: cannot load %s (%s): its answers are left out", folder, e)
        return None


# ---------------------------------------------------------------------------------------------
# Answers


def make_answers(prompts: Prompts, ids: Sequence[list[int]], models: Models) -> list[R.Answer]:
    """Answers of the held-out prompts (in order) from their generated ids."""
    return [answer(prompts.records[i], text, a, models) for i, text, a in zip(prompts.kept, prompts.texts, ids)]


def decode(ids: Sequence[int], models: Models) -> str:
    """An answer's text: its ids without the stop id they end on, decoded."""
    return models.enc.decode(list(ids[:-1] if ids and ids[-1] in models.stops else ids))


def answer(record: Mapping[str, str], prompt: str, ids: Sequence[int], models: Models) -> R.Answer:
    return R.answer_from_ids(record, prompt, decode(ids, models), ids, models.stops)
