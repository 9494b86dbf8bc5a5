"""What fine-tuning does differently for a Hugging Face causal LM (Qwen, Llama, SmolLM, ...).

The recipes treat both kinds of model alike (`common.is_gpt` tells them apart) and call in here
for the three things a transformers model does its own way: the loss over our already-shifted
targets (`lm_loss`), greedy answers with transformers' `generate` (`greedy_answers`), and the
result as a standard Hugging Face folder (`save_hf_model`, `merged_qlora`). Loading lives in
`gptforge.modeling.hf_causal` (shared with `gptforge generate` and the evaluate stage) and
`common.load_hf_base`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptforge.finetune.templates import IGNORE_INDEX, Example
from gptforge.modeling.decoding import generate_hf
from gptforge.modeling.hf_causal import HFTokenizer, stop_ids
from gptforge.training.runtime import Runtime

log = logging.getLogger("gptforge")


# Config attributes of models whose logits are more than the output head's matmul (Gemma's
# soft-capping, Cohere's and Granite's scaling): `lm_loss` takes their logits whole.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions whose target is not IGNORE_INDEX, in float32.

    `targets` are already shifted (targets[t] is the token after inputs[t]), so the model is
    called without `labels=` (transformers would shift them again). Right padding needs no
    attention mask: a causal model's real positions never see the padding after them.

    The output head runs only on the positions that have a target (`targeted_logits`): with a
    vocabulary of 50k-150k ids the head is most of a small model's compute, and the prompt (under
    mask_prompt) and the padding would only have their logits thrown away. `full_logits_loss` is
    the plain version it replaces (a test holds them equal).
    """
    keep = targets != IGNORE_INDEX
    logits = targeted_logits(model, inputs, keep)
    if logits is None:
        return full_logits_loss(model, inputs, targets)
    return F.cross_entropy(logits.float(), targets[keep])


def full_logits_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`lm_loss` the plain way: the model's logits at every position, then the masked mean."""
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def targeted_logits(model: nn.Module, inputs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """(N, vocab) logits of the N positions where `keep` is True: the decoder's final hidden
    states (through a peft wrapper: its LoRA layers sit inside the same modules) and the output
    head on those rows only. None when the model's logits are not just its head's matmul or it
    does not expose its decoder and head (the caller then computes them whole)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if any(getattr(config, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    try:
        decoder, head = base.get_decoder(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None or decoder is base:
        return None
    hidden = decoder(input_ids=inputs, use_cache=False).last_hidden_state
    return head(hidden[keep])


@torch.no_grad()
def greedy_answers(
    model: nn.Module, examples: Sequence[Example], *, enc: HFTokenizer, max_new_tokens: int, positions: int, rt: Runtime
) -> tuple[list[str], float]:
    """Greedy answers to each prompt with `decoding.generate_hf` (transformers' `generate`, its
    KV cache), one prompt at a time as the GPT path does, stopping at any of the model's stop ids (`stop_ids`).
    Returns (texts, generated tokens per second of generation)."""
    from tqdm.auto import tqdm

    stops = stop_ids(enc.tokenizer, model)
    texts, generated, seconds = [], 0, 0.0
    for prompt_ids, _ in tqdm(examples, desc="instruct responses", unit="resp", leave=False):
        idx = torch.tensor([prompt_ids], dtype=torch.long, device=rt.device)
        room = min(max_new_tokens, positions - len(prompt_ids))
        rt.sync()
        t0 = time.perf_counter()
        with rt.autocast():
            out = generate_hf(model, enc.tokenizer, idx, room, temperature=0, stop=stops)
        rt.sync()
        seconds += time.perf_counter() - t0
        new = out[0, len(prompt_ids) :].tolist()
        generated += len(new)
        end = next((i for i, t in enumerate(new) if t in stops), len(new))
        texts.append(enc.decode(new[:end]).strip())
    return texts, generated / seconds if seconds > 0 else 0.0


def save_hf_model(model: nn.Module, tokenizer, folder: str | os.PathLike) -> Path:
    """The model as an ordinary Hugging Face folder: safetensors weights, config.json,
    generation_config.json (its eos ids: every id generation should stop on) and the tokenizer
    with its chat template. `AutoModelForCausalLM.from_pretrained(folder)` loads it."""
    folder = Path(folder)
    stops = stop_ids(tokenizer, model)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = stops if len(stops) > 1 else stops[0]
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.use_cache = True  # training may have turned it off (gradient checkpointing)
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def merged_qlora(source: str, adapter: str | os.PathLike, *, param: str, device: torch.device) -> nn.Module:
    """A QLoRA run's result merged into bf16 weights: the base reloaded unquantized in bf16 and
    the saved adapter folded into it (merging into 4-bit weights would round the sum to NF4
    again: peft's and the QLoRA paper's advice is to merge into the 16-bit base)."""
    import peft

    from gptforge.modeling.hf_causal import load_causal_lm

    base, _ = load_causal_lm(source, param=param, dtype=torch.bfloat16)
    log.info("QLoRA: merging the adapter into the bf16 base %s", source)
    return peft.PeftModel.from_pretrained(base.to(device), str(adapter)).merge_and_unload()
