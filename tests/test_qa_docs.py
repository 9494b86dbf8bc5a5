"""The question set shipped about gptforge's own manual, `data/qa/gptforge_docs.jsonl`: a few
dozen questions, each answered in a few words by the page of docs/ it names. The set must not rot
as the pages change: every answer's words are still found in its page, and the index of docs/
(synthesize's chunker at its defaults, BM25, `index.top_k`) still finds the named page for
nearly every question. dvc.yaml's evaluate_qa stage depends on the folder that holds it.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from cli_support import REPO

from gptforge.config.load import load_config
from gptforge.finetune.answer_quality import normalize
from gptforge.rag import evaluate_qa as E

QUESTIONS = REPO / "data" / "qa" / "gptforge_docs.jsonl"
DOCS = REPO / "docs"


def records() -> list[dict]:
    return E.read_user_questions(QUESTIONS, param="evaluate_qa.questions.gptforge-docs")


def test_a_few_dozen_distinct_questions_each_naming_a_page():
    rows = [json.loads(line) for line in QUESTIONS.read_text(encoding="utf-8").splitlines()]
    assert 30 <= len(rows) <= 40
    assert all(set(r) == {"question", "answer", "source"} for r in rows)
    assert len({normalize(r["question"]) for r in rows}) == len(rows)
    assert all((DOCS / r["source"]).is_file() for r in rows)
    assert all(len(r["answer"].split()) <= 5 for r in rows)  # short answers: a name, a number, a command
    assert len(records()) == len(rows)  # evaluate_qa reads it


def test_every_answer_is_still_stated_by_its_page():
    """At least 80% of each answer's SQuAD-normalized tokens (the ones token F1 counts) occur in
    its page; measured: all of them, and 36 of the 38 answers verbatim."""
    missing = []
    for rec in records():
        page = set(normalize((DOCS / rec["source"]).read_text(encoding="utf-8")).split())
        tokens = normalize(rec["output"]).split()
        found = sum(t in page for t in tokens) / len(tokens)
        if found < 0.8:
            missing.append(f"{rec['source']}: {rec['output']!r} ({found:.0%} of its words)")
    assert not missing, "answers no longer stated by their pages: " + "; ".join(missing)


def test_the_index_of_docs_finds_the_named_page(tmp_path):
    """docs/ chunked as synthesize@NAME chunks it (no endpoint) and indexed as index@NAME does:
    the named page among the top_k chunks for at least 90% of the questions (measured: 38 of 38)."""
    from gptforge.modeling.tokenizer import load_tokenizer
    from gptforge.rag.index import build
    from gptforge.samples import resolve
    from gptforge.synthesize.chunks import chunk_documents
    from gptforge.synthesize.documents import read_documents

    cfg = load_config(None, [])
    enc = load_tokenizer(resolve("sample://gpt2_tokenizer"))
    chunks = chunk_documents(
        read_documents(DOCS, param="docs"),
        count_tokens=lambda t: len(enc.encode_ordinary(t)),
        chunk_tokens=cfg.synthesize.chunk_tokens,
        overlap=cfg.synthesize.chunk_overlap,
    )
    index = build(chunks, tmp_path / "index", name="gptforge-docs", chunks_sha256="-")
    recs = records()
    E.rank_sources(recs, index, cfg.index.top_k, param="evaluate_qa.questions.gptforge-docs", path=QUESTIONS)
    hits = E.source_hits(recs)
    assert hits["retrieval.source_n"] == len(recs)
    assert hits["retrieval.source_hit"] >= 0.9, [r["instruction"] for r in recs if r["source_rank"] is None]


def test_evaluate_qa_depends_on_the_folder_of_question_files():
    """A dep cannot name `evaluate_qa.questions.NAME`'s value per foreach entry, so the stage
    depends on data/qa/, where the shipped set lies: editing a question file there reruns it."""
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["evaluate_qa"]["do"]
    assert "data/qa" in stage["deps"] and "evaluate_qa" in stage["params"]
    assert QUESTIONS.parent == REPO / E.QUESTIONS_DIR
    assert Path(REPO / "data/qa/README.md").is_file()
