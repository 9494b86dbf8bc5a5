"""`gptforge evaluate-qa`: the accuracy table of a document set (DVC stage evaluate_qa@NAME,
`-S synthesize.only=NAME`): each language model the pipeline made answers the set's held-out
questions twice, without and with retrieval, and both sets of answers are scored against the
references the way the instruct stage scores its test answers.

The questions: the user's own file when `evaluate_qa.questions.NAME` names one (JSON lines of
`question`, `answer` and optionally `source`, a file of the document set: `read_user_questions`);
else the instruct test split (`data/instruct/test.jsonl`) when prepare_instruct reads this set's
pairs (`data.instruct.source: synthetic://NAME`: questions the fine-tuned models never trained
on); else every pair synthesize kept (`data/synthetic/NAME/qa.jsonl`). The first
`evaluate_qa.limit` when set. A set synthesized without an endpoint has chunks and no pairs, so
its questions must be the user's. The retrieval: the set's index (`data/index/NAME/`, stage
index@NAME, checked against the set's name and chunks), its `index.top_k` best chunks put in
front of the question by `rag.prompt.augment`, cut to fit the model's positions with
`evaluate_qa.max_new_tokens` left for the answer.

The models: every entry of `evaluate_qa.models` (null: `evaluate.models`) whose folder exists
(as the evaluate stage walks them): a gptforge checkpoint or Hugging Face GPT-2 folder (our GPT,
`tokenizer.path`), or any other Hugging Face causal-LM folder with its own tokenizer (in bf16
under `evaluate_qa.precision` bf16). Each is prompted in `evaluate_qa.template` (null: the
instruct stage's, `instruct.template`; finetune/templates.py) and answers greedily with the
instruct stage's own decoding (`instruct.respond`; `hf_models.greedy_answers`, in batches of
prompts of similar lengths). `chat` needs the model's chat template: a model without one (our
GPT, a base model's tokenizer) is prompted with `alpaca` instead, and the report says so. A
question whose plain prompt fills the model's positions gets the empty answer in both modes
(counted, `<model>.too_long`).

What it writes, per set (`<model>` the model's key; `qa` without retrieval,
`qa_rag` with it; `<metric>`: exact_match, token_f1, rouge_l, n, and judge_score and
judge_unscored when `instruct.judge` names an endpoint):
- `reports/evaluate_qa_NAME.jsonl`: one row per model x question: model, question, input,
  reference, answer, answer_rag, sources (the retrieved chunks: rank, id, file, headings, span,
  score, what was included), chunk (the question's source chunk, when known), source and
  source_rank (the file the user's question names, and the rank of its best chunk among the
  top_k retrieved, null when none of them is from it);
- `reports/evaluate_qa_NAME.md`: the table, one row per model and mode;
- `metrics/evaluate_qa_NAME.json`: `<model>.qa.<metric>`, `<model>.qa_rag.<metric>`,
  `<model>.too_long`, and with questions that name their source file `retrieval.source_hit`
  (the share of them whose file is among the top_k retrieved: the same for every model, since
  retrieval comes before the prompt is cut) and `retrieval.source_n`. The stage's MLflow run
  gets the same metrics (prefixed `NAME.` when several sets are evaluated at once, as the index
  stage does) and the three files.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from gptforge.errors import BadInput
from gptforge.io import atomic_file, write_json
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun

log = logging.getLogger("gptforge")

PARAM = "evaluate_qa"
QUESTIONS_DIR = Path("data/qa")  # dvc.yaml's evaluate_qa stage depends on this folder
QUESTION_LINE = 'each line is {"question": ..., "answer": ..., "source": a file of the set (optional)}'
MODES = ("qa", "qa_rag")
METRICS = ("exact_match", "token_f1", "rouge_l")


@dataclass
class QASet:
    """One document set's questions and its index."""

    name: str
    records: list[dict]  # instruction, input, output (+ chunk, or source and source_rank, when known)
    origin: str  # the file the questions come from
    index: Any  # rag.index.Index


@dataclass
class Answerer:
    """A loaded model and how to prompt it."""

    name: str
    model: Any
    enc: Any  # tiktoken's Encoding (our GPT) or hf_causal.HFTokenizer
    template: str
    positions: int
    gpt: bool


def evaluate_qa(
    cfg,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    synthetic_root: str | os.PathLike = "data/synthetic",
    index_root: str | os.PathLike = "data/index",
    instruct_dir: str | os.PathLike = "data/instruct",
    reports_dir: str | os.PathLike = "reports",
    metrics_dir: str | os.PathLike = "metrics",
) -> dict:
    """Stage evaluate_qa for `synthesize.documents[synthesize.only]` (every entry when `only` is
    null): see the module docstring. Returns the metrics it logged."""
    from gptforge.evaluate import existing_models
    from gptforge.synthesize.stage import selected_documents

    names = selected_documents(cfg.synthesize)
    unknown = [n for n in cfg.evaluate_qa.questions if n not in cfg.synthesize.documents]
    if unknown:
        raise BadInput(
            f"evaluate_qa.questions.{unknown[0]} names no entry of synthesize.documents (entries: "
            f"{', '.join(cfg.synthesize.documents) or 'none'})"
        )
    # every bad input before any model loads
    sets = [
        steps(read_set, cfg, name, synthetic_root=synthetic_root, index_root=index_root, instruct_dir=instruct_dir)
        for name in names
    ]
    models = existing_models(qa_models(cfg))
    rt = _runtime(cfg)
    rows: dict[str, list[dict]] = {s.name: [] for s in sets}
    notes: dict[str, dict] = {}
    for model_name, folder in models.items():
        got, notes[model_name] = steps(answer_sets, cfg, model_name, folder, sets, rt)
        for name, more in got.items():
            rows[name].extend(more)
    metrics: dict[str, float] = {}
    for s in sets:
        got = steps(write_set, cfg, s, rows[s.name], notes, reports_dir=reports_dir, metrics_dir=metrics_dir)
        metrics.update({f"{s.name}.{k}": v for k, v in got.items()} if len(sets) > 1 else got)
        for path in _outputs(s.name, reports_dir, metrics_dir):
            run.log_artifact(path)
    run.log_metrics(metrics)
    return metrics


def _outputs(name: str, reports_dir, metrics_dir) -> tuple[Path, Path, Path]:
    """(rows jsonl, report md, metrics json) of set `name`."""
    return (
        Path(reports_dir) / f"evaluate_qa_{name}.jsonl",
        Path(reports_dir) / f"evaluate_qa_{name}.md",
        Path(metrics_dir) / f"evaluate_qa_{name}.json",
    )


def _runtime(cfg):
    """The device (evaluate_qa.device: auto | cpu | cuda | cuda:N) and the precision
    (evaluate_qa.precision: a Hugging Face model's weights in bf16 under bf16)."""
    from gptforge.finetune.common import runtime

    return runtime(cfg.evaluate_qa.device, cfg.evaluate_qa.precision, param=PARAM)


# ---------------------------------------------------------------------------------------------
# The questions and the index


def read_set(cfg, name: str, *, synthetic_root, index_root, instruct_dir) -> QASet:
    """The held-out questions of set `name` and its index; one-line BadInput when the pairs or
    the index are missing, or the index is of another set, other chunks or another version."""
    from gptforge.rag.index import Index, file_sha256
    from gptforge.rag.stage import index_path

    folder = Path(synthetic_root) / name
    qa_file, chunks_file = folder / "qa.jsonl", folder / "chunks.jsonl"
    own = cfg.evaluate_qa.questions.get(name)
    for path in (chunks_file,) if own else (chunks_file, qa_file):
        if not path.is_file() and path is qa_file and cfg.synthesize.endpoint.url is None:
            raise BadInput(
                f"{PARAM} {name}: {folder} holds chunks only, no questions (synthesize.endpoint.url is "
                f"null): set evaluate_qa.questions.{name} to your question file (docs/rag.md)"
            )
        if not path.is_file():
            raise BadInput(
                f"{PARAM} {name}: {path} not found: run `gptforge synthesize -S synthesize.only={name}` "
                "first (stage synthesize@NAME)"
            )
    if own:
        origin = Path(own)
        records = read_user_questions(origin, param=f"evaluate_qa.questions.{name}")
        if not _under(origin, QUESTIONS_DIR):
            log.warning(
                "evaluate_qa.questions.%s: %s is outside %s/, which dvc.yaml's evaluate_qa stage depends on: "
                "`dvc repro` will not see it change",
                name,
                origin,
                QUESTIONS_DIR,
            )
    elif cfg.data.instruct.source == f"synthetic://{name}":
        origin = Path(instruct_dir) / "test.jsonl"
        if not origin.is_file():
            raise BadInput(
                f"{PARAM} {name}: {origin} not found (data.instruct.source is synthetic://{name}, so the "
                "questions are its held-out split): run `gptforge prepare instruct` first"
            )
        records = read_questions(origin, param=f"{PARAM} {name}")
    else:
        origin = qa_file
        records = read_questions(origin, param=f"{PARAM} {name}")
    if cfg.evaluate_qa.limit is not None:
        records = records[: cfg.evaluate_qa.limit]
    index = Index.load(
        index_path(name, index_root), name=name, chunks_sha256=file_sha256(chunks_file), param=f"{PARAM} {name}"
    )
    if own:
        rank_sources(records, index, cfg.index.top_k, param=f"evaluate_qa.questions.{name}", path=origin)
    log.info(
        "evaluate_qa %s: %d questions from %s; index %s (%s, %d chunks), top_k %d",
        name,
        len(records),
        origin,
        index.folder,
        index.method,
        len(index.chunks),
        cfg.index.top_k,
    )
    return QASet(name, records, str(origin), index)


def _under(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _json_lines(path: Path, *, param: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line; BadInput naming the file and line when one is
    not JSON, or the file is not UTF-8 text."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{param}: {path} is not UTF-8 text (byte offset {e.start}): save it as UTF-8") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{param}: {path}:{number} is not a JSON line ({e.msg})") from None


def read_user_questions(path: Path, *, param: str) -> list[dict]:
    """The user's question file as records (instruction = question, input "", output = answer,
    source when given, line); BadInput (one line) when it is missing or empty, a line is not JSON
    or lacks a non-empty string question or answer, or its source is not a string."""
    if not path.is_file():
        raise BadInput(f"{param}: {path} not found (a .jsonl file: {QUESTION_LINE})")
    records = []
    for number, rec in _json_lines(path, param=param):
        if not isinstance(rec, dict):
            raise BadInput(f"{param}: {path}:{number} is not a JSON object: {QUESTION_LINE}")
        for key in ("question", "answer"):
            if not (isinstance(rec.get(key), str) and rec[key].strip()):
                raise BadInput(f"{param}: {path}:{number} has no {key!r} (a non-empty string): {QUESTION_LINE}")
        kept = {"instruction": rec["question"], "input": "", "output": rec["answer"], "line": number}
        if rec.get("source") is not None:
            if not (isinstance(rec["source"], str) and rec["source"].strip()):
                raise BadInput(
                    f'{param}: {path}:{number}: "source" must be a file name of the document set, got {rec["source"]!r}'
                )
            kept["source"] = rec["source"]
        records.append(kept)
    if not records:
        raise BadInput(f"{param}: {path} holds no question: {QUESTION_LINE}")
    return records


def rank_sources(records: Sequence[dict], index, top_k: int, *, param: str, path: Path) -> None:
    """Set each record's `source_rank` (the rank of the best of its source file's chunks among the
    index's top_k for its question, None when none is there); BadInput when a source is not a
    file of the indexed set."""
    from gptforge.finetune.templates import user_content

    files = sorted({c.source for c in index.chunks})
    for rec in records:
        if "source" not in rec:
            continue
        if rec["source"] not in files:
            shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
            raise BadInput(
                f"{param}: {path}:{rec['line']}: source {rec['source']!r} is no file of the document set "
                f"(its files, relative to its folder: {shown})"
            )
        ranks = [hit.rank for hit in index.search(user_content(rec), top_k) if hit.chunk.source == rec["source"]]
        rec["source_rank"] = ranks[0] if ranks else None


def read_questions(path: Path, *, param: str) -> list[dict]:
    """The Alpaca records of a jsonl file (instruction, input, output, and the source chunk's id
    when given); BadInput naming the file and line when a record is not one, or there is none."""
    records = []
    for number, rec in _json_lines(path, param=param):
        if not (
            isinstance(rec, dict)
            and isinstance(rec.get("instruction"), str)
            and isinstance(rec.get("output"), str)
            and isinstance(rec.get("input") or "", str)
        ):
            raise BadInput(f'{param}: {path}:{number} is not an object with string "instruction" and "output"')
        kept = {"instruction": rec["instruction"], "input": rec.get("input") or "", "output": rec["output"]}
        if isinstance(rec.get("chunk"), str):
            kept["chunk"] = rec["chunk"]
        records.append(kept)
    if not records:
        raise BadInput(f"{param}: {path} holds no question")
    return records


# ---------------------------------------------------------------------------------------------
# The answers


def qa_models(cfg) -> dict[str, str]:
    """The models that answer: `evaluate_qa.models`, else `evaluate.models`."""
    return cfg.evaluate_qa.models if cfg.evaluate_qa.models is not None else cfg.evaluate.models


def load_answerer(cfg, name: str, folder: Path, rt) -> Answerer:
    """The model `name` (of `qa_models`) on the device, in eval mode, and its template."""
    import torch

    from gptforge.finetune.common import model_positions
    from gptforge.modeling.hf_causal import HFTokenizer, hf_source

    param = f"evaluate_qa.models.{name}" if cfg.evaluate_qa.models is not None else f"evaluate.models.{name}"
    if hf_source(str(folder)) is not None:
        from gptforge.modeling.hf_causal import load_causal_lm

        # bf16 weights under evaluate_qa.precision bf16: autocast over fp32 ones would cast every
        # weight again at each decoded token
        dtype = torch.bfloat16 if rt.precision == "bf16" else None
        model, tokenizer = load_causal_lm(str(folder), param=param, dtype=dtype)
        enc, gpt = HFTokenizer(tokenizer), False
    else:  # a gptforge checkpoint, or a Hugging Face GPT-2 folder converted
        from gptforge.modeling.hf_convert import load_pretrained
        from gptforge.modeling.tokenizer import load_tokenizer

        enc, gpt = load_tokenizer(cfg.tokenizer.path), True
        model, source = load_pretrained(str(folder), param=param)
        if model.config.n_vocab != enc.n_vocab:
            raise BadInput(
                f"{param}: {source} has a vocabulary of {model.config.n_vocab} tokens, the tokenizer "
                f"(tokenizer.path) {enc.n_vocab}"
            )
    model = model.to(rt.device).eval()
    template = cfg.evaluate_qa.template or cfg.instruct.template
    if template == "chat" and not getattr(getattr(enc, "tokenizer", None), "chat_template", None):
        log.info("evaluate_qa %s: no chat template (the template is chat): prompted with alpaca", name)
        template = "alpaca"
    return Answerer(name, model, enc, template, model_positions(model), gpt)


def answer_sets(cfg, name: str, folder: Path, sets: Sequence[QASet], rt) -> tuple[dict[str, list[dict]], dict]:
    """Model `name` loaded once, its rows for every set ({set name: rows}), and what the report
    says about it (template, folder)."""
    import torch

    a = load_answerer(cfg, name, folder, rt)
    try:
        out = {s.name: answer_set(a, s, cfg, rt) for s in sets}
    finally:
        del a.model
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()
    return out, {"template": a.template, "folder": str(folder), "positions": a.positions}


def answer_set(a: Answerer, s: QASet, cfg, rt) -> list[dict]:
    """Each question of `s` answered by `a` without and with the index's top_k chunks."""
    from tqdm.auto import tqdm

    from gptforge.finetune.templates import encode, user_content
    from gptforge.rag.prompt import augment

    max_new = cfg.evaluate_qa.max_new_tokens
    prompt_ids: Callable[[dict], list[int]] = lambda rec: encode(rec, a.template, a.enc)[0]  # noqa: E731
    plain, rag, rows = [], [], []
    for rec in tqdm(s.records, desc=f"evaluate_qa {s.name}: {a.name} prompts", unit="q", leave=False):
        question = user_content(rec)
        ids = prompt_ids(rec)
        row = {"model": a.name, "question": rec["instruction"], "input": rec["input"], "reference": rec["output"]}
        if "chunk" in rec:
            row["chunk"] = rec["chunk"]
        if "source" in rec:
            row["source"], row["source_rank"] = rec["source"], rec["source_rank"]

        def fits(text: str, ref: str = rec["output"]) -> bool:
            return len(prompt_ids({"instruction": text, "input": "", "output": ref})) + max_new <= a.positions

        sourced = augment(question, s.index.search(question, cfg.index.top_k), fits)
        row["sources"] = sourced.sources
        if len(ids) >= a.positions:  # no room for even one answer token
            row["too_long"] = True
        else:
            plain.append((len(rows), ids))
            rag.append((len(rows), prompt_ids({"instruction": sourced.text, "input": "", "output": rec["output"]})))
        rows.append(row)
    start = time.perf_counter()
    answers = _generate(a, [ids for _, ids in plain + rag], max_new, rt)
    for (i, _), text in zip(plain, answers[: len(plain)]):
        rows[i]["answer"] = text
    for (i, _), text in zip(rag, answers[len(plain) :]):
        rows[i]["answer_rag"] = text
    for row in rows:
        row.setdefault("answer", "")
        row.setdefault("answer_rag", "")
    too_long = sum(1 for r in rows if r.get("too_long"))
    if too_long:
        log.warning(
            "evaluate_qa %s: %s: %d question(s) whose prompt fills its %d positions: answered empty",
            s.name,
            a.name,
            too_long,
            a.positions,
        )
    log.info(
        "evaluate_qa %s: %s answered %d questions twice in %.1f s (template %s, %d positions)",
        s.name,
        a.name,
        len(rows),
        time.perf_counter() - start,
        a.template,
        a.positions,
    )
    return rows


def _generate(a: Answerer, prompts: list[list[int]], max_new_tokens: int, rt) -> list[str]:
    """Greedy answers with the instruct stage's own decoding for the kind of model."""
    from gptforge.finetune.hf_models import greedy_answers
    from gptforge.finetune.instruct import respond

    if not prompts:
        return []
    examples = [(ids, []) for ids in prompts]
    if a.gpt:
        return respond(a.model, examples, enc=a.enc, max_new_tokens=max_new_tokens, rt=rt)[0]
    return greedy_answers(a.model, examples, enc=a.enc, max_new_tokens=max_new_tokens, positions=a.positions, rt=rt)[0]


# ---------------------------------------------------------------------------------------------
# Scores and outputs


def score(rows: Sequence[dict], key: str, cfg) -> dict[str, float]:
    """answer_quality's scores of the answers under `key` (answer | answer_rag) against the
    references: exact_match, token_f1, rouge_l, n; judge_score and judge_unscored with a judge."""
    from gptforge.finetune.answer_quality import judge_scores, reference_scores

    scored = [
        {"instruction": r["question"], "input": r.get("input", ""), "reference": r["reference"], "response": r[key]}
        for r in rows
    ]
    got = reference_scores(scored)
    metrics = {k: got[k] for k in METRICS if k in got}
    metrics["n"] = got["n_scored"]
    judge = cfg.instruct.judge
    if judge.url and judge.model and scored:
        judged = judge_scores(scored, url=judge.url, model=judge.model)
        if judged.mean is not None:
            metrics["judge_score"] = judged.mean
        metrics["judge_unscored"] = judged.unscored
    return metrics


def write_set(cfg, s: QASet, rows: Sequence[dict], notes: dict[str, dict], *, reports_dir, metrics_dir) -> dict:
    """The rows, the report and the metrics of one set; returns the metrics (unprefixed)."""
    rows_path, report_path, metrics_path = _outputs(s.name, reports_dir, metrics_dir)
    with atomic_file(rows_path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    table: dict[str, dict[str, dict]] = {}
    metrics: dict[str, float] = {}
    for model in notes:
        mine = [r for r in rows if r["model"] == model]
        table[model] = {"qa": score(mine, "answer", cfg), "qa_rag": score(mine, "answer_rag", cfg)}
        for mode, got in table[model].items():
            metrics.update({f"{model}.{mode}.{k}": v for k, v in got.items()})
        metrics[f"{model}.too_long"] = sum(1 for r in mine if r.get("too_long"))
        log.info(
            "evaluate_qa %s: %s: token F1 %.3f without retrieval, %.3f with; ROUGE-L %.3f, %.3f (n %d)",
            s.name,
            model,
            table[model]["qa"].get("token_f1", 0.0),
            table[model]["qa_rag"].get("token_f1", 0.0),
            table[model]["qa"].get("rouge_l", 0.0),
            table[model]["qa_rag"].get("rouge_l", 0.0),
            table[model]["qa"]["n"],
        )
    metrics.update(source_hits(s.records))
    with atomic_file(report_path, "w", encoding="utf-8") as f:
        f.write(report(cfg, s, table, notes, rows))
    write_json(metrics_path, metrics)
    return metrics


def source_hits(records: Sequence[dict]) -> dict[str, float]:
    """retrieval.source_hit (the share of the questions naming their source file whose file is
    among the top_k retrieved) and retrieval.source_n; {} when no question names one."""
    ranks = [rec["source_rank"] for rec in records if "source_rank" in rec]
    if not ranks:
        return {}
    return {"retrieval.source_hit": sum(r is not None for r in ranks) / len(ranks), "retrieval.source_n": len(ranks)}


def report(cfg, s: QASet, table: dict[str, dict[str, dict]], notes: dict[str, dict], rows: Sequence[dict]) -> str:
    """The markdown report: what was asked, then one row per model and mode."""
    judged = any("judge_score" in got or "judge_unscored" in got for modes in table.values() for got in modes.values())
    columns = [*METRICS, *(["judge_score"] if judged else []), "n"]
    lines = [
        f"# evaluate_qa: {s.name}",
        "",
        f"{len(s.records)} questions from `{s.origin}`; each model answers every question greedily (at most "
        f"{cfg.evaluate_qa.max_new_tokens} new tokens) without retrieval (`qa`) and with the "
        f"{cfg.index.top_k} best chunks of `{s.index.folder}` ({s.index.method}) in front of it, cut to fit "
        "its context (`qa_rag`). Scores against the references: exact match and token F1 (SQuAD-normalized), "
        "ROUGE-L F-measure" + (", the judge (0-100)" if judged else "") + ".",
        "",
        "| model | mode | " + " | ".join(columns) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in columns) + " |",
    ]
    for model, modes in table.items():
        for mode in MODES:
            got = modes[mode]
            cells = [str(int(got["n"])) if c == "n" else (f"{got[c]:.3f}" if c in got else "-") for c in columns]
            lines.append(f"| {model} | {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Prompts: "
        + "; ".join(
            f"{m} ({n['folder']}): template {n['template']}, {n['positions']} positions" for m, n in notes.items()
        )
        + ".",
    ]
    too_long = {m: sum(1 for r in rows if r["model"] == m and r.get("too_long")) for m in notes}
    if any(too_long.values()):
        lines.append(
            "Questions whose prompt fills the model's positions (answered empty): "
            + ", ".join(f"{m} {n}" for m, n in too_long.items() if n)
            + "."
        )
    hits = source_hits(s.records)
    if hits:
        lines.append(
            f"Retrieval: the question's source file among the {cfg.index.top_k} chunks retrieved for "
            f"{round(hits['retrieval.source_hit'] * hits['retrieval.source_n'])} of "
            f"{hits['retrieval.source_n']} questions that name one (source_hit "
            f"{hits['retrieval.source_hit']:.3f})."
        )
    cut = sum(1 for r in rows for src in r["sources"] if src["included"] != "whole")
    if cut:
        lines.append(
            f"Retrieved chunks cut or dropped to fit: {cut} of "
            f"{sum(len(r['sources']) for r in rows)} (in the rows' `sources`)."
        )
    return "\n".join(lines) + "\n"
