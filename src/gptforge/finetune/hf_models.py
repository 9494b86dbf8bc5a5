"""What fine-tuning does differently for a Hugging Face causal LM (Qwen, Llama, SmolLM, ...).

The recipes treat both kinds of model alike (`common.is_gpt` tells them apart) and call in here
for the three things a transformers model does its own way: the loss over our already-shifted
targets (`lm_loss`), greedy answers with transformers' `generate` in batches (`greedy_answers`,
`batched_greedy`), and the result as a standard Hugging Face folder (`save_hf_model`, `merged_qlora`). Loading lives in
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

from gptforge.finetune.common import model_positions
from gptforge.finetune.templates import IGNORE_INDEX, Example
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


ANSWER_BATCH = 8  # prompts answered together by `greedy_answers`


@torch.no_grad()
def greedy_answers(
    model: nn.Module, examples: Sequence[Example], *, enc: HFTokenizer, max_new_tokens: int, positions: int, rt: Runtime
) -> tuple[list[str], float]:
    """Greedy answers to each prompt, stopping at any of the model's stop ids (`stop_ids`):
    `batched_greedy` (transformers' `generate`, its KV cache) over batches of ANSWER_BATCH
    prompts of similar lengths, since one prompt at a time leaves a CPU waiting on every token
    (the quickstart's SmolLM2 answers: 1.1-2 s each alone). Returns (texts in the examples'
    order, generated tokens per second of generation, all rows counted)."""
    from tqdm.auto import tqdm

    stops = stop_ids(enc.tokenizer, model)
    pad = enc.tokenizer.pad_token_id if enc.tokenizer.pad_token_id is not None else stops[0]
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    texts, generated, seconds = [""] * len(examples), 0, 0.0
    with tqdm(total=len(examples), desc="instruct responses", unit="resp", leave=False) as bar:
        for start in range(0, len(order), ANSWER_BATCH):
            batch = order[start : start + ANSWER_BATCH]
            rt.sync()
            t0 = time.perf_counter()
            answers = batched_greedy(
                model,
                [examples[i][0] for i in batch],
                limit=max_new_tokens,
                stops=stops,
                pad_id=pad,
                rt=rt,
                positions=positions,
            )
            rt.sync()
            seconds += time.perf_counter() - t0
            for i, new in zip(batch, answers):
                generated += len(new)
                end = next((k for k, t in enumerate(new) if t in stops), len(new))
                texts[i] = enc.decode(new[:end]).strip()
            bar.update(len(batch))
    return texts, generated / seconds if seconds > 0 else 0.0


def generate_rows(model: nn.Module, ids, mask, max_new_tokens: int, *, stops: Sequence[int], pad_id: int):
    """transformers' greedy `generate` over a batch of left-padded rows: each row's new ids (after
    its first stop id, padding). The decoding boundary of `batched_greedy` (tests put a stand-in here)."""
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        eos_token_id=list(stops),
        pad_token_id=pad_id,
    )
    return out[:, ids.shape[1] :]


@torch.no_grad()
def batched_greedy(
    model: nn.Module,
    prompt_ids: Sequence[list[int]],
    *,
    limit: int,
    stops: Sequence[int],
    pad_id: int,
    rt: Runtime,
    batch_size: int = 64,
    positions: int | None = None,
) -> list[list[int]]:
    """Greedy answers' ids (cut after their first stop id, which they keep) to the prompts, in
    batches of left-padded prompts (transformers' models take their positions from the attention
    mask, so padding changes nothing but the rounding of a batched product), each up to `limit`
    new tokens and the model's positions. The RL stage's held-out answers and evaluate_qa's."""
    was_training = model.training
    model.eval()
    positions = model_positions(model) if positions is None else positions
    answers: list[list[int]] = []
    try:
        for start in range(0, len(prompt_ids), batch_size):
            chunk = prompt_ids[start : start + batch_size]
            width = max(len(p) for p in chunk)
            room = min(limit, positions - width)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, p in enumerate(chunk):
                ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p) :] = 1
            if room <= 0:
                answers += [[] for _ in chunk]
                continue
            with rt.autocast():
                new = generate_rows(model, ids.to(rt.device), mask.to(rt.device), room, stops=stops, pad_id=pad_id)
            for row in new.tolist():
                end = next((i for i, t in enumerate(row) if t in stops), None)
                answers.append(row if end is None else row[: end + 1])
    finally:
        model.train(was_training)
    return answers


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
