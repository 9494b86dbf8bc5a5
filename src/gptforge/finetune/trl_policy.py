"""The policy a trl stage trained (DPO, RL), turned into the stage's model folder.

trl trains a transformers causal LM (our GPT as transformers' GPT-2, `hf_convert.to_hf`; a
Hugging Face model as it is; a peft model under LoRA). At the end the stage saves LoRA's
adapter (`out_dir/adapter/`), merges it, turns our GPT back into a gptforge checkpoint
(`hf_convert.from_hf`, with the attention backend it was saved with) and writes
`out_dir/final/` whole or not at all, then logs both to the stage's MLflow run: a gptforge
checkpoint as an artifact, a Hugging Face folder through the transformers flavor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from gptforge.finetune.common import merge_lora
from gptforge.finetune.hf_models import save_hf_model
from gptforge.io import atomic_dir
from gptforge.modeling.weights import save_model


@dataclass
class Trained:
    """The merged transformers model, our GPT made from it (None for a Hugging Face model), and
    the saved adapter's folder (None without LoRA)."""

    model: nn.Module
    gpt: Any = None
    adapter: Path | None = None


def merged(policy: nn.Module, *, method: str, out_dir: Path, started_as=None) -> Trained:
    """Save the adapter (method lora), merge it, and make our GPT again when the policy
    `started_as` one (the GPT it was converted from; None for a Hugging Face model)."""
    adapter = None
    if method == "lora":
        adapter = out_dir / "adapter"
        with atomic_dir(adapter) as tmp:
            policy.save_pretrained(str(tmp))
    model = merge_lora(policy).eval()
    gpt = None
    if started_as is not None:
        from gptforge.modeling.hf_convert import from_hf

        gpt = from_hf(model, attention=started_as.config.attention)
    return Trained(model, gpt, adapter)


def save(trained: Trained, tokenizer, folder: Path) -> Path:
    """`folder` (out_dir/final): a gptforge checkpoint, or a Hugging Face folder with the tokenizer."""
    with atomic_dir(folder) as tmp:
        if trained.gpt is not None:
            save_model(trained.gpt, tmp)
        else:
            save_hf_model(trained.model, tokenizer, tmp)
    return folder


def log(run, trained: Trained, folder: Path) -> None:
    """The saved model and the adapter in the stage's MLflow run."""
    if trained.gpt is not None:
        run.log_artifact(folder, "checkpoint")
    else:
        run.log_hf_model(folder, "model")
    if trained.adapter is not None:
        run.log_artifact(trained.adapter, "adapter")
