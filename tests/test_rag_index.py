"""The retrieval index (gptforge.rag: terms, index, quality, encoder, the `index` stage).

BM25 scores against the formula computed in float64; recall@5 of the source chunk on questions
made from the chunks' own sentences of gptforge's manual pages (the documents the synthesize
tests use), chunked by synthesize's own chunker; Chinese text by character bigrams; the dense
encoder against a mean-pool computed by hand and the hybrid ranking against reciprocal rank
fusion recomputed; the stage's outputs and metrics; and the bad inputs, one line each.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from pathlib import Path

import pytest
from cli_support import REPO, cli_env, error_lines, run_cli

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.rag import index as I
from gptforge.rag.quality import retrieval_quality
from gptforge.rag.terms import terms
from gptforge.synthesize.chunks import Chunk, chunk_documents, write_chunks
from gptforge.synthesize.documents import read_documents

# a document set needs its endpoint named (the synthesize stage's); the index never calls it
ENDPOINT = ["synthesize.endpoint.url=http://127.0.0.1:9/v1", "synthesize.endpoint.model=m"]


def chunk(i: int, text: str, source: str = "doc.md", headings=()) -> Chunk:
    return Chunk(
        id=f"{source}#{i}",
        source=source,
        headings=tuple(headings),
        start=0,
        end=len(text),
        text=text,
        tokens=len(text.split()),
    )


def manual_chunks(tmp_path: Path) -> list[Chunk]:
    from gptforge.modeling.tokenizer import load_tokenizer
    from gptforge.samples import resolve

    folder = tmp_path / "manual"
    folder.mkdir()
    for page in ("reliability.md", "serving.md"):
        (folder / page).write_text((REPO / "docs" / page).read_text(encoding="utf-8"), encoding="utf-8")
    enc = load_tokenizer(resolve("sample://gpt2_tokenizer"))
    cfg = load_config(None)
    return chunk_documents(
        read_documents(folder, param="docs"),
        count_tokens=lambda t: len(enc.encode_ordinary(t)),
        chunk_tokens=cfg.synthesize.chunk_tokens,
        overlap=cfg.synthesize.chunk_overlap,
    )


# ---------------------------------------------------------------------------------------------
# Terms and BM25


def test_terms_are_words_and_cjk_bigrams():
    assert terms("The Rivers of the WORLD, 2024!") == ["rivers", "world", "2024"]
    assert terms("自然语言处理") == ["自然", "然语", "语言", "言处", "处理"]
    assert terms("GPU上的训练 fast") == ["gpu", "上的", "的训", "训练", "fast"]
    assert terms("猫") == ["猫"] and terms("the a of") == []


def test_bm25_scores_are_the_formula_in_float64(tmp_path):
    texts = [
        "the nile is the longest river in africa",
        "the amazon river carries the most water",
        "rivers flow into the sea and the sea is salt",
        "a cat sat on the mat near the river bank",
        "deserts receive little rain",
    ]
    chunks = [chunk(i, t) for i, t in enumerate(texts)]
    idx = I.build(chunks, tmp_path / "i", name="t", chunks_sha256="x", k1=1.2, b=0.75)
    docs = [Counter(terms(t)) for t in texts]  # headings are empty: the indexed text is the chunk's
    avgdl = sum(sum(d.values()) for d in docs) / len(docs)

    def score(query: str, d: Counter) -> float:  # Lucene's BM25 (bm25s' default method)
        total = 0.0
        for q in terms(query):
            df = sum(1 for doc in docs if q in doc)
            if df == 0 or q not in d:
                continue
            idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
            tf = d[q]
            total += idf * tf / (tf + 1.2 * (1 - 0.75 + 0.75 * sum(d.values()) / avgdl))
        return total

    for query in ("longest river", "sea water", "river"):
        expected = sorted(((score(query, d), i) for i, d in enumerate(docs)), key=lambda x: (-x[0], x[1]))
        expected = [(i, s) for s, i in expected if s > 0]
        got = [(int(h.chunk.id.split("#")[1]), h.score) for h in idx.search(query, 5)]
        assert [i for i, _ in got] == [i for i, _ in expected][: len(got)] and len(got) == len(expected)
        for (_, s_got), (_, s_exp) in zip(got, expected):
            assert s_got == pytest.approx(s_exp, rel=1e-5)
    assert idx.search("zebra quantum", 5) == []  # no term in the index: no hits


def test_recall_at_5_on_questions_from_the_chunks_own_sentences(tmp_path):
    chunks = manual_chunks(tmp_path)
    assert len(chunks) >= 20
    idx = I.build(chunks, tmp_path / "i", name="manual", chunks_sha256="x")
    rng = random.Random(0)
    pairs = []
    for c in chunks:
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", c.text) if len(s.split()) >= 8]
        if sentences:
            pairs.append({"instruction": rng.choice(sentences), "chunk": c.id})
    quality = retrieval_quality(idx, pairs)
    assert quality["questions"] == len(pairs) >= 20
    assert quality["recall_at_5"] >= 0.8  # the bar; measured 1.0 on docs/ (229 chunks)
    assert quality["recall_at_1"] <= quality["recall_at_5"] <= quality["recall_at_10"]
    assert quality["recall_at_1"] <= quality["mrr"] <= quality["recall_at_10"]


def test_chinese_text_is_found_by_its_bigrams(tmp_path):
    texts = [
        "长江是中国最长的河流，全长约六千三百公里。",
        "黄河被称为中华民族的母亲河。",
        "珠穆朗玛峰是世界最高的山峰。",
    ]
    idx = I.build([chunk(i, t, "zh.md") for i, t in enumerate(texts)], tmp_path / "i", name="zh", chunks_sha256="x")
    assert idx.search("中国最长的河流是哪条？", 1)[0].chunk.text == texts[0]
    assert idx.search("世界最高的山", 1)[0].chunk.text == texts[2]


# ---------------------------------------------------------------------------------------------
# Dense and hybrid


@pytest.fixture(scope="module")
def encoder_folder(tmp_path_factory) -> Path:
    """A tiny random BERT with the GPT-2 tokenizer (vocabulary 50257): an encoder folder offline."""
    import torch
    from hf_models import make_tokenizer
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("encoder")
    torch.manual_seed(0)
    BertModel(
        BertConfig(
            vocab_size=50257,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
        )
    ).save_pretrained(str(folder))
    make_tokenizer(folder, chat_template=None)
    return folder


def test_dense_embeddings_are_the_masked_mean_and_hybrid_is_rank_fusion(tmp_path, encoder_folder):
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    texts = [
        "the nile is the longest river",
        "deserts receive little rain",
        "the sea is salt water",
        "mountains are cold at the top",
        "a river runs to the sea",
    ]
    chunks = [chunk(i, t) for i, t in enumerate(texts)]
    idx = I.build(chunks, tmp_path / "i", name="t", chunks_sha256="x", embedding_model=str(encoder_folder))
    assert idx.method == "hybrid" and idx.manifest["methods"] == ["bm25", "dense"]
    stored = np.load(tmp_path / "i" / "embeddings.npy")
    model, tok = (
        AutoModel.from_pretrained(str(encoder_folder)).eval(),
        AutoTokenizer.from_pretrained(str(encoder_folder)),
    )
    for i, t in enumerate(texts):  # one text at a time: no padding, the plain mean
        with torch.no_grad():
            h = model(**tok(t, return_tensors="pt")).last_hidden_state[0].double().mean(0)
        assert np.allclose(stored[i], (h / h.norm()).numpy(), atol=1e-5)
    query = "which river reaches the sea"
    bm25 = [h.chunk.id for h in I.build(chunks, tmp_path / "b", name="t", chunks_sha256="x").search(query, 5)]
    q = idx._encoder.encode([query])[0]
    dense = [chunks[i].id for i in np.argsort(-(stored @ q), kind="stable")]
    fused = Counter()
    for ranking in (bm25, dense):
        for rank, cid in enumerate(ranking, 1):
            fused[cid] += 1 / (60 + rank)
    expected = [cid for cid, _ in sorted(fused.items(), key=lambda kv: (-kv[1], int(kv[0].split("#")[1])))][:3]
    assert [h.chunk.id for h in idx.search(query, 3)] == expected


# ---------------------------------------------------------------------------------------------
# The stage and its bad inputs


def synthetic_set(root: Path, name: str, chunks: list[Chunk], pairs: list[dict]) -> Path:
    folder = root / "data" / "synthetic" / name
    folder.mkdir(parents=True)
    write_chunks(chunks, folder / "chunks.jsonl")
    (folder / "qa.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    return folder


def test_the_stage_writes_the_index_and_its_retrieval_metrics(tmp_path, monkeypatch):
    from gptforge.rag.stage import index as index_stage

    texts = {
        0: "The Nile flows north through Egypt.",
        1: "The Amazon carries more water than any river.",
        2: "Lake Baikal is the deepest lake on Earth.",
    }
    chunks = [chunk(i, t, "rivers.md", ("Rivers",)) for i, t in texts.items()]
    pairs = [
        {"instruction": "Which way does the Nile flow?", "input": "", "output": "North.", "chunk": "rivers.md#0"},
        {
            "instruction": "Which river carries the most water?",
            "input": "",
            "output": "The Amazon.",
            "chunk": "rivers.md#1",
        },
        {"instruction": "What is the deepest lake?", "input": "", "output": "Baikal.", "chunk": "rivers.md#2"},
    ]
    monkeypatch.chdir(tmp_path)
    synthetic_set(tmp_path, "rivers", chunks, pairs)
    (tmp_path / "data" / "instruct").mkdir(parents=True)
    (tmp_path / "data" / "instruct" / "test.jsonl").write_text(json.dumps(pairs[2]) + "\n")
    cfg = load_config(
        None,
        [
            "synthesize.documents={rivers: docs}",
            "synthesize.only=rivers",
            *ENDPOINT,
            "data.instruct.source=synthetic://rivers",
        ],
    )
    metrics = index_stage(cfg)
    written = json.loads((tmp_path / "metrics" / "index_rivers.json").read_text())
    assert written == metrics
    assert metrics["chunks"] == 3 and metrics["questions"] == 3
    assert metrics["recall_at_1"] == metrics["mrr"] == 1.0
    assert metrics["heldout_questions"] == 1 and metrics["heldout_recall_at_1"] == 1.0
    idx = I.Index.load(
        tmp_path / "data" / "index" / "rivers",
        name="rivers",
        chunks_sha256=I.file_sha256(tmp_path / "data/synthetic/rivers/chunks.jsonl"),
    )
    assert [c.text for c in idx.chunks] == list(texts.values())


def test_an_index_of_another_set_or_version_or_chunks_or_a_missing_one_is_one_line(tmp_path):
    I.build([chunk(0, "some text here")], tmp_path / "i", name="rivers", chunks_sha256="aaa")
    cases = [
        (lambda: I.Index.load(tmp_path / "i", name="lakes"), "indexes the document set 'rivers', not 'lakes'"),
        (lambda: I.Index.load(tmp_path / "i", name="rivers", chunks_sha256="bbb"), "built from other chunks"),
        (lambda: I.Index.load(tmp_path / "missing"), "is not a gptforge index"),
    ]
    manifest = json.loads((tmp_path / "i" / "index.json").read_text())
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "index.json").write_text(json.dumps({**manifest, "format": 0}))
    cases.append((lambda: I.Index.load(tmp_path / "old"), "built by another version of gptforge"))
    for load, fragment in cases:
        with pytest.raises(BadInput, match=re.escape(fragment)) as e:
            load()
        assert "\n" not in str(e.value)
    with pytest.raises(BadInput, match="not in the local Hugging Face cache") as e:
        I.build(
            [chunk(0, "x y z")], tmp_path / "d", name="d", chunks_sha256="x", embedding_model="nobody/no-such-encoder"
        )
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()  # nothing half-written


@pytest.mark.slow
def test_cli_index_without_synthesized_chunks_is_one_line_exit_2(tmp_path):
    env = cli_env(GPTFORGE_PREFECT="0")
    r = run_cli(
        [
            "index",
            "-S",
            "synthesize.documents={rivers: docs}",
            "-S",
            "tracking.enabled=false",
            *[a for kv in ENDPOINT for a in ("-S", kv)],
        ],
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2
    assert error_lines(r.stderr) == r.stderr.strip().splitlines()[-1:]
    assert "data/synthetic/rivers/chunks.jsonl not found: run `gptforge synthesize" in r.stderr


def test_prepare_base_fetches_an_encoder_that_the_index_embeds_with(tmp_path, encoder_folder):
    from gptforge.data.base_models import fetch

    got = fetch(str(encoder_folder), tmp_path / "checkpoints" / "base" / "enc", param="base.models.enc")
    assert got["encoder"] == 1 and got["has_tokenizer"] == 1
    texts = ["the nile is a river", "deserts are dry", "the sea is salt"]
    idx = I.build(
        [chunk(i, t) for i, t in enumerate(texts)],
        tmp_path / "i",
        name="t",
        chunks_sha256="x",
        embedding_model=str(tmp_path / "checkpoints" / "base" / "enc"),
    )
    assert idx.method == "hybrid" and idx.search("a river", 1)[0].chunk.text == texts[0]


def test_the_rag_prompt_keeps_whole_chunks_best_first_cuts_one_at_a_word_end_and_drops_the_rest():
    from gptforge.rag.index import Hit
    from gptforge.rag.prompt import augment, layout

    texts = ["alpha beta gamma", "one two three four five six seven eight nine ten", "last chunk words"]
    hits = [Hit(chunk(i, t, "f.md", ("H",)), 1.0 / (i + 1), i + 1) for i, t in enumerate(texts)]
    budget = len(layout("q?", [("f.md > H", texts[0]), ("f.md > H", "one two three four")]).split())
    fits = lambda text: len(text.split()) <= budget  # noqa: E731 - a word-count "tokenizer"
    got = augment("q?", hits, fits)
    assert got.text == layout("q?", [("f.md > H", texts[0]), ("f.md > H", "one two three four")])
    assert [s["included"] for s in got.sources] == ["whole", "cut", "dropped"]
    assert got.sources[1]["chars_included"] == len("one two three four")
    assert not fits(layout("q?", [("f.md > H", texts[0]), ("f.md > H", "one two three four five")]))  # maximal
    assert augment("q?", hits, lambda text: len(text.split()) <= 1).text == "q?"  # nothing fits: the question
