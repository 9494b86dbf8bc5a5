"""Stage `evaluate`: every model the pipeline made, on HellaSwag and MMLU, with lm-evaluation-harness.

The recipe: for each model in `evaluate.models` whose checkpoint folder exists, call
`lm_eval.simple_evaluate` in-process with our model wrapped as an lm-eval `LM`; write the flat
metrics file, lm-eval's full results and per-sample records, one MLflow run per model, and a
markdown report that also shows the classifier's and the instruction model's test figures.

Why a registered `LM` subclass (`GptforgeLM`, model name "gptforge") rather than exporting to a
Hugging Face folder and using lm-eval's `hf` model:
- no export step and no second copy of the weights: the checkpoint folder is read with
  `load_model` and scored by the same `GPT` code that trained it (padded vocabulary, -inf
  columns and all), so what is evaluated is what was trained;
- our tokenizer is tiktoken (`tokenizer.path`, possibly a small test BPE); `hf` needs a
  transformers tokenizer, which for a non-GPT-2 vocabulary would have to be built and kept in
  step by hand;
- our models have short windows (block_size 64 by default, 1024 for GPT-2 sizes). A context
  longer than the window is left-truncated here, to the last tokens the model has positions
  for, with the continuation kept whole, which is the scoring we want and can test directly;
- requests that share their model input (MMLU's four answer letters after one prompt) are run
  once, and only the continuation positions go through the output head, which is most of the
  CPU time for a 50257-token vocabulary.
The tokenization of (context, continuation) pairs is lm-eval's own (`TemplateLM`: encode the
whole string, split at the context's length, trailing context spaces moved into the
continuation), the same as for the `hf` model, so task scores are comparable with published
lm-eval figures.

Tasks. `evaluate.tasks` (default hellaswag, mmlu) may name any lm-eval task, group or tag.
- `hellaswag` with `evaluate.hellaswag.source` set to a local rowanz-format jsonl (fields
  activity_label, ctx_a, ctx_b, endings (4), label (0-3); ctx and others are ignored): the task
  config shipped in `gptforge/lm_eval_tasks/hellaswag.yaml` reads it, with lm-eval's own
  `process_docs` (query "activity_label: ctx_a Ctx_b", `[...]` tags stripped) and metrics acc
  and acc_norm (length-normalised by characters). This is NOT build-nanogpt's completion-style
  score that pretraining reports (`gptforge.hellaswag`: raw `ctx`, loss per token): the two
  numbers differ and only this one compares with lm-eval's published 0.3114 for GPT-2 124M.
- `mmlu` with `evaluate.mmlu.source` set to a folder (or its `all/` subfolder) holding `test`
  and `dev` files (`test.jsonl`, `test.parquet` or Hugging Face shards `test-*.parquet`; same
  for dev) of cais/mmlu `all` records {question, subject, choices (4), answer (0-3)}: one task
  per subject (`mmlu_<subject>`) with lm-eval's standard prompt and " A".." D" targets, few-shot
  examples from that subject's dev questions (first N, as lm-eval does), grouped as `mmlu`.
  `mmlu.acc` is weighted by subject size like lm-eval's group; `mmlu.acc_subject_mean` is the
  plain mean over subjects (the "average over the 57 subjects" some papers report).
- without a local source, lm-eval's own `hellaswag` / `mmlu` and their hub data: offline this
  fails with a one-line SourceUnreachable naming the `evaluate.*.source` param to set.
- any other name goes to lm-eval's default task index (about 15 s to build); a name it does not
  know is a BadInput that lists the closest ones.
Local data is checked record by record before lm-eval starts; a normalised copy (labels as
integers, MMLU split by subject) and the generated task yaml files live in a temporary folder
for the run, together with the `datasets` cache, so nothing is written to ~/.cache.

Outputs (`<model>` is the key in `evaluate.models`, `<task>` an lm-eval task or group name):
- `metrics/evaluate.json`: `<model>.<task>.<metric>` (acc, acc_norm, ...), `..._stderr`,
  `<model>.<task>.n` (examples scored), `<model>.examples_per_sec` and `<model>.seconds` (the
  whole lm-eval call: data, prompts, scoring, metrics), `<model>.model_seconds` (inside our model);
- `reports/evaluate/<model>/results.json` (lm-eval's results, samples removed) and
  `samples_<task>.jsonl` (every request and response, lm-eval's `log_samples`);
- one MLflow run per model (`evaluate:<model>`, nested under the stage's run when there is
  one) with the `<task>.<metric>` metrics and those files; the stage's run gets the whole file;
- `reports/evaluate.md`: every model x task x metric with ± stderr and n, the GPT-2 124M
  reference, and the spam classifier's and instruction model's test metrics when present.

Offline use: set HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 before the process imports
`datasets`/`transformers`; with both local sources nothing else is needed.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from gptforge import tracking
from gptforge.errors import BadInput, SourceUnreachable
from gptforge.io import atomic_dir, atomic_file, data_suffix, open_data
from gptforge.steps import DIRECT, Steps
from gptforge.tracking import NullRun

log = logging.getLogger("gptforge")

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")
N_CHOICES = 4
# Published figures for GPT-2 124M, shown beside ours in the report.
REFERENCE = {("hellaswag", "acc_norm"): (0.3114, "GPT-2 124M in lm-eval")}
CHANCE = {("mmlu", "acc"): 0.25, ("mmlu", "acc_subject_mean"): 0.25}
OTHER_METRICS = {"metrics/classify.json": ("spam classifier", ("test_accuracy", "precision", "recall", "f1")),
                 "metrics/instruct.json": ("instruction model", ("test_loss",))}


# =============================================================================================
# Our model as an lm-eval LM


@register_model("gptforge")
class GptforgeLM(TemplateLM):
    """A `gptforge.model.GPT` and its tiktoken tokenizer behind lm-eval's LM interface.

    loglikelihood: lm-eval tokenizes (context, continuation); each pair becomes one input of at
    most block_size tokens, (context + continuation)[-(block_size + 1):-1], whose last
    len(continuation) positions predict the continuation. A long context thus loses tokens on
    the left; a continuation longer than block_size (never the case in HellaSwag or MMLU at
    GPT-2's 1024) keeps its last block_size tokens and is counted in `cut_continuations`.
    Log-probabilities are log_softmax over the real vocabulary (ids < n_vocab) in float32.

    loglikelihood_rolling: lm-eval's disjoint rolling windows of block_size tokens.

    generate_until: greedy decoding (sampling only when a task asks for do_sample) with the
    model's KV-cached `generate`, cut at the first `until` string or <|endoftext|>. The prompt is
    left-truncated so that at least min(max_gen_toks, block_size // 2) new tokens fit in the
    window; longer generations slide the window as `generate` does.
    """

    def __init__(self, model, enc, *, batch_size: int = 16, device: str | torch.device = "cpu",
                 name: str = "gptforge", max_gen_toks: int = 256, gen_chunk: int = 32) -> None:
        super().__init__()
        if model.config.n_vocab != enc.n_vocab:
            raise BadInput(f"model {name}: its checkpoint has a vocabulary of {model.config.n_vocab} tokens but the "
                           f"tokenizer (tokenizer.path) has {enc.n_vocab}; evaluate it with the tokenizer it was trained with")
        self._device = torch.device(device)
        self.model = model.to(self._device).eval()
        self.enc = enc
        self.name = name
        self.batch_size = int(batch_size)
        self.block_size = model.config.block_size
        self.n_vocab = model.config.n_vocab
        self.max_gen_toks = max_gen_toks
        self.gen_chunk = gen_chunk
        self.cut_continuations = 0
        self.seconds = 0.0  # time spent in the model (scoring and generation), for throughput
        self.counts = {"loglikelihood": 0, "loglikelihood_rolling": 0, "generate_until": 0}

    # -- what TemplateLM needs ------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.enc.eot_token

    @property
    def max_length(self) -> int:
        return self.block_size

    @property
    def tokenizer_name(self) -> str:
        return self.enc.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Ordinary text only: a task string that spells "<|endoftext|>" is scored as text.
        return self.enc.encode_ordinary(string)

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.enc.decode([t for t in tokens if t != self.eot_token_id])

    def get_model_info(self) -> dict:
        cfg = self.model.config
        return {"model_name": self.name, "model_num_parameters": self.model.num_params(non_embedding=False),
                "block_size": cfg.block_size, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
                "tokenizer": self.enc.name}

    # -- scoring ----------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context_ids, continuation_ids) -> (logprob, is_greedy)."""
        self.counts["loglikelihood"] += len(requests)
        return self.score_tokens([(ctx, cont) for _, ctx, cont in requests], disable_tqdm=disable_tqdm)

    @torch.inference_mode()
    def score_tokens(self, pairs: list[tuple[list[int], list[int]]], *, disable_tqdm: bool = False,
                     desc: str = "loglikelihood") -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation)
        for each (context_ids, continuation_ids) pair, batched, in the input order."""
        t0 = time.perf_counter()
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        # Pairs with the same model input share one forward pass (MMLU: 4 letters, 1 prompt).
        groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                out[i] = (0.0, True)
                continue
            seq = (list(ctx) + list(cont))[-(self.block_size + 1):]
            inp = tuple(seq[:-1])
            if not inp:
                raise BadInput("a loglikelihood request with an empty context and a one-token continuation "
                               "(lm-eval should have put <|endoftext|> before it)")
            k = min(len(cont), len(inp))
            if k < len(cont):
                self.cut_continuations += 1
                if self.cut_continuations == 1:
                    log.warning("evaluate %s: a continuation of %d tokens does not fit block_size %d; only its "
                                "last %d tokens are scored", self.name, len(cont), self.block_size, k)
            groups.setdefault(inp, []).append((i, k))
        # Longest first: a batch holds similar lengths, so little padding; OOM shows up at once.
        inputs = sorted(groups, key=len, reverse=True)
        head = self.model.lm_head.weight[: self.n_vocab]
        bar = _bar(len(pairs) - sum(o is not None for o in out), f"{self.name} {desc}", disable_tqdm)
        try:
            for start in range(0, len(inputs), self.batch_size):
                batch = inputs[start:start + self.batch_size]
                width = len(batch[0])
                idx = torch.zeros((len(batch), width), dtype=torch.long)
                for b, inp in enumerate(batch):
                    idx[b, :len(inp)] = torch.tensor(inp, dtype=torch.long)
                # Right padding is harmless under causal attention: real positions never see it.
                hidden = self.model.hidden_states(idx.to(self._device))
                rows, positions, targets, owners = [], [], [], []
                for b, inp in enumerate(batch):
                    L = len(inp)
                    for i, k in groups[inp]:
                        rows.append(torch.full((k,), b, dtype=torch.long))
                        positions.append(torch.arange(L - k, L))
                        targets.append(torch.tensor(pairs[i][1][-k:], dtype=torch.long))
                        owners.append((i, k))
                rows_t, pos_t = torch.cat(rows), torch.cat(positions)
                tgt = torch.cat(targets).to(self._device)
                logits = F.linear(hidden[rows_t.to(self._device), pos_t.to(self._device)], head).float()
                logp = F.log_softmax(logits, dim=-1)
                token_logp = logp.gather(1, tgt[:, None]).squeeze(1).double().cpu()
                greedy = (logits.argmax(dim=-1) == tgt).cpu()
                offset = 0
                for i, k in owners:
                    out[i] = (float(token_logp[offset:offset + k].sum()), bool(greedy[offset:offset + k].all()))
                    offset += k
                bar.update(len(owners))
        finally:
            bar.close()
            self.seconds += time.perf_counter() - t0
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        self.counts["loglikelihood_rolling"] += len(requests)
        windows, owner = [], []
        for r, req in enumerate(requests):
            (string,) = req.args
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.block_size, context_len=1)):
                windows.append((ctx, cont))
                owner.append(r)
        scores = self.score_tokens(windows, disable_tqdm=disable_tqdm, desc="loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for r, (lp, _) in zip(owner, scores):
            totals[r] += lp
        return totals

    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from gptforge.decoding import generate

        self.counts["generate_until"] += len(requests)
        eot_text = "<|endoftext|>"
        t0 = time.perf_counter()
        results = []
        for req in _iter_bar(requests, f"{self.name} generate_until", disable_tqdm):
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or [eot_text]
            until = [until] if isinstance(until, str) else [u for u in until if u]
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if do_sample else 0.0
            room = min(max_new, self.block_size // 2)
            ctx = self.tok_encode(context)[-(self.block_size - room):] or [self.eot_token_id]
            idx = torch.tensor([ctx], dtype=torch.long, device=self._device)
            new: list[int] = []
            text = ""
            while len(new) < max_new:
                step = min(self.gen_chunk, max_new - len(new))
                full = generate(self.model, idx, step, temperature=temperature, eot_id=self.eot_token_id)
                chunk = full[0, idx.size(1):].tolist()
                new += chunk
                idx = full
                text = self.tok_decode(new)
                if self.eot_token_id in chunk or any(u in text for u in until) or not chunk:
                    break
            if self.eot_token_id in new:
                text = self.tok_decode(new[:new.index(self.eot_token_id)])
            for u in until:
                text = text.split(u)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
        self.seconds += time.perf_counter() - t0
        return results


class _NoBar:
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


def _bar(total: int, desc: str, disable: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="req", disable=disable, leave=False)


def _iter_bar(items, desc: str, disable: bool):
    bar = _bar(len(items), desc, disable)
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:
        bar.close()


# =============================================================================================
# Local data: read, check, normalise


def read_records(path: Path) -> Iterable[tuple[str, Any]]:
    """(where, record) for each record of a .jsonl/.json-lines or .parquet file; `where` names
    the file and line (or record number) for messages. Unreadable input is a BadInput."""
    if data_suffix(path) == ".parquet":
        try:
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise BadInput(f"{path}: not a readable parquet file ({type(e).__name__}: {_one_line(e)})") from None
        for n, row in enumerate(rows, 1):
            yield f"{path}: record {n}", row
        return
    with open_data(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise BadInput(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise BadInput(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None


def _index(value: Any) -> int | None:
    """An answer/label index: int, or a digit string (Hugging Face's hellaswag); None if not one."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _check_fields(where: str, obj: Any, fields: Mapping[str, type], hint: str) -> dict:
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: expected a JSON object, got {type(obj).__name__} ({hint})")
    missing = [k for k in fields if k not in obj or obj[k] is None]
    if missing:
        raise BadInput(f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)} ({hint})")
    for key, kind in fields.items():
        if kind is str and not isinstance(obj[key], str):
            raise BadInput(f"{where}: {key} must be a string, got {type(obj[key]).__name__} ({hint})")
    return obj


def _check_choices(where: str, value: Any, key: str, hint: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
        raise BadInput(f"{where}: {key} must be a list of {N_CHOICES} strings ({hint})")
    if len(value) != N_CHOICES:
        raise BadInput(f"{where}: {key} must hold {N_CHOICES} strings, got {len(value)} ({hint})")
    return list(value)


def _check_answer(where: str, value: Any, key: str, hint: str) -> int:
    index = _index(value)
    if index is None:
        raise BadInput(f"{where}: {key} must be an integer 0-{N_CHOICES - 1}, got {value!r} ({hint})")
    if not 0 <= index < N_CHOICES:
        raise BadInput(f"{where}: {key} {index} is out of range 0-{N_CHOICES - 1} ({hint})")
    return index


HELLASWAG_PARAM = "evaluate.hellaswag.source"
MMLU_PARAM = "evaluate.mmlu.source"
HELLASWAG_FIELDS = {"activity_label": str, "ctx_a": str, "ctx_b": str, "endings": list, "label": int}
MMLU_FIELDS = {"question": str, "subject": str, "choices": list, "answer": int}


def load_hellaswag(path: str | Path) -> list[dict]:
    """Checked HellaSwag records (rowanz format) with the fields lm-eval's hellaswag uses;
    `label` made an int. BadInput names the file, the line and the param to fix."""
    p = Path(path)
    hint = f"{HELLASWAG_PARAM} must be a HellaSwag jsonl in the rowanz format"
    if not p.is_file():
        raise BadInput(f"{HELLASWAG_PARAM}: HellaSwag file not found: {path}")
    docs = []
    for where, obj in read_records(p):
        obj = _check_fields(where, obj, HELLASWAG_FIELDS, hint)
        doc = {k: obj[k] for k in ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "source_id", "split")
               if k in obj}
        doc["endings"] = _check_choices(where, obj["endings"], "endings", hint)
        doc["label"] = _check_answer(where, obj["label"], "label", hint)
        docs.append(doc)
    if not docs:
        raise BadInput(f"{HELLASWAG_PARAM}: no examples in {path}")
    return docs


def mmlu_files(source: str | Path) -> dict[str, Path]:
    """{'test': file, 'dev': file} in an MMLU folder (or its `all/` subfolder, cais/mmlu's layout):
    `<split>.jsonl`, `<split>.parquet` or `<split>-*.parquet` (one shard). `dev` may be absent."""
    folder = Path(source)
    if not folder.is_dir():
        raise BadInput(f"{MMLU_PARAM}: MMLU folder not found: {source} (a folder with test and dev files, "
                       ".jsonl or .parquet)")
    if (folder / "all").is_dir() and not _split_files(folder, "test"):
        folder = folder / "all"
    found = {}
    for split in ("test", "dev"):
        files = _split_files(folder, split)
        if len(files) > 1:
            raise BadInput(f"{MMLU_PARAM}: {folder} holds several {split} files ({', '.join(f.name for f in files)}); "
                           "keep one")
        if files:
            found[split] = files[0]
    if "test" not in found:
        raise BadInput(f"{MMLU_PARAM}: no test file in {folder} (expected test.jsonl or test.parquet)")
    return found


def _split_files(folder: Path, split: str) -> list[Path]:
    names = [f"{split}.jsonl", f"{split}.json", f"{split}.parquet", f"{split}.jsonl.gz", f"{split}.json.gz"]
    files = [folder / n for n in names if (folder / n).is_file()]
    return files + sorted(p for p in folder.glob(f"{split}-*.parquet") if p.is_file())


def load_mmlu(path: Path) -> list[dict]:
    """Checked MMLU records {question, subject, choices, answer} from one file."""
    hint = f"{MMLU_PARAM} records are cais/mmlu's question, subject, choices (4), answer (0-3)"
    docs = []
    for where, obj in read_records(path):
        obj = _check_fields(where, obj, MMLU_FIELDS, hint)
        if not obj["subject"].strip():
            raise BadInput(f"{where}: subject is empty ({hint})")
        docs.append({"question": obj["question"], "subject": obj["subject"],
                     "choices": _check_choices(where, obj["choices"], "choices", hint),
                     "answer": _check_answer(where, obj["answer"], "answer", hint)})
    if not docs:
        raise BadInput(f"{MMLU_PARAM}: no questions in {path}")
    return docs


def subject_task(subject: str) -> str:
    return "mmlu_" + re.sub(r"[^a-z0-9]+", "_", subject.strip().lower()).strip("_")


# =============================================================================================
# Task plan: which names lm-eval gets, from which task index


@dataclass
class TaskPlan:
    names: list[str]  # what simple_evaluate gets, in the order of evaluate.tasks
    include_path: list[str]
    include_defaults: bool
    local: dict[str, str] = field(default_factory=dict)  # task -> local source
    hub: dict[str, str] = field(default_factory=dict)  # task -> the param that would make it local
    manager: Any = None  # the lm-eval TaskManager


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _yaml_str(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar


def _task_yaml(template: str, extra: dict[str, Any], cache_dir: Path, data_files: dict[str, Path]) -> str:
    text = (TASKS_DIR / template).read_text(encoding="utf-8").rstrip() + "\n"
    for key, value in extra.items():
        text += f"{key}: {_yaml_str(value) if isinstance(value, str) else json.dumps(value)}\n"
    text += "dataset_kwargs:\n"
    text += f"  cache_dir: {_yaml_str(str(cache_dir))}\n"
    text += "  data_files:\n"
    for split, path in data_files.items():
        text += f"    {split}: {_yaml_str(str(path.resolve()))}\n"
    return text


def write_hellaswag_task(source: str, out: Path) -> int:
    docs = load_hellaswag(source)
    data = out / "data" / "hellaswag.jsonl"
    _write_jsonl(data, docs)
    (out / "hellaswag.yaml").write_text(
        _task_yaml("hellaswag.yaml", {}, out / "hf_cache", {"validation": data}), encoding="utf-8")
    return len(docs)


def write_mmlu_tasks(source: str, out: Path, num_fewshot: int | None) -> int:
    files = mmlu_files(source)
    test = load_mmlu(files["test"])
    dev = load_mmlu(files["dev"]) if "dev" in files else []
    by_subject: dict[str, list[dict]] = {}
    for doc in test:
        by_subject.setdefault(doc["subject"], []).append(doc)
    dev_by_subject: dict[str, list[dict]] = {}
    for doc in dev:
        dev_by_subject.setdefault(doc["subject"], []).append(doc)
    tasks: dict[str, str] = {}
    for subject in sorted(by_subject):
        name = subject_task(subject)
        if name in tasks:
            raise BadInput(f"{files['test']}: subjects {tasks[name]!r} and {subject!r} both map to task {name}")
        tasks[name] = subject
        shots = dev_by_subject.get(subject, [])
        if num_fewshot and len(shots) < num_fewshot:
            where = files.get("dev", Path(source) / "dev.jsonl")
            raise BadInput(f"{where}: subject {subject!r} has {len(shots)} dev question(s), evaluate.num_fewshot="
                           f"{num_fewshot} needs {num_fewshot} ({MMLU_PARAM} dev files give the few-shot examples)")
        data_files = {"test": out / "data" / f"{name}.test.jsonl"}
        _write_jsonl(data_files["test"], by_subject[subject])
        extra: dict[str, Any] = {
            "task": name, "task_alias": subject,
            "description": f"The following are multiple choice questions (with answers) about "
                           f"{' '.join(subject.split('_'))}.\n\n"}
        if shots:
            data_files["dev"] = out / "data" / f"{name}.dev.jsonl"
            _write_jsonl(data_files["dev"], shots)
            extra["fewshot_split"] = "dev"
            extra["fewshot_config"] = {"sampler": "first_n"}
        (out / f"{name}.yaml").write_text(_task_yaml("mmlu_subject.yaml", extra, out / "hf_cache", data_files),
                                          encoding="utf-8")
    group = (TASKS_DIR / "mmlu_group.yaml").read_text(encoding="utf-8").rstrip() + "\n"
    group += "task:\n" + "".join(f"  - {name}\n" for name in tasks)
    (out / "mmlu.yaml").write_text(group, encoding="utf-8")
    return len(test)


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def plan_tasks(cfg, workdir: Path) -> TaskPlan:
    """Check `evaluate.tasks` and the local data, write the per-run task yaml files into
    `workdir`, and index them (and only what else is needed) with an lm-eval TaskManager."""
    from lm_eval.tasks import TaskManager

    ev = cfg.evaluate
    names = list(dict.fromkeys(t.strip() for t in ev.tasks))
    if not names or not all(names):
        raise BadInput(f"evaluate.tasks: expected a list of lm-eval task names, got {list(ev.tasks)!r}")
    plan = TaskPlan(names=names, include_path=[str(workdir)], include_defaults=False)
    sources = {"hellaswag": (ev.hellaswag.source, HELLASWAG_PARAM), "mmlu": (ev.mmlu.source, MMLU_PARAM)}
    others = []
    for name in names:
        if name in sources:
            source, param = sources[name]
            if source is None:
                plan.hub[name] = param
                # lm-eval's own config for just this task: no 15 s index of every task.
                folder = lm_eval_tasks_dir() / ("hellaswag" if name == "hellaswag" else "mmlu/default")
                plan.include_path.append(str(folder))
            elif "://" in source:
                raise BadInput(f"{param}: expected a local path, got {source!r} (null: lm-eval's own data from the hub)")
            else:
                n = (write_hellaswag_task(source, workdir) if name == "hellaswag"
                     else write_mmlu_tasks(source, workdir, ev.num_fewshot))
                plan.local[name] = f"{source} ({n} examples)"
        else:
            others.append(name)
    for name, (source, param) in sources.items():
        if source is not None and name not in names:
            log.info("evaluate: %s is set but %s is not in evaluate.tasks; ignored", param, name)
    if others:
        # Any other name needs lm-eval's full index; our local hellaswag/mmlu override its own.
        plan.include_defaults = True
        plan.include_path = [p for p in plan.include_path if not p.startswith(str(lm_eval_tasks_dir()))]
    plan.manager = TaskManager(include_path=plan.include_path, include_defaults=plan.include_defaults)
    known = set(plan.manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, plan.manager.all_tasks, n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise BadInput(f"evaluate.tasks: unknown lm-eval task {name!r}{hint}")
    return plan


def load_task_objects(plan: TaskPlan) -> list:
    """lm-eval Task/Group objects for each name, loaded here so that a data source that cannot
    be reached is a one-line error naming the param, not a traceback from inside lm-eval."""
    objects = []
    for name in plan.names:
        try:
            loaded = plan.manager.load([name])
        except (BadInput, SourceUnreachable):
            raise
        except Exception as e:
            if name in plan.local:
                raise
            param = plan.hub.get(name)
            fix = f"set {param} to a local copy" if param else "check the network or the task's data"
            raise SourceUnreachable(f"evaluate: lm-eval task {name!r} could not load its data "
                                    f"({type(e).__name__}: {_one_line(e)[:300]}); {fix}") from None
        if name in loaded["groups"]:
            objects.append(loaded["groups"][name])
        elif name in loaded["tasks"]:
            objects.append(loaded["tasks"][name])
        else:  # a tag: its tasks
            objects.extend(loaded["tasks"].values())
    return objects


# =============================================================================================
# Results


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def flatten_results(results: dict) -> dict[str, float]:
    """lm-eval's results -> {"<task>.<metric>": value}: `acc,none` -> `acc`, `acc_stderr,none`
    -> `acc_stderr`, another filter `f` -> `<metric>_<f>`; `<task>.n` examples scored; and
    `mmlu.acc_subject_mean`, the unweighted mean over the leaf `mmlu_*` tasks."""
    flat: dict[str, float] = {}
    n_samples = results.get("n-samples", {})
    leaves = set(results.get("configs", {}))
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if key in ("alias", "sample_len") or not _is_number(value):
                continue
            metric, _, filt = key.partition(",")
            if filt and filt != "none":
                metric += "_" + tracking.metric_name(filt)
            flat[f"{task}.{metric}"] = float(value)
        if task in n_samples:
            flat[f"{task}.n"] = float(n_samples[task].get("effective", 0))
        else:  # a group: the sum over its leaf tasks
            members = _leaves_of(task, results)
            flat[f"{task}.n"] = float(sum(n_samples.get(t, {}).get("effective", 0) for t in members))
    subjects = [t for t in leaves if t.startswith("mmlu_") and f"{t}.acc" in flat]
    if "mmlu.acc" in flat and subjects:
        flat["mmlu.acc_subject_mean"] = sum(flat[f"{t}.acc"] for t in subjects) / len(subjects)
    return flat


def _leaves_of(group: str, results: dict) -> list[str]:
    children = results.get("group_subtasks", {}).get(group, [])
    out = []
    for child in children:
        out += _leaves_of(child, results) if child in results.get("group_subtasks", {}) else [child]
    return out


def save_results(results: dict, folder: Path) -> None:
    """results.json (without samples) and samples_<task>.jsonl, replacing `folder` as a whole."""
    from lm_eval.utils import handle_non_serializable

    samples = results.get("samples", {})
    with atomic_dir(folder) as tmp:
        body = {k: v for k, v in results.items() if k != "samples"}
        (tmp / "results.json").write_text(
            json.dumps(body, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n", encoding="utf-8")
        for task, rows in samples.items():
            with open(tmp / f"samples_{task}.jsonl", "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n")


def _fmt(v: float | None, digits: int = 4) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def write_report(path: str | Path, per_model: dict[str, dict], cfg, plan: TaskPlan,
                 other_metrics: Mapping[str, str] = OTHER_METRICS) -> str:
    import lm_eval

    ev = cfg.evaluate
    lines = ["# Evaluation", "",
             f"lm-evaluation-harness {getattr(lm_eval, '__version__', '?')} through gptforge's `LM` "
             f"(`gptforge.evaluate`); num_fewshot: {'task default' if ev.num_fewshot is None else ev.num_fewshot}, "
             f"limit: {ev.limit if ev.limit is not None else 'none'} (per task; per subject for MMLU).", ""]
    for name in plan.names:
        where = plan.local.get(name) or (f"lm-eval's own data ({plan.hub[name]} not set)" if name in plan.hub
                                         else "lm-eval's own task and data")
        lines.append(f"- `{name}`: {where}")
    lines += ["", "| model | task | metric | value | ± stderr | n | reference |", "|---|---|---|---|---|---|---|"]
    for model, info in per_model.items():
        flat = info["flat"]
        for key in sorted(flat):
            task, _, metric = key.rpartition(".")
            if metric == "n" or metric.endswith("_stderr"):
                continue
            if task.startswith("mmlu_") and "mmlu" in plan.local:
                continue  # subjects: in results.json; the table shows the group
            stderr = flat.get(f"{task}.{metric}_stderr")
            ref = REFERENCE.get((task, metric))
            chance = CHANCE.get((task, metric))
            ref_text = f"{ref[0]:.4f} ({ref[1]})" if ref else (f"chance {chance:.2f} (4 choices)" if chance else "")
            n = flat.get(f"{task}.n")
            lines.append(f"| {model} | {task} | {metric} | {_fmt(flat[key])} | {_fmt(stderr)} | "
                         f"{'' if n is None else int(n)} | {ref_text} |")
    subjects = {m: {k.rpartition(".")[0]: v for k, v in info["flat"].items()
                    if k.startswith("mmlu_") and k.endswith(".acc")} for m, info in per_model.items()}
    if any(subjects.values()) and "mmlu" in plan.local:
        models = list(per_model)
        lines += ["", "MMLU accuracy per subject:", "", "| subject | " + " | ".join(models) + " |",
                  "|---|" + "---|" * len(models)]
        for task in sorted(set().union(*subjects.values())):
            lines.append(f"| {task[len('mmlu_'):]} | " + " | ".join(_fmt(subjects[m].get(task)) for m in models) + " |")
    lines += ["", "Throughput (this machine; seconds: the whole lm-eval call, model seconds: inside our model):", "",
              "| model | examples | seconds | examples/s | model seconds | device |", "|---|---|---|---|---|---|"]
    for model, info in per_model.items():
        lines.append(f"| {model} | {info['examples']} | {info['seconds']:.1f} | {info['examples_per_sec']:.1f} | "
                     f"{info['model_seconds']:.2f} | {info['device']} |")
    lines += ["", "HellaSwag here is lm-eval's: query `activity_label: ctx_a Ctx_b` with `[...]` tags stripped, "
              "acc_norm normalised by characters. The `hellaswag_acc_norm` in metrics/pretrain.json is "
              "build-nanogpt's completion-style score (raw `ctx`, loss per token); the two are not comparable."]
    outcome = []
    for file, (what, keys) in other_metrics.items():
        p = Path(file)
        if not p.is_file():
            continue
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            log.warning("evaluate: %s not readable (%s); left out of the report", p, e)
            continue
        for key in keys:
            if _is_number(data.get(key)):
                outcome.append(f"| {what} | {key} | {_fmt(float(data[key]))} | `{file}` |")
    if outcome:
        lines += ["", "## The rest of the pipeline", "", "| model | metric | value | from |", "|---|---|---|---|",
                  *outcome]
    text = "\n".join(lines) + "\n"
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


# =============================================================================================
# The recipe


def existing_models(models: Mapping[str, str]) -> dict[str, Path]:
    """The listed checkpoint folders that exist; a missing one is skipped with a log line, but
    when none exists it is a BadInput naming them."""
    if not models:
        raise BadInput("evaluate.models: no models listed (name: checkpoint folder)")
    found = {name: Path(folder) for name, folder in models.items() if Path(folder).is_dir()}
    missing = {name: folder for name, folder in models.items() if name not in found}
    if not found:
        if len(missing) == 1:
            (name, folder), = missing.items()
            raise BadInput(f"evaluate.models.{name}: checkpoint folder {folder} not found")
        listed = ", ".join(f"{n} ({f})" for n, f in missing.items())
        raise BadInput(f"evaluate.models: none of the checkpoint folders exists: {listed}")
    for name, folder in missing.items():
        log.info("evaluate: skipping %s: checkpoint folder %s not found", name, folder)
    return found


def resolve_device(device: str) -> torch.device:
    """auto | cpu | cuda | cuda:N, checked as fine-tuning checks it; fp32 weights (TF32 matmuls on CUDA)."""
    from gptforge.finetune.common import runtime

    return runtime(device, "fp32", param="evaluate").device


@contextlib.contextmanager
def _child_of(run: NullRun):
    """Per-model MLflow runs nest under the stage's run when it is a real one (MLflow refuses a
    second top-level run while one is active)."""
    if not run.run_id:
        yield
        return
    old = os.environ.get(tracking.PARENT_ENV)
    os.environ[tracking.PARENT_ENV] = run.run_id
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(tracking.PARENT_ENV, None)
        else:
            os.environ[tracking.PARENT_ENV] = old


def evaluate_model(name: str, folder: Path, plan: TaskPlan, cfg, enc, device: torch.device,
                   results_dir: Path) -> dict:
    """One model on every task: lm-eval results saved under results_dir/<name>/."""
    from lm_eval import simple_evaluate

    from gptforge.hf_convert import load_pretrained

    ev = cfg.evaluate
    # a gptforge checkpoint, or a Hugging Face GPT-2 folder (checkpoints/base/NAME) converted
    model = load_pretrained(str(folder), param=f"evaluate.models.{name}")[0].to(device).eval()
    lm = GptforgeLM(model, enc, batch_size=ev.batch_size, device=device, name=name)
    tasks = load_task_objects(plan)
    start = time.perf_counter()
    results = simple_evaluate(model=lm, tasks=tasks, num_fewshot=ev.num_fewshot, limit=ev.limit,
                              batch_size=ev.batch_size, device=str(device), task_manager=plan.manager,
                              log_samples=True)
    seconds = time.perf_counter() - start
    examples = int(sum(v.get("effective", 0) for v in results.get("n-samples", {}).values()))
    flat = flatten_results(results)
    results["config"]["checkpoint"] = str(folder)
    save_results(results, results_dir / name)
    rate = examples / seconds if seconds > 0 else 0.0
    log.info("evaluate %s: %d examples (%d loglikelihood requests) in %.1f s, %.1f examples/s on %s",
             name, examples, lm.counts["loglikelihood"], seconds, rate, device)
    return {"flat": flat, "examples": examples, "seconds": seconds, "examples_per_sec": rate,
            "model_seconds": lm.seconds, "device": str(device), "requests": dict(lm.counts), "cut_continuations": lm.cut_continuations}


def evaluate(cfg, *, steps: Steps = DIRECT, run: NullRun = NullRun(), metrics_path="metrics/evaluate.json",
             report_path="reports/evaluate.md", results_dir="reports/evaluate") -> dict:
    """Stage `evaluate`: see the module docstring. Returns the flat metrics it wrote."""
    from gptforge.tokenizer import load_tokenizer

    models = existing_models(cfg.evaluate.models)
    device = resolve_device(cfg.evaluate.device)
    results_dir = Path(results_dir)
    metrics: dict[str, float] = {}
    per_model: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gptforge-lm-eval-") as tmp:
        plan = steps(plan_tasks, cfg, Path(tmp))
        enc = load_tokenizer(cfg.tokenizer.path)
        for name, folder in models.items():
            with _child_of(run), tracking.start_run(
                    enabled=cfg.tracking.enabled, experiment=cfg.tracking.experiment, stage=f"evaluate:{name}",
                    params={**cfg.flat("evaluate"), "model": name, "checkpoint": str(folder),
                            "tokenizer.path": cfg.tokenizer.path},
                    tags={"gptforge.model": name}) as model_run:
                info = steps(evaluate_model, name, folder, plan, cfg, enc, device, results_dir)
                mine = {**info["flat"], "examples_per_sec": info["examples_per_sec"], "seconds": info["seconds"],
                        "model_seconds": info["model_seconds"]}
                model_run.log_metrics(mine)
                model_run.log_artifact(results_dir / name, "lm_eval")
            per_model[name] = info
            metrics.update({f"{name}.{k}": v for k, v in mine.items()})
        write_report(report_path, per_model, cfg, plan)
    tracking.publish_metrics(run, metrics, metrics_path)
    run.log_artifact(report_path)
    run.log_artifact(results_dir)
    return metrics


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
