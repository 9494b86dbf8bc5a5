"""The DPO stage's models: the policy from `preference.init_from`, its frozen reference, and the
tokenizers, with the checks that the reference can score the policy's tokens (`model_family`:
a model folder's architecture and vocabulary without loading it, also used by the RL stage)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from gptforge.config.schema import Config
from gptforge.errors import BadInput
from gptforge.finetune.common import apply_lora, load_base, load_hf_base
from gptforge.modeling.hf_causal import HFTokenizer, hf_config_dict, hf_source
from gptforge.modeling.weights import CONFIG_FILE
from gptforge.training.runtime import Runtime

PARAM = "preference"


# ---------------------------------------------------------------------------------------------
# Models


def model_family(path: str, *, param: str) -> tuple[str, int | None]:
    """(architecture, vocabulary size) from a model's config.json without loading its weights:
    gptforge checkpoints and Hugging Face GPT-2 folders are both "gpt2" (our GPT converts to and
    from it); any other Hugging Face folder its `model_type`. A hub id (not a folder) is
    (its id, None): checked after loading. BadInput when a folder has no readable config.json."""
    if hf_source(path) is not None and not Path(path).is_dir():
        return path, None
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        raise BadInput(
            f"{param}: {path} is not a model folder (no {CONFIG_FILE}); run the stage that makes it "
            "first, or name a gptforge checkpoint or a Hugging Face causal-LM folder"
        )
    hf = hf_config_dict(config)
    if hf is not None:
        return hf["model_type"], hf.get("vocab_size")
    try:
        ours = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise BadInput(f"{param}: cannot read {config}") from None
    return "gpt2", ours.get("n_vocab") if isinstance(ours, dict) else None


def check_reference(init_from: str, reference: str) -> None:
    """One line (BadInput) when the reference cannot score the policy's tokens: another
    architecture or another vocabulary. The rewards are log-probability ratios of the same token
    ids under both models, so both need the same tokenizer; a smaller or larger model of the same
    family (GPT-2 124M as the reference of a 355M policy) is fine."""
    policy_arch, policy_vocab = model_family(init_from, param=f"{PARAM}.init_from")
    ref_arch, ref_vocab = model_family(reference, param=f"{PARAM}.reference")
    if policy_vocab is None or ref_vocab is None:
        return  # a hub id: compared after loading (`check_loaded_reference`)
    if ref_arch != policy_arch:
        raise BadInput(
            f"{PARAM}.reference: {reference} is a {ref_arch} model, the policy ({PARAM}.init_from "
            f"{init_from}) a {policy_arch} model; the reference must be of the policy's architecture "
            "and tokenizer"
        )
    if ref_vocab != policy_vocab:
        raise BadInput(
            f"{PARAM}.reference: {reference} has a vocabulary of {ref_vocab} tokens, the policy "
            f"{init_from} {policy_vocab}; the reference must use the policy's tokenizer"
        )


def check_loaded_reference(policy: nn.Module, ref: nn.Module, reference: str) -> None:
    """`check_reference` for models that came from the hub (no config.json to read first)."""
    p, r = policy.config, ref.config
    if p.model_type != r.model_type or p.vocab_size != r.vocab_size:
        raise BadInput(
            f"{PARAM}.reference: {reference} is a {r.model_type} model with {r.vocab_size} tokens, the "
            f"policy a {p.model_type} model with {p.vocab_size}; the reference must be of the policy's "
            "architecture and tokenizer"
        )


@dataclass
class Models:
    """The policy trl trains (a transformers model), its frozen reference (None: the policy with
    its LoRA adapter disabled), the encoder the templates use and the tokenizer trl is given."""

    policy: nn.Module
    reference: nn.Module | None
    enc: Any  # tiktoken's Encoding (our GPT) or hf_causal.HFTokenizer
    tokenizer: Any  # a transformers tokenizer: trl's processing_class (its pad id)
    gpt: Any = None  # our GPT as loaded (None for a Hugging Face model): its config goes back out
    hf_source: str | None = None


def load_models(cfg: Config, rt: Runtime) -> Models:
    """Policy, reference and tokenizers for `preference.init_from` / `preference.reference`."""
    c = cfg.preference
    if c.reference is not None:
        check_reference(c.init_from, c.reference)
    source = hf_source(c.init_from)
    if source is None:  # our GPT: trained by trl as transformers' GPT-2 with the same weights
        from gptforge.modeling.export import hf_tokenizer
        from gptforge.modeling.hf_convert import to_hf
        from gptforge.modeling.tokenizer import load_tokenizer

        enc = load_tokenizer(cfg.tokenizer.path)
        gpt = load_base(c.init_from, enc.n_vocab, param=f"{PARAM}.init_from")
        policy = to_hf(gpt).train()
        tokenizer = hf_tokenizer(cfg.tokenizer.path, gpt.config.block_size)
        ref = None
        if c.reference is not None:
            ref = to_hf(load_base(c.reference, enc.n_vocab, param=f"{PARAM}.reference"))
    else:
        policy, tokenizer = load_hf_base(source, rt, param=PARAM, lora=c.method == "lora")
        enc, gpt = HFTokenizer(tokenizer), None
        ref = None
        if c.reference is not None:
            ref_source = hf_source(c.reference)
            if ref_source is None:
                raise BadInput(
                    f"{PARAM}.reference: {c.reference} is a gptforge GPT; the policy {c.init_from} is a "
                    f"Hugging Face {policy.config.model_type} model: the reference must be of its "
                    "architecture and tokenizer"
                )
            ref, _ = load_hf_base(ref_source, rt, param=f"{PARAM}.reference", lora=False)
            check_loaded_reference(policy, ref, c.reference)
    if ref is None and c.method == "full":
        ref = copy.deepcopy(policy)  # the policy as it starts, frozen
    if ref is not None:
        ref.to(rt.device).eval().requires_grad_(False)
    policy.to(rt.device)
    if c.method == "lora":
        torch.manual_seed(c.seed)  # the adapters' init: the same in every run and on every process
        policy = apply_lora(policy, c.lora, task_type="CAUSAL_LM")
    return Models(policy, ref, enc, tokenizer, gpt, source)
