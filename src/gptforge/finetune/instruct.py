"""`gptforge finetune instruct`: instruction fine-tuning on Alpaca-style records, read top to bottom.

LLMs-from-scratch ch. 7 as a recipe: records -> prompt template (templates.py) -> token ids ->
batches of similar lengths, right-padded -> AdamW epochs over the whole model (`method: full`)
or over LoRA adapters only (`method: lora`, peft; `quantize: 4bit` for QLoRA) -> losses on the
full validation and test splits -> greedy answers to the first test instructions, scored against
their references (answer_quality.py) -> the model.

The starting point (`instruct.init_from`) is gptforge's own GPT (a checkpoint, a GPT-2 size or a
Hugging Face GPT-2 folder, converted) or any other Hugging Face causal LM, a local folder or a hub
id, which stays a transformers model with its own tokenizer and chat template
(`gptforge.modeling.hf_causal`; hf_models.py holds the few steps it does its own way).

What it writes:
- `checkpoints/instruct/final/`: the fine-tuned model with LoRA folded into the weights: a
  gptforge checkpoint (loadable with `weights.load_model`) for our GPT, an ordinary Hugging Face
  folder (safetensors, config, generation config, tokenizer with its chat template) for a
  transformers model, which `AutoModelForCausalLM.from_pretrained` loads;
- `checkpoints/instruct/adapter/` (lora only): the adapter in peft's own format
  (adapter_config.json + adapter_model.safetensors), which `PeftModel.from_pretrained` applies
  to the model the run started from. For our GPT the module names are Hugging Face GPT-2's, so
  it applies to the exported base model (peft sees HF's Conv1D layers and switches
  `fan_in_fan_out` on by itself);
- `reports/instruct_responses.jsonl`: instruction, input, reference, response per test example;
- `metrics/instruct.json`: val_loss, test_loss, val_perplexity, test_perplexity,
  response_tokens_per_sec, trainable_params, total_params, skipped_too_long, steps,
  train_tokens (not padding), train_tokens_per_sec, padding_fraction (of the positions the
  training batches processed), the answers' exact_match, token_f1, rouge_l, and judge_score
  when `instruct.judge` names an endpoint.

Losses are per target token (padding and, with `mask_prompt`, the prompt are not targets), and
the split losses weight every target token alike, not every batch. Examples whose prompt alone
fills `max_length` are skipped (their answer would start outside the window) and counted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from gptforge.config.checks import only_entries
from gptforge.config.schema import Config, variant_paths
from gptforge.data.sources import read_records
from gptforge.errors import BadInput
from gptforge.finetune.answer_quality import reference_scores, score_file
from gptforge.finetune.common import (
    History,
    apply_lora,
    check_max_length,
    epoch_batches,
    is_gpt,
    length_grouped_batches,
    load_base,
    load_hf_base,
    make_optimizer,
    merge_lora,
    model_positions,
    runtime,
    train_epochs,
    trainable_params,
)
from gptforge.finetune.distributed import LossOf, Wrapped, alone, gathered, part, reduce_sums, wrap
from gptforge.finetune.hf_models import greedy_answers, lm_loss, merged_qlora, save_hf_model
from gptforge.finetune.templates import IGNORE_INDEX, Example, chat_template_tokenizer, collate, encode_all
from gptforge.io import atomic_dir, atomic_file
from gptforge.modeling.decoding import generate
from gptforge.modeling.gpt import GPT
from gptforge.modeling.hf_causal import HFTokenizer, hf_source
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.modeling.weights import save_model
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics
from gptforge.training.runtime import Runtime

log = logging.getLogger("gptforge")

SPLITS = ("train", "val", "test")
PARAM = "instruct"


# ---------------------------------------------------------------------------------------------
# Data


def read_split(path: str | os.PathLike) -> list[dict]:
    """The {instruction, input, output} records of one jsonl split (input "" when missing or
    null). BadInput naming the file when it is missing, empty or holds something else."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"instruct data: {path} not found; run `gptforge prepare instruct` first")
    records = []
    for number, rec in enumerate(read_records(path, param="instruct data"), 1):
        if not (
            isinstance(rec, dict)
            and isinstance(rec.get("instruction"), str)
            and isinstance(rec.get("output"), str)
            and isinstance(rec.get("input") or "", str)
        ):
            raise BadInput(
                f'instruct data: {path} record {number} is not an object with string "instruction", '
                '"input" and "output"'
            )
        records.append({"instruction": rec["instruction"], "input": rec.get("input") or "", "output": rec["output"]})
    if not records:
        raise BadInput(f"instruct data: {path} has no examples (the {path.stem} split is empty)")
    return records


# ---------------------------------------------------------------------------------------------
# Losses and answers


def batch_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy per target token of one batch: our GPT computes it itself (over the
    real vocabulary), a transformers model through `hf_models.lm_loss`."""
    return model(inputs, targets)[1] if is_gpt(model) else lm_loss(model, inputs, targets)


def padding_stats(batch: Sequence[Example], width: int) -> tuple[int, int]:
    """(real tokens, padded positions) of a collated batch of `width` positions per row."""
    real = sum(min(len(p) + len(r) - 1, width) for p, r in batch)
    return real, len(batch) * width - real


@torch.no_grad()
def split_loss(
    model: nn.Module,
    examples: Sequence[Example],
    *,
    batch_size: int,
    pad_id: int,
    max_length: int,
    mask_prompt: bool,
    rt: Runtime,
    max_batches: int | None = None,
) -> float:
    """Mean cross-entropy per target token over `examples` in order (the first `max_batches`
    batches only, when given): a fixed prefix, so evaluations during training are comparable.
    `model` is the model, or the training module that computes the loss itself (`LossOf`, under
    DDP or FSDP: then each process scores its part of every batch and the sums are added up)."""
    was_training = model.training
    model.eval()
    compute = model if _computes_loss(model) else (lambda i, t: batch_loss(model, i, t))
    total, count = 0.0, 0
    try:
        for i in range(0, len(examples), batch_size):
            if max_batches is not None and i // batch_size >= max_batches:
                break
            rows, factor = part(examples[i : i + batch_size], rt)
            inputs, targets = collate(rows, pad_id=pad_id, max_length=max_length, mask_prompt=mask_prompt)
            n = int((targets != IGNORE_INDEX).sum())
            with rt.autocast():
                loss = compute(inputs.to(rt.device), targets.to(rt.device))
            if factor:  # 0: a process with no rows in this batch ran one only to join the collectives
                total += loss.float().item() * n  # the loss is the mean over these n targets
                count += n
    finally:
        model.train(was_training)
    total, count = reduce_sums([total, count], rt)
    return total / count


def _computes_loss(model: nn.Module) -> bool:
    """The training module (`LossOf`, maybe inside DDP; FSDP keeps its class) rather than a model."""
    return isinstance(model, LossOf) or isinstance(getattr(model, "module", None), LossOf)


def target_count(rows: Sequence[Example], **shape) -> int:
    """How many target tokens the rows have once collated (what the loss averages over)."""
    return int((collate(rows, **shape)[1] != IGNORE_INDEX).sum())


def respond(
    model: GPT, examples: Sequence[Example], *, enc, max_new_tokens: int, rt: Runtime
) -> tuple[list[str], float]:
    """Greedy answers (KV cache, stop at end-of-text) to each prompt, one at a time: rows of
    different prompt lengths cannot share a batch without left padding, which GPT-2's absolute
    positions do not allow. Returns (texts, generated tokens per second of generation).

    New tokens are capped at the positions left after the prompt, so the cache serves every
    step and the prompt is never cropped out of the window.
    """
    from tqdm.auto import tqdm

    block, eot = model.config.block_size, enc.eot_token
    texts, generated, seconds = [], 0, 0.0
    for prompt_ids, _ in tqdm(examples, desc="instruct responses", unit="resp", leave=False):
        idx = torch.tensor([prompt_ids], dtype=torch.long, device=rt.device)
        rt.sync()
        t0 = time.perf_counter()
        with rt.autocast():
            out = generate(model, idx, min(max_new_tokens, block - len(prompt_ids)), temperature=0, eot_id=eot)
        rt.sync()
        seconds += time.perf_counter() - t0
        new = out[0, len(prompt_ids) :].tolist()
        generated += len(new)
        texts.append(enc.decode(new[:-1] if new and new[-1] == eot else new).strip())
    return texts, generated / seconds if seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# The recipe


@dataclass
class Session:
    """What the recipe's steps hand each other."""

    model: nn.Module  # what trains: the GPT or a transformers model, or its peft wrapper
    records: dict[str, list[dict]]
    data: dict[str, list[Example]]
    kept: dict[str, list[int]]  # record index of each example (responses pair them back)
    enc: Any  # tiktoken's Encoding for our GPT, hf_causal.HFTokenizer for a transformers model
    rt: Runtime
    max_length: int
    skipped: int
    hf_source: str | None = None  # the Hugging Face model it started from (None: our GPT)
    history: History | None = None
    real_tokens: int = 0  # training tokens that were not padding (this process's)
    padded: int = 0  # training positions that were padding (this process's)
    wrapped: Wrapped | None = None  # the model under the strategy (finetune/distributed.py)
    before: dict[str, float] | None = None  # the starting model's test loss and answer scores (score_before)
    answers_before: list[str] | None = None


def setup(cfg: Config, data_dir: str | os.PathLike, run=NullRun()) -> Session:
    """Data checks, tokenizer, base model, encoded splits and the trainable set."""
    c = cfg.instruct
    rt = runtime(c.device, c.precision, param=PARAM)
    records = {name: read_split(Path(data_dir) / f"{name}.jsonl") for name in SPLITS}  # fail before the model
    if c.max_samples is not None and c.max_samples < len(records["train"]):
        log.info(
            "instruct: training on the first %d of %d train records (%s.max_samples)",
            c.max_samples,
            len(records["train"]),
            PARAM,
        )
        records["train"] = records["train"][: c.max_samples]
    source = hf_source(c.init_from)
    if source is None:  # our GPT: a checkpoint, a GPT-2 size or a Hugging Face GPT-2 folder
        if c.quantize is not None:
            raise BadInput(
                f"{PARAM}.quantize: {c.quantize} applies to Hugging Face models; {c.init_from} is a "
                "gptforge GPT (small enough to train unquantized): set it to null"
            )
        enc = load_tokenizer(cfg.tokenizer.path)
        model = load_base(c.init_from, enc.n_vocab, param=f"{PARAM}.init_from")
        if c.template == "chat":
            chat_template_tokenizer(enc)  # raises: tiktoken has no chat template
    else:  # any other causal LM, with its own tokenizer (tokenizer.path does not apply)
        model, tokenizer = load_hf_base(source, rt, param=PARAM, lora=c.method == "lora", quantize=c.quantize)
        enc = HFTokenizer(tokenizer)
    max_length = check_max_length(c.max_length, model, f"{PARAM}.max_length")

    data, kept, skipped = {}, {}, {}
    for name, recs in records.items():
        data[name], kept[name] = encode_all(recs, c.template, enc, max_length)
        skipped[name] = len(recs) - len(data[name])
        if not data[name]:
            raise BadInput(
                f"instruct data: every one of the {len(recs)} {name} prompts is {max_length} tokens or "
                f"longer ({PARAM}.max_length={c.max_length}, template {c.template}): nothing to learn from"
            )
    if any(skipped.values()):
        log.warning(
            "instruct: skipped %s prompt(s) of %d tokens or more (no room for the response)",
            ", ".join(f"{n} {k}" for k, n in skipped.items() if n),
            max_length,
        )

    if source is None:  # load_hf_base placed a transformers model (a quantized one on its GPU)
        model.to(rt.device)
    if c.method == "lora":
        torch.manual_seed(c.seed)  # the adapters' init: the same in every run and on every process
        model = apply_lora(model, c.lora, task_type=None if source is None else "CAUSAL_LM")
    n_train, n_total = trainable_params(model)
    log.info(
        "instruct: %s fine-tuning, %d of %d parameters train (%.2f%%); template %s, max_length %d; %s",
        c.method,
        n_train,
        n_total,
        100 * n_train / n_total,
        c.template,
        max_length,
        ", ".join(f"{len(v)} {k}" for k, v in data.items()),
    )
    run.log_metrics({"trainable_params": n_train, "total_params": n_total})
    return Session(model, records, data, kept, enc, rt, max_length, sum(skipped.values()), source)


def answer(model: nn.Module, s: Session, c, rt: Runtime) -> tuple[list[str], float]:
    """Greedy answers to the first `n_responses` test prompts, and generated tokens per second."""
    n = len(s.data["test"]) if c.n_responses is None else min(c.n_responses, len(s.data["test"]))
    if s.hf_source is None:
        return respond(model, s.data["test"][:n], enc=s.enc, max_new_tokens=c.max_new_tokens, rt=rt)
    return greedy_answers(
        model, s.data["test"][:n], enc=s.enc, max_new_tokens=c.max_new_tokens, positions=model_positions(model), rt=rt
    )


def response_rows(s: Session, texts: Sequence[str]) -> list[dict]:
    """instruction, input, reference and response of each answered test example."""
    return [
        {
            "instruction": s.records["test"][i]["instruction"],
            "input": s.records["test"][i]["input"],
            "reference": s.records["test"][i]["output"],
            "response": text,
        }
        for i, text in zip(s.kept["test"], texts)
    ]


def score_start(s: Session, cfg: Config, run=NullRun()) -> Session:
    """`score_before`: the starting model's test loss and answers, scored as the result will be
    (with LoRA's adapters in place: peft starts them at zero, so the model is the base)."""
    c = cfg.instruct
    test_loss = split_loss(
        s.model,
        s.data["test"],
        batch_size=c.batch_size,
        pad_id=s.enc.eot_token,
        max_length=s.max_length,
        mask_prompt=c.mask_prompt,
        rt=s.rt,
    )  # every process's part
    if s.rt.rank != 0:  # process 0 answers, measures and writes (finish)
        return s
    rt = alone(s.rt)
    was_training = s.model.training
    s.model.eval()
    try:
        s.answers_before, _ = answer(s.model, s, c, rt)
    finally:
        s.model.train(was_training)
    scores = reference_scores(response_rows(s, s.answers_before))
    s.before = {"test_loss_before": test_loss, **{f"{k}_before": v for k, v in scores.items() if k != "n_scored"}}
    run.log_metrics(s.before)
    log.info(
        "instruct: before training, test loss %.4f, token F1 %.3f, ROUGE-L %.3f",
        test_loss,
        s.before["token_f1_before"],
        s.before["rouge_l_before"],
    )
    return s


def train(s: Session, cfg: Config, run=NullRun()) -> Session:
    """Epochs of AdamW over the trainable parameters; validation loss every eval_interval steps."""
    c = cfg.instruct
    torch.manual_seed(c.seed)  # dropout streams
    s.wrapped = w = wrap(
        s.model, s.rt, c.strategy, loss=batch_loss, param=PARAM, activation_checkpointing=c.gradient_checkpointing
    )
    optimizer = make_optimizer(w.module, c.lr, c.weight_decay, s.rt.device)
    shape = dict(pad_id=s.enc.eot_token, max_length=s.max_length, mask_prompt=c.mask_prompt)
    # Length-grouped batches put short answers together; a batch's mean loss would then give each
    # of their tokens the weight of many tokens of a long batch (SmolLM2's epoch ended 5% above
    # random batches' held-out loss, Trainer's own grouping likewise). Weighting each batch by its
    # targets over the epoch's mean per batch makes the step's expectation the per-token mean
    # over the data, whatever the batches hold.
    # (A row's targets do not depend on the rows collated with it: any cut into batches sums alike.)
    if c.group_by_length:
        train, size = s.data["train"], c.batch_size
        per_batch = sum(target_count(train[i : i + size], **shape) for i in range(0, len(train), size))
        per_batch /= max(1, math.ceil(len(train) / size))

    def loss_fn(batch):
        # This process's rows (all of them on one), its loss weighted by its share of the targets.
        rows, factor = part(batch, s.rt, weight=lambda rows: target_count(rows, **shape), trace=True)
        if c.group_by_length:
            factor *= target_count(batch, **shape) / per_batch
        inputs, targets = collate(rows, **shape)
        if factor:
            real, padded = padding_stats(rows, inputs.size(1))
            s.real_tokens += real
            s.padded += padded
        return w.module(inputs.to(s.rt.device), targets.to(s.rt.device)) * factor

    def batches(epoch: int) -> list[list[Example]]:
        if c.group_by_length:
            return length_grouped_batches(
                s.data["train"], c.batch_size, c.seed, epoch, length=lambda e: len(e[0]) + len(e[1])
            )
        return epoch_batches(s.data["train"], c.batch_size, c.seed, epoch)

    def evaluate():
        loss = split_loss(
            w.module, s.data["val"], batch_size=c.batch_size, rt=s.rt, max_batches=c.eval_batches, **shape
        )
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 80.0))}

    s.history = train_epochs(
        w.module,
        optimizer,
        loss_fn,
        batches,
        rt=s.rt,
        epochs=c.epochs,
        eval_interval=c.eval_interval,
        evaluate=evaluate,
        run=run,
        desc="instruct",
    )
    return s


def finish(
    s: Session,
    cfg: Config,
    run=NullRun(),
    out_dir: str | os.PathLike = "checkpoints/instruct",
    metrics_path: str | os.PathLike = "metrics/instruct.json",
    responses_path: str | os.PathLike = "reports/instruct_responses.jsonl",
) -> dict:
    """Save the adapter, merge it, then measure, answer with and save the merged model."""
    c, out_dir = cfg.instruct, Path(out_dir)
    n_train, n_total = trainable_params(s.model)  # before merging: the adapters are gone after
    s.real_tokens, s.padded = map(int, reduce_sums([s.real_tokens, s.padded], s.rt))  # every process's
    trained = gathered(s.wrapped) if s.wrapped is not None else s.model  # process 0's whole model
    if trained is None:  # another process: process 0 measures, answers and writes
        return {}
    rt = alone(s.rt)
    adapter = None
    if c.method == "lora":
        adapter = out_dir / "adapter"
        with atomic_dir(adapter) as tmp:
            trained.save_pretrained(str(tmp))
    # What is measured is what is saved: the merged weights (and the merged model decodes
    # without the adapters' extra matmuls).
    if c.quantize is not None:
        model = merged_qlora(s.hf_source, adapter, param=f"{PARAM}.init_from", device=rt.device)
    else:
        model = merge_lora(trained)
    model.eval()

    shape = dict(
        batch_size=c.batch_size, pad_id=s.enc.eot_token, max_length=s.max_length, mask_prompt=c.mask_prompt, rt=rt
    )
    val_loss = split_loss(model, s.data["val"], **shape)
    test_loss = split_loss(model, s.data["test"], **shape)

    texts, tokens_per_sec = answer(model, s, c, rt)
    n = len(texts)
    with atomic_file(responses_path, "w", encoding="utf-8") as f:
        for i, row in enumerate(response_rows(s, texts)):
            if s.answers_before is not None:  # the starting model's answer beside the result's
                row["response_before"] = s.answers_before[i]
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    quality = score_file(responses_path, judge_url=c.judge.url, judge_model=c.judge.model)

    final = out_dir / "final"
    with atomic_dir(final) as tmp:
        if s.hf_source is None:
            save_model(model, tmp)
        else:
            save_hf_model(model, s.enc.tokenizer, tmp)

    seconds = s.history.epoch_seconds if s.history else []
    processed = s.real_tokens + s.padded
    metrics = {
        "val_loss": val_loss,
        "test_loss": test_loss,
        "val_perplexity": math.exp(min(val_loss, 80.0)),
        "test_perplexity": math.exp(min(test_loss, 80.0)),
        "response_tokens_per_sec": tokens_per_sec,
        "trainable_params": n_train,
        "total_params": n_total,
        "skipped_too_long": s.skipped,
        "steps": s.history.step if s.history else 0,
        "seconds_per_epoch": sum(seconds) / len(seconds) if seconds else 0.0,
        "train_tokens": s.real_tokens,
        "padding_fraction": s.padded / processed if processed else 0.0,
        "train_tokens_per_sec": s.real_tokens / sum(seconds) if sum(seconds) > 0 else 0.0,
        **quality,
        **(s.before or {}),
    }
    publish_metrics(run, metrics, metrics_path)
    run.log_artifact(responses_path)
    if s.hf_source is None:
        run.log_artifact(final, "checkpoint")
    else:  # an MLflow model (transformers flavor, with its tokenizer): loadable, servable
        run.log_hf_model(final, "model")
    if adapter is not None:
        run.log_artifact(adapter, "adapter")
    log.info(
        "instruct done: val loss %.4f (perplexity %.2f), test loss %.4f; %d responses at %.1f tokens/s; "
        "padding %.1f%% of the training positions",
        val_loss,
        metrics["val_perplexity"],
        test_loss,
        n,
        tokens_per_sec,
        100 * metrics["padding_fraction"],
    )
    return metrics


def finetune_instruct(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run=NullRun(),
    data_dir: str | os.PathLike = "data/instruct",
    out_dir: str | os.PathLike = "checkpoints/instruct",
    metrics_path: str | os.PathLike = "metrics/instruct.json",
    responses_path: str | os.PathLike = "reports/instruct_responses.jsonl",
) -> dict:
    """The stage: set up, train, finish (each a step: a Prefect task under PrefectSteps)."""
    session = steps(setup, cfg, data_dir, run)
    if cfg.instruct.score_before:
        session = steps(score_start, session, cfg, run)
    session = steps(train, session, cfg, run)
    return steps(finish, session, cfg, run, out_dir, metrics_path, responses_path)


def finetune_instruct_variant(
    cfg: Config, *, steps: Steps = DIRECT, run=NullRun(), data_dir: str | os.PathLike = "data/instruct"
) -> dict:
    """Stage finetune_instruct_variant@NAME (`-S instruct_variants.only=NAME`; every entry when
    null): the instruct recipe with `instruct_variants.models[NAME]` over the instruct section,
    into `variant_paths(NAME)`. The quickstart's SmolLM2 LoRA beside the tiny GPT's SFT."""
    variants = cfg.instruct_variants
    metrics: dict[str, float] = {}
    for key in only_entries(variants.models, variants.only, "instruct_variants.models"):
        sub = cfg.model_copy(update={"instruct": cfg.instruct_variant(key)})
        got = finetune_instruct(sub, steps=steps, run=run, data_dir=data_dir, **variant_paths(key))
        metrics.update(got if variants.only is not None else {f"{key}.{k}": v for k, v in got.items()})
    return metrics
