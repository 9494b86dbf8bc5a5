"""The QA accuracy table (stage evaluate_qa, gptforge.rag.evaluate_qa): a document set's held-out
questions answered by each model without and with retrieval, scored as the instruct stage scores.

The document set is a short Markdown page about rivers, cut by synthesize's own chunker and
indexed by the index library (BM25); each question's answer is a sentence of one chunk. The
models are tiny and random: gptforge's GPT (2 layers, 32 wide, 128 positions, so the retrieved
text must be cut to fit) and a Llama with a ChatML chat template (tests/hf_models.py, 256
positions). What the models received is recorded at the decoding functions they are called
through, and checked on its own: the RAG prompt holds the source chunk's text, the plain one
does not. The scores are recomputed with answer_quality from the written answers.

The user's own question file (evaluate_qa.questions.NAME) over a set synthesized without an
endpoint (chunks, no pairs): a reader stand-in at the decoding boundary makes every score known
in advance, retrieval's hit of the named source file is counted, and each bad file is one line.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from cli_support import cli_env, run_cli
from fixture_data import FakeRun
from test_synthesize import RIVERS

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.finetune.answer_quality import reference_scores
from gptforge.rag import evaluate_qa as E
from gptforge.rag.index import build, file_sha256
from gptforge.synthesize.chunks import chunk_documents, read_chunks, write_chunks
from gptforge.synthesize.documents import Document

TOKENIZER = "sample://gpt2_tokenizer"
# a document set needs its endpoint named (the synthesize stage's); evaluate_qa never calls it
ENDPOINT = ["synthesize.endpoint.url=http://127.0.0.1:9/v1", "synthesize.endpoint.model=m"]

DOC = RIVERS  # five English sections, one chunk each

# (a phrase of the source chunk, question, reference answer)
PAIRS = [
    ("Rhine rises", "Where does the Rhine rise?", "The Rhine rises in the Swiss Alps."),
    ("Danube starts", "Where does the Danube start?", "The Danube starts in the Black Forest of Germany."),
    ("Glaciers carve", "What do glaciers carve over thousands of years?", "Glaciers carve U-shaped valleys."),
    ("Salmon hatch", "Where do salmon return to spawn?", "Salmon return to their home river to spawn."),
    ("Beavers build", "What do beavers build dams from?", "Beavers build dams from branches and mud."),
]


def make_set(
    root: Path,
    name: str = "rivers",
    *,
    index_of: str | None = None,
    index: bool = True,
    documents: dict[str, str] | None = None,
    qa: bool = True,
) -> list[dict]:
    """data/synthetic/NAME/{chunks,qa}.jsonl under `root` (chunks alone without `qa`, as the
    synthesize stage writes them with no endpoint) of `documents` (file: text; the rivers page by
    default), and the index data/index/NAME/ (built for the set `index_of` when given). Returns
    the pairs."""
    from gptforge.modeling.tokenizer import load_tokenizer
    from gptforge.samples import resolve

    enc = load_tokenizer(resolve(TOKENIZER))
    docs = [
        Document(source=file, text=text, kind="markdown") for file, text in (documents or {"rivers.md": DOC}).items()
    ]
    chunks = chunk_documents(docs, count_tokens=lambda t: len(enc.encode_ordinary(t)), chunk_tokens=70, overlap=0)
    folder = root / "data" / "synthetic" / name
    folder.mkdir(parents=True)
    write_chunks(chunks, folder / "chunks.jsonl")
    pairs = []
    for phrase, question, answer in PAIRS:
        (c,) = [c for c in chunks if phrase in c.text]
        pairs.append(
            {
                "instruction": question,
                "input": "",
                "output": answer,
                "source": c.source,
                "chunk": c.id,
                "span": [c.start, c.end],
            }
        )
    if qa:
        (folder / "qa.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    if index:
        build(
            chunks,
            root / "data" / "index" / name,
            name=index_of or name,
            chunks_sha256=file_sha256(folder / "chunks.jsonl"),
        )
    return pairs


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    import torch
    from hf_models import make_tiny_causal_lm

    from gptforge.modeling.gpt import GPT, GPTConfig
    from gptforge.modeling.weights import save_model

    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=128, vocab_size=50304, n_vocab=50257))
    return {"gpt": save_model(gpt, root / "gpt"), "llama": make_tiny_causal_lm(root / "llama", "llama")}


def config(models: dict[str, Path], *extra: str, endpoint: bool = True):
    """Evaluating the rivers set with `models`; `endpoint` False: the set was synthesized without
    one (synthesize.endpoint null: chunks, no pairs)."""
    listed = ", ".join(f"{name}: {folder}" for name, folder in models.items())
    return load_config(
        None,
        [
            "synthesize.documents={rivers: docs}",
            *(ENDPOINT if endpoint else []),
            f"tokenizer.path={TOKENIZER}",
            f"evaluate.models={{{listed}}}",
            "evaluate_qa.max_new_tokens=8",
            "evaluate_qa.device=cpu",
            "index.top_k=2",
            "tracking.enabled=false",
            *extra,
        ],
    )


@pytest.fixture
def prompts(monkeypatch) -> dict[str, list[list[int]]]:
    """The prompt ids each kind of model was given, recorded where the instruct stage's decoding
    hands them to the model: `decoding.generate` (our GPT, one prompt at a time) and
    `hf_models.generate_rows` (a batch of left-padded prompts: each row without its padding)."""
    from gptforge.finetune import hf_models, instruct

    seen: dict[str, list[list[int]]] = {"gpt": [], "hf": []}

    def gpt(model, ids, *args, **kwargs):
        seen["gpt"].append(ids[0].tolist())
        return instruct_generate(model, ids, *args, **kwargs)

    def hf(model, ids, mask, *args, **kwargs):
        seen["hf"].extend(row[m.bool()].tolist() for row, m in zip(ids, mask))
        return rows_generate(model, ids, mask, *args, **kwargs)

    instruct_generate, rows_generate = instruct.generate, hf_models.generate_rows
    monkeypatch.setattr(instruct, "generate", gpt)
    monkeypatch.setattr(hf_models, "generate_rows", hf)
    return seen


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def decode(ids: list[int]) -> str:
    from gptforge.modeling.tokenizer import load_tokenizer
    from gptforge.samples import resolve

    return load_tokenizer(resolve(TOKENIZER)).decode(ids)


def test_both_modes_per_model_rag_prompts_hold_the_source_chunk_and_scores_are_answer_quality(
    tmp_path, monkeypatch, models, prompts
):
    monkeypatch.chdir(tmp_path)
    pairs = make_set(tmp_path)
    chunks = {c.id: c for c in read_chunks(tmp_path / "data/synthetic/rivers/chunks.jsonl")}
    run = FakeRun()
    # chat: the Llama's own template; our GPT has none and is prompted with alpaca
    metrics = E.evaluate_qa(config(models, "instruct.template=chat"), run=run)

    rows = jsonl(tmp_path / "reports/evaluate_qa_rivers.jsonl")
    assert [(r["model"], r["question"]) for r in rows] == [(m, p["instruction"]) for m in models for p in pairs]
    for r in rows:
        assert set(r) >= {"model", "question", "reference", "answer", "answer_rag", "sources"}
        assert isinstance(r["answer"], str) and isinstance(r["answer_rag"], str)
        assert [s["rank"] for s in r["sources"]] == [1, 2]

    # what the models received: the question alone, then the question after the retrieved text
    n = len(pairs)
    assert len(prompts["gpt"]) == len(prompts["hf"]) == 2 * n
    for kind, positions in (("gpt", 128), ("hf", 256)):
        # a Hugging Face model answers in batches of prompts of similar lengths: matched by question
        texts = {decode(ids): len(ids) for ids in prompts[kind]}
        plains = [t for t in texts if "Context:" not in t]
        for pair in pairs:
            source = chunks[pair["chunk"]].text
            (plain,) = [t for t in plains if pair["instruction"] in t]
            (rag,) = [t for t in texts if "Context:" in t and f"Question: {pair['instruction']}" in t]
            assert source[:30] not in plain
            assert texts[rag] + 8 <= positions  # prompt, chunks and max_new_tokens fit
            if kind == "hf":
                assert source in rag  # 256 positions: the source chunk whole
            else:
                assert source[:80] in rag  # 128 positions: its beginning (the rest is cut)
        if kind == "hf":
            assert all(t.startswith("<|im_start|>user\n") for t in texts)  # the chat template
        else:
            assert all(t.startswith("Below is an instruction that describes a task.") for t in texts)  # alpaca
    gpt_sources = [s for r in rows if r["model"] == "gpt" for s in r["sources"]]
    assert any(s["included"] == "cut" for s in gpt_sources)

    written = json.loads((tmp_path / "metrics/evaluate_qa_rivers.json").read_text())
    assert written == metrics and run.metrics == [metrics]
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        for mode, key in (("qa", "answer"), ("qa_rag", "answer_rag")):
            expected = reference_scores([{"response": r[key], "reference": r["reference"]} for r in mine])
            for metric in ("exact_match", "token_f1", "rouge_l"):
                assert metrics[f"{model}.{mode}.{metric}"] == pytest.approx(expected[metric])
            assert metrics[f"{model}.{mode}.n"] == n
        assert metrics[f"{model}.too_long"] == 0
    table = (tmp_path / "reports/evaluate_qa_rivers.md").read_text()
    for model in models:
        for mode in ("qa", "qa_rag"):
            (line,) = [line for line in table.splitlines() if line.startswith(f"| {model} | {mode} |")]
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert cells[2:] == [
                f"{metrics[f'{model}.{mode}.{k}']:.3f}" for k in ("exact_match", "token_f1", "rouge_l")
            ] + [str(n)]
    assert "judge_score" not in table
    assert {p.name for p in run.artifacts} == {
        "evaluate_qa_rivers.jsonl",
        "evaluate_qa_rivers.md",
        "evaluate_qa_rivers.json",
    }


def tokenizer_of(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def reader(tokenizer):
    """A stand-in for a model that reads, put in place of `hf_models.generate_rows` (a batch of
    left-padded prompts): each row answers with the first sentence of its context's top chunk,
    and "I do not know." without context; rows are padded after their end of text."""
    import torch

    def generate_rows(model, ids, mask, max_new_tokens, *, stops, pad_id):
        answers = []
        for row, m in zip(ids, mask):
            prompt = tokenizer.decode(row[m.bool()].tolist())
            found = re.search(r"\[1\] [^\n]*\n(.*?)(?:\n\n\[2\]|\n\nQuestion:)", prompt, re.S)
            if found:
                body = " ".join(line for line in found.group(1).splitlines() if line and not line.startswith("#"))
                answer = body.split(". ")[0] + "."
            else:
                answer = "I do not know."
            answers.append(tokenizer.encode(answer, add_special_tokens=False)[: max_new_tokens - 1] + [stops[0]])
        width = max(len(a) for a in answers)
        return torch.tensor([a + [pad_id] * (width - len(a)) for a in answers], dtype=ids.dtype)

    return generate_rows


def test_scores_follow_the_answers_of_a_reader_that_needs_the_context(tmp_path, monkeypatch, models):
    """The reader stand-in at the decoding boundary: the table separates the modes, and every
    score is answer_quality's over the written answers."""
    from gptforge.finetune import hf_models

    monkeypatch.setattr(hf_models, "generate_rows", reader(tokenizer_of(models["llama"])))
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path)
    metrics = E.evaluate_qa(config({"llama": models["llama"]}, "evaluate_qa.max_new_tokens=64"))
    rows = jsonl(tmp_path / "reports/evaluate_qa_rivers.jsonl")
    assert {r["answer"] for r in rows} == {"I do not know."}
    assert rows[0]["answer_rag"] == (
        "The Rhine rises in the Swiss Alps and flows north through Basel, Strasbourg "
        "and Cologne before it reaches the North Sea in the Netherlands."
    )
    for mode, key in (("qa", "answer"), ("qa_rag", "answer_rag")):
        expected = reference_scores([{"response": r[key], "reference": r["reference"]} for r in rows])
        for metric in ("exact_match", "token_f1", "rouge_l"):
            assert metrics[f"llama.{mode}.{metric}"] == pytest.approx(expected[metric])
    assert metrics["llama.qa.token_f1"] == 0.0 < 0.4 < metrics["llama.qa_rag.token_f1"]
    table = (tmp_path / "reports/evaluate_qa_rivers.md").read_text()
    assert f"| llama | qa_rag | 0.000 | {metrics['llama.qa_rag.token_f1']:.3f} | " in table


def test_held_out_split_limit_too_long_prompt_and_judge(tmp_path, monkeypatch, models, prompts, fake_judge):
    """data.instruct.source synthetic://rivers: the questions are the instruct test split's, the
    first `limit` of them; a question longer than the model's positions is answered empty; the
    judge scores both modes."""
    monkeypatch.chdir(tmp_path)
    pairs = make_set(tmp_path)
    long_question = {
        "instruction": "Why? " + "Tell me about rivers and their long journeys. " * 20,
        "input": "",
        "output": "Because.",
    }
    held_out = [pairs[3], long_question, pairs[0]]
    (tmp_path / "data/instruct").mkdir(parents=True)
    (tmp_path / "data/instruct/test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    cfg = config(
        {"gpt": models["gpt"]},
        "data.instruct.source=synthetic://rivers",
        "evaluate_qa.limit=2",
        f"instruct.judge.url={fake_judge.url}",
        "instruct.judge.model=judge",
    )
    metrics = E.evaluate_qa(cfg)
    rows = jsonl(tmp_path / "reports/evaluate_qa_rivers.jsonl")
    assert [r["question"] for r in rows] == [pairs[3]["instruction"], long_question["instruction"]]
    assert rows[1]["too_long"] is True and rows[1]["answer"] == rows[1]["answer_rag"] == ""
    assert len(prompts["gpt"]) == 2  # the long one never reached the model
    assert metrics["gpt.too_long"] == 1 and metrics["gpt.qa.n"] == metrics["gpt.qa_rag.n"] == 2
    assert metrics["gpt.qa.judge_score"] == metrics["gpt.qa_rag.judge_score"] == 12.0  # FakeJudge: "Score: 12"
    assert len(fake_judge.requests) == 4
    assert "| judge_score |" in (tmp_path / "reports/evaluate_qa_rivers.md").read_text()


@pytest.mark.parametrize("case", ["no index", "index of another set", "no qa", "no held-out split"])
def test_bad_inputs_are_one_line_before_any_model_loads(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    extra = []
    if case == "no index":
        make_set(tmp_path, index=False)
        expected = "data/index/rivers is not a gptforge index"
    elif case == "index of another set":
        make_set(tmp_path, index_of="lakes")
        expected = "indexes the document set 'lakes', not 'rivers'"
    elif case == "no qa":
        make_set(tmp_path)
        (tmp_path / "data/synthetic/rivers/qa.jsonl").unlink()
        expected = "data/synthetic/rivers/qa.jsonl not found: run `gptforge synthesize -S synthesize.only=rivers`"
    else:
        make_set(tmp_path)
        extra = ["data.instruct.source=synthetic://rivers"]
        expected = "data/instruct/test.jsonl not found"
    cfg = config({"nowhere": tmp_path / "no-model"}, *extra)  # no model exists: checked after the set
    with pytest.raises(BadInput, match=re.escape(expected)) as e:
        E.evaluate_qa(cfg)
    assert "\n" not in str(e.value) and str(e.value).startswith("evaluate_qa rivers: ")
    assert not (tmp_path / "reports").exists() and not (tmp_path / "metrics").exists()


@pytest.mark.slow
def test_cli_evaluate_qa_writes_the_table(tmp_path, models):
    work = tmp_path / "work"
    work.mkdir()
    make_set(work)
    shutil.copytree(models["gpt"], work / "checkpoints" / "pretrain" / "final")
    (work / "params.yaml").write_text(
        yaml.safe_dump(
            {
                "tokenizer": {"path": TOKENIZER},
                "synthesize": {
                    "documents": {"rivers": "docs"},
                    "endpoint": {"url": "http://127.0.0.1:9/v1", "model": "m"},
                },
                "evaluate": {
                    "models": {"pretrain": "checkpoints/pretrain/final", "instruct": "checkpoints/instruct/final"}
                },
                "evaluate_qa": {"max_new_tokens": 8, "device": "cpu"},
                "tracking": {"enabled": False},
            }
        )
    )
    out = run_cli(["evaluate-qa", "-S", "synthesize.only=rivers"], work, cli_env(GPTFORGE_PREFECT="0"), timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = jsonl(work / "reports/evaluate_qa_rivers.jsonl")
    assert [r["model"] for r in rows] == ["pretrain"] * len(PAIRS)  # instruct: no folder, skipped
    metrics = json.loads((work / "metrics/evaluate_qa_rivers.json").read_text())
    assert {
        f"pretrain.{mode}.{k}" for mode in ("qa", "qa_rag") for k in ("exact_match", "token_f1", "rouge_l", "n")
    } <= set(metrics)
    table = (work / "reports/evaluate_qa_rivers.md").read_text()
    assert "| pretrain | qa |" in table and "| pretrain | qa_rag |" in table


# ---------------------------------------------------------------------------------------------
# The user's own questions (evaluate_qa.questions.NAME) over a set synthesized without an endpoint

LAKES = """# Lakes

Lake Baikal in Siberia is the deepest lake on Earth, about 1,642 metres deep, and holds a fifth of
the fresh water in the world's lakes.
"""
# question, reference, source file (None: not given). The beavers question names the wrong file,
# as a user may: retrieval cannot find it there.
OWN = [
    (
        "Where does the Rhine rise?",
        "The Rhine rises in the Swiss Alps and flows north through Basel, Strasbourg "
        "and Cologne before it reaches the North Sea in the Netherlands.",
        "rivers.md",
    ),
    ("What do beavers build dams from?", "Beavers build dams from branches and mud", "lakes.md"),
    ("How deep is Lake Baikal?", "about 1,642 metres deep", "lakes.md"),
    ("Where do salmon return to spawn?", "their home river", None),
]


def write_questions(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"question": q, "answer": a, **({"source": s} if s else {})}) + "\n" for q, a, s in rows),
        encoding="utf-8",
    )
    return path


def test_own_question_file_over_chunks_alone_scores_by_the_formulas(tmp_path, monkeypatch, models):
    """No endpoint, so no pairs: the set is its chunks and its index, and the questions are the
    user's file. The reader stand-in answers each question with the first sentence of the top
    chunk, so every score is known: exact match, SQuAD token F1 = 2c/(p+g) over normalized tokens
    (c shared, p answer, g reference), ROUGE-L F = 2 LCS/(p+g) over rouge-score's tokens (articles
    kept, "1,642" two tokens); without context, "I do not know." shares nothing with a reference.
    Retrieval finds the named file for 2 of the 3 questions that name one."""
    from gptforge.finetune import hf_models

    monkeypatch.setattr(hf_models, "generate_rows", reader(tokenizer_of(models["llama"])))
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path, documents={"rivers.md": DOC, "lakes.md": LAKES}, qa=False)
    write_questions(tmp_path / "data/qa/rivers.jsonl", OWN)
    cfg = config(
        {"llama": models["llama"]},
        "evaluate_qa.max_new_tokens=64",
        "evaluate_qa.questions={rivers: data/qa/rivers.jsonl}",
        endpoint=False,
    )
    metrics = E.evaluate_qa(cfg)

    rows = jsonl(tmp_path / "reports/evaluate_qa_rivers.jsonl")
    assert [(r["model"], r["question"], r["reference"]) for r in rows] == [("llama", q, a) for q, a, _ in OWN]
    assert {r["answer"] for r in rows} == {"I do not know."}
    assert [r["answer_rag"] for r in rows] == [
        OWN[0][1],
        "Beavers build dams from branches and mud, which turns streams into ponds that shelter their lodges from "
        "wolves and other predators during the winter..",  # one sentence, so the reader adds its own period
        "Lake Baikal in Siberia is the deepest lake on Earth, about 1,642 metres deep, and holds a fifth of the "
        "fresh water in the world's lakes..",
        "Salmon hatch in fresh water, migrate to the ocean to feed for several years, and return to their home river "
        "to spawn, often leaping up waterfalls on the way..",
    ]
    assert [(r.get("source"), r.get("source_rank")) for r in rows] == [
        ("rivers.md", 1),
        ("lakes.md", None),
        ("lakes.md", 1),
        (None, None),
    ]
    assert "source" not in rows[3] and all(r["sources"][0]["file"] in ("rivers.md", "lakes.md") for r in rows)

    # (exact match, token F1, ROUGE-L) of each answer_rag, counted by hand
    expected = [
        (1.0, 1.0, 1.0),
        (0.0, 2 * 7 / (23 + 7), 2 * 7 / (24 + 7)),  # the reference is the answer's first 7 words
        (0.0, 2 * 4 / (22 + 4), 2 * 5 / (28 + 5)),  # "about 1642 metres deep" among 22 (rouge: 28, 5)
        (0.0, 2 * 3 / (27 + 3), 2 * 3 / (29 + 3)),
    ]  # "their home river" among 27 (rouge: 29)
    for i, metric in enumerate(("exact_match", "token_f1", "rouge_l")):
        assert metrics[f"llama.qa_rag.{metric}"] == pytest.approx(sum(e[i] for e in expected) / 4)
        assert metrics[f"llama.qa.{metric}"] == 0.0
    assert metrics["llama.qa.n"] == metrics["llama.qa_rag.n"] == 4
    assert metrics["retrieval.source_hit"] == pytest.approx(2 / 3) and metrics["retrieval.source_n"] == 3
    assert json.loads((tmp_path / "metrics/evaluate_qa_rivers.json").read_text()) == metrics
    table = (tmp_path / "reports/evaluate_qa_rivers.md").read_text()
    assert "4 questions from `data/qa/rivers.jsonl`" in table
    assert f"| llama | qa_rag | 0.250 | {metrics['llama.qa_rag.token_f1']:.3f} | " in table
    assert "source file among the 2 chunks retrieved for 2 of 3 questions that name one (source_hit 0.667)" in table


@pytest.mark.parametrize(
    "case",
    [
        "missing file",
        "empty file",
        "bad JSON",
        "no answer",
        "blank question",
        "not an object",
        "unknown source",
        "unknown set",
        "chunks only, no questions",
    ],
)
def test_bad_question_files_are_one_line_before_any_model_loads(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    make_set(tmp_path, qa=False)
    path = tmp_path / "data/qa/rivers.jsonl"
    good = json.dumps({"question": "Where does the Rhine rise?", "answer": "In the Swiss Alps."})
    lines, name = (
        {
            "missing file": None,
            "empty file": "\n\n",
            "bad JSON": f'{good}\n{{"question": "x?", \n',
            "no answer": f'{good}\n{good}\n{{"question": "Where do salmon spawn?"}}\n',
            "blank question": '{"question": " ", "answer": "No."}\n',
            "not an object": '["q?", "a"]\n',
            "unknown source": '{"question": "Where is the Nile?", "answer": "Egypt.", "source": "nile.md"}\n',
            "unknown set": good,
            "chunks only, no questions": None,
        }[case],
        "rivers",
    )
    if lines is not None:
        path.parent.mkdir(parents=True)
        path.write_text(lines, encoding="utf-8")
    if case == "unknown set":
        name = "lakes"
    expected = {
        "missing file": f"evaluate_qa.questions.rivers: {Path('data/qa/rivers.jsonl')} not found",
        "empty file": 'data/qa/rivers.jsonl holds no question: each line is {"question"',
        "bad JSON": "data/qa/rivers.jsonl:2 is not a JSON line",
        "no answer": "data/qa/rivers.jsonl:3 has no 'answer' (a non-empty string)",
        "blank question": "data/qa/rivers.jsonl:1 has no 'question'",
        "not an object": "data/qa/rivers.jsonl:1 is not a JSON object",
        "unknown source": "data/qa/rivers.jsonl:1: source 'nile.md' is no file of the document set (its "
        "files, relative to its folder: rivers.md)",
        "unknown set": "evaluate_qa.questions.lakes names no entry of synthesize.documents (entries: rivers)",
        "chunks only, no questions": "evaluate_qa rivers: data/synthetic/rivers holds chunks only, no "
        "questions (synthesize.endpoint.url is null): set "
        "evaluate_qa.questions.rivers to your question file",
    }[case]
    extra = [] if case == "chunks only, no questions" else [f"evaluate_qa.questions={{{name}: data/qa/rivers.jsonl}}"]
    cfg = config({"nowhere": tmp_path / "no-model"}, *extra, endpoint=False)  # no model exists: checked after
    with pytest.raises(BadInput, match=re.escape(expected)) as e:
        E.evaluate_qa(cfg)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "reports").exists() and not (tmp_path / "metrics").exists()


@pytest.mark.slow
def test_cli_offline_chain_chunks_index_and_own_questions(tmp_path, models):
    """No endpoint, as a machine without a teacher runs it: `gptforge synthesize` writes the
    chunks alone, `gptforge index` indexes them, `gptforge evaluate-qa` asks the user's questions
    (data/qa/) without and with retrieval."""
    work = tmp_path / "work"
    (work / "docs").mkdir(parents=True)
    (work / "docs" / "rivers.md").write_text(DOC, encoding="utf-8")
    (work / "docs" / "lakes.md").write_text(LAKES, encoding="utf-8")
    write_questions(work / "data/qa/rivers.jsonl", OWN)
    shutil.copytree(models["gpt"], work / "checkpoints" / "pretrain" / "final")
    (work / "params.yaml").write_text(
        yaml.safe_dump(
            {
                "tokenizer": {"path": TOKENIZER},
                "synthesize": {"documents": {"rivers": "docs"}, "chunk_tokens": 70, "chunk_overlap": 0},
                "evaluate": {"models": {"pretrain": "checkpoints/pretrain/final"}},
                "evaluate_qa": {"questions": {"rivers": "data/qa/rivers.jsonl"}, "max_new_tokens": 8, "device": "cpu"},
                "index": {"top_k": 2},
                "tracking": {"enabled": False},
            }
        )
    )
    env = cli_env(GPTFORGE_PREFECT="0")
    for command in ("synthesize", "index", "evaluate-qa"):
        out = run_cli([command, "-S", "synthesize.only=rivers"], work, env, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in (work / "data/synthetic/rivers").iterdir()) == ["chunks.jsonl"]
    assert json.loads((work / "metrics/index_rivers.json").read_text())["questions"] == 0
    rows = jsonl(work / "reports/evaluate_qa_rivers.jsonl")
    assert [(r["question"], r.get("source_rank")) for r in rows] == [
        (q, rank) for (q, _, _), rank in zip(OWN, (1, None, 1, None))
    ]
    metrics = json.loads((work / "metrics/evaluate_qa_rivers.json").read_text())
    assert metrics["pretrain.qa.n"] == metrics["pretrain.qa_rag.n"] == 4
    assert metrics["retrieval.source_hit"] == pytest.approx(2 / 3)
