"""`prepare pretrain`: exact GPT-2 ids, shard layout, manifest, and its bad inputs."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from cli_support import snapshot
from fixture_data import write_tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gptforge.data.pretrain as P
from gptforge import samples
from gptforge.config.load import load_config
from gptforge.data.pretrain_stage import prepare_pretrain
from gptforge.errors import BadInput
from gptforge.modeling.tokenizer import load_tokenizer


def config(source, tokenizer, **keys):
    overrides = [f"data.pretrain.source={source}", f"tokenizer.path={tokenizer}", "tracking.enabled=false"]
    overrides += [f"data.pretrain.{k}={v}" for k, v in keys.items()]
    return load_config(None, overrides)


def read_tokens(out: Path, split: str | None = None) -> np.ndarray:
    manifest = json.loads((out / "manifest.json").read_text())
    files = [s["file"] for s in manifest["shards"] if split in (None, s["split"])]
    return np.concatenate([np.load(out / f) for f in files]) if files else np.empty(0, np.uint16)


# ---------------------------------------------------------------------------------------------
# Cutting big documents never changes the ids

TEXT_ALPHABET = st.sampled_from(
    list("the and of is ing  \n\n\r\n\t.,!?'s'll 0123 éü中文 \u00a0\u3000xyzTHE") + ["'re", " the"]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(TEXT_ALPHABET, max_size=200), every=st.integers(1, 30))
def test_cut_points_keep_the_ids(small_tokenizer, pieces, every):
    enc = load_tokenizer(str(small_tokenizer))
    text = "".join(pieces)
    cuts = P.cut_points(text, every)
    bounds = [0, *cuts, len(text)]
    parts = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert "".join(parts) == text
    assert all(0 < c < len(text) for c in cuts) and cuts == sorted(set(cuts))
    assert sum((enc.encode_ordinary(p) for p in parts), []) == enc.encode_ordinary(text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(TEXT_ALPHABET, max_size=300), every=st.integers(1, 40))
def test_cut_points_keep_the_ids_of_real_gpt2(gpt2_tokenizer_dir, pieces, every):
    enc = load_tokenizer(str(gpt2_tokenizer_dir))
    text = "".join(pieces)
    bounds = [0, *P.cut_points(text, every), len(text)]
    assert sum((enc.encode_ordinary(text[a:b]) for a, b in zip(bounds, bounds[1:])), []) == enc.encode_ordinary(text)


def test_work_items_reassemble_the_documents():
    docs = ["short one", "a much longer document " * 50, "", "tail"]
    items = list(P.iter_work((iter([d[:100], d[100:]]) for d in docs), piece_chars=64))
    rebuilt: list[str] = []
    for item in items:
        for text, starts in item:
            if starts:
                rebuilt.append("")
            rebuilt[-1] += text
    assert rebuilt == [d for d in docs if d]  # an empty document is dropped
    assert len(items) > 3  # the long document was cut


# ---------------------------------------------------------------------------------------------
# The real corpus: exactly tiktoken's gpt2 ids


@pytest.mark.parametrize("workers", [1, 2])
def test_fineweb_edu_sample_gives_tiktokens_gpt2_ids(tmp_path, gpt2_tokenizer_dir, monkeypatch, workers):
    """The embedded FineWeb-Edu sample (1 MB of real English, with non-ASCII text) read through
    `sample://` as one gzip-compressed .txt document, cut into many pieces."""
    monkeypatch.setattr(P, "PIECE_CHARS", 40_000)  # force many cuts and several work items
    monkeypatch.setattr(P, "READ_CHARS", 100_000)
    cfg = config(
        "sample://fineweb_edu_sample.txt.gz",
        gpt2_tokenizer_dir,
        val_tokens=30_000,
        shard_tokens=100_000,
        workers=workers,
    )
    out = tmp_path / "data/pretrain"
    metrics = prepare_pretrain(cfg, out_dir=out, metrics_path=tmp_path / "m.json")
    ids = read_tokens(out)
    assert len(ids) == 217_889 == metrics["tokens"]
    assert ids[0] == 50256 and np.count_nonzero(ids == 50256) == 1
    # Independent reference: tiktoken's own gpt2 encoding rebuilt from the same BPE files.
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    ref_enc = tiktoken.Encoding(
        name="gpt2-ref",
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(gpt2_tokenizer_dir / "vocab.bpe"),
            encoder_json_file=str(gpt2_tokenizer_dir / "encoder.json"),
        ),
        special_tokens={"<|endoftext|>": 50256},
    )
    with gzip.open(samples.resolve("sample://fineweb_edu_sample.txt.gz"), "rt", encoding="utf-8") as f:
        text = f.read()
    assert len(text) == 1_000_000 and len(text.encode("utf-8")) == 1_004_029  # as NOTICE describes it
    ref = ref_enc.encode_ordinary(text)
    assert len(ref) == 217_888
    np.testing.assert_array_equal(ids[1:], np.array(ref, dtype=np.uint16))
    assert read_tokens(out, "val").size == 30_000


# ---------------------------------------------------------------------------------------------
# Shards and manifest


@pytest.fixture
def jsonl_corpus(tmp_path) -> Path:
    path = tmp_path / "docs.jsonl"
    docs = [{"text": f"Document {i}: the cat and the dog ran off in the rain.\n" * (1 + i % 4)} for i in range(60)]
    path.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    return path


def test_shards_manifest_and_metrics(tmp_path, jsonl_corpus, small_tokenizer):
    enc = load_tokenizer(str(small_tokenizer))
    cfg = config(jsonl_corpus, small_tokenizer, val_tokens=500, shard_tokens=1000, workers=2)
    out = tmp_path / "out"
    metrics = prepare_pretrain(cfg, out_dir=out, metrics_path=tmp_path / "metrics/prepare_pretrain.json")
    manifest = json.loads((out / "manifest.json").read_text())
    names = [s["file"] for s in manifest["shards"]]
    assert names[0] == "val_000000.npy" and names[1] == "train_000000.npy"
    assert sorted(p.name for p in out.glob("*.npy")) == sorted(names)

    expected = []
    for line in jsonl_corpus.read_text().splitlines():
        expected += [enc.eot_token, *enc.encode_ordinary(json.loads(line)["text"])]
    ids = read_tokens(out)
    np.testing.assert_array_equal(ids, np.array(expected, dtype=np.uint16))
    assert read_tokens(out, "val").size == 500
    for shard in manifest["shards"]:
        data = np.load(out / shard["file"])
        assert data.dtype == np.uint16 and data.size == shard["tokens"] <= 1000
        assert hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]
    assert manifest["tokens"] == {"val": 500, "train": len(expected) - 500}
    assert manifest["documents"]["val"] + manifest["documents"]["train"] == 60
    assert manifest["tokenizer"]["n_vocab"] == enc.n_vocab and manifest["dtype"] == "uint16"
    assert manifest["tokens_per_sec"] > 0 and not manifest["truncated_at_max_tokens"]
    saved = json.loads((tmp_path / "metrics/prepare_pretrain.json").read_text())
    assert saved == metrics and metrics["tokens"] == len(expected) and metrics["documents"] == 60


def test_max_tokens_stops_the_corpus(tmp_path, jsonl_corpus, small_tokenizer):
    cfg = config(jsonl_corpus, small_tokenizer, val_tokens=100, shard_tokens=300, max_tokens=1234, workers=1)
    prepare_pretrain(cfg, out_dir=tmp_path / "out", metrics_path=tmp_path / "m.json")
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert read_tokens(tmp_path / "out").size == 1234 and manifest["truncated_at_max_tokens"]


def test_folder_of_txt_and_parquet(tmp_path, small_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    enc = load_tokenizer(str(small_tokenizer))
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "b.txt").write_text("the second file\n")
    (folder / "a.txt").write_text("the first file\n")
    pq.write_table(pa.table({"text": ["in parquet one", "in parquet two"]}), folder / "c.parquet")
    (folder / "ignored.md").write_text("not a corpus file")
    cfg = config(folder, small_tokenizer, val_tokens=3, shard_tokens=100, workers=1)
    prepare_pretrain(cfg, out_dir=tmp_path / "out", metrics_path=tmp_path / "m.json")
    expected = []
    for text in ["the first file\n", "the second file\n", "in parquet one", "in parquet two"]:
        expected += [enc.eot_token, *enc.encode_ordinary(text)]
    np.testing.assert_array_equal(read_tokens(tmp_path / "out"), np.array(expected, dtype=np.uint16))


# ---------------------------------------------------------------------------------------------
# Bad inputs: one-line BadInput, and the previous output left as it was


@pytest.fixture
def previous_output(tmp_path) -> Path:
    out = tmp_path / "data/pretrain"
    out.mkdir(parents=True)
    (out / "manifest.json").write_text('{"old": true}')
    return out


def assert_fails(cfg, out: Path, match: str):
    before = snapshot(out)
    with pytest.raises(BadInput, match=match) as e:
        prepare_pretrain(cfg, out_dir=out, metrics_path=out.parent / "m.json")
    assert "\n" not in str(e.value)
    assert snapshot(out) == before
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".pretrain.")]  # no temp folder left


def test_empty_corpus(tmp_path, small_tokenizer, previous_output):
    (tmp_path / "empty.txt").write_text("")
    assert_fails(config(tmp_path / "empty.txt", small_tokenizer), previous_output, "empty corpus")


def test_no_training_tokens_left(tmp_path, small_tokenizer, previous_output):
    (tmp_path / "tiny.txt").write_text("the cat")
    assert_fails(config(tmp_path / "tiny.txt", small_tokenizer, val_tokens=1000), previous_output, "no training tokens")


def test_missing_local_file(tmp_path, small_tokenizer, previous_output):
    assert_fails(
        config(tmp_path / "nope.txt", small_tokenizer), previous_output, r"data.pretrain.source: local source not found"
    )


def test_jsonl_without_text_field(tmp_path, small_tokenizer, previous_output):
    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    assert_fails(config(tmp_path / "d.jsonl", small_tokenizer), previous_output, r"no 'text' field")


def test_unsupported_file_type(tmp_path, small_tokenizer, previous_output):
    (tmp_path / "d.csv").write_text("text\nx\n")
    assert_fails(config(tmp_path / "d.csv", small_tokenizer), previous_output, r"not a \.txt, \.jsonl or \.parquet")


def test_tokenizer_too_large_for_uint16(tmp_path, previous_output):
    big = write_tiktoken(tmp_path / "big.tiktoken", [f"tok{i:05d}".encode() for i in range(66_000)])
    (tmp_path / "a.txt").write_text("hello")
    assert_fails(config(tmp_path / "a.txt", big), previous_output, r"66257 tokens, more than uint16")


def test_tokenizer_folder_missing_files(tmp_path, previous_output):
    (tmp_path / "tok").mkdir()
    (tmp_path / "a.txt").write_text("hello")
    assert_fails(config(tmp_path / "a.txt", tmp_path / "tok"), previous_output, "missing encoder.json, vocab.bpe")


def test_non_utf8_text(tmp_path, small_tokenizer, previous_output):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 latin-1")
    assert_fails(config(tmp_path / "a.txt", small_tokenizer), previous_output, "not UTF-8")


# ---------------------------------------------------------------------------------------------
# Threads, one encode call per work item, the JSONL reader: still exactly the plain reference


def reference_ids(enc, texts) -> np.ndarray:
    """The plain reference: `<|endoftext|>` then `encode_ordinary` of each non-empty document."""
    ids: list[int] = []
    for text in texts:
        if text:
            ids += [enc.eot_token, *enc.encode_ordinary(text)]
    return np.array(ids, dtype=np.uint16)


def tricky_documents() -> list[str]:
    with gzip.open(samples.resolve("sample://fineweb_edu_sample.txt.gz"), "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    docs = ["\n".join(lines[i : i + 1 + i % 9]) for i in range(0, 600, 7)]  # real English, non-ASCII too
    docs[3:3] = [
        "",
        " ",
        "\n\n",
        "  leading and trailing spaces  ",
        "tab\tand\r\nCRLF\r\n",
        "a document that holds <|endoftext|> as plain text",
        "<|endoftext|>",
        "<|endoftext",
        "|>tail",
        "lone surrogate \ud800 from a JSON escape",
        "emoji \U0001f600 and 中文 text",
        "x" * 5000,
        "words " * 3000 + "end",  # one long document, cut into several work items
    ]
    return docs


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_jsonl_shards_equal_the_plain_reference(tmp_path, gpt2_tokenizer_dir, monkeypatch, workers):
    monkeypatch.setattr(P, "PIECE_CHARS", 3_000)  # many work items in flight, long documents cut
    monkeypatch.setattr(P, "READ_BYTES", 4_096)  # lines split across read blocks
    docs = tricky_documents()
    path = tmp_path / "docs.jsonl"
    with open(path, "w", encoding="utf-8", newline="") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"id": i, "text": text}) + ("\r\n" if i % 3 else "\n"))
    enc = load_tokenizer(str(gpt2_tokenizer_dir))
    expected = reference_ids(enc, [json.loads(line)["text"] for line in path.read_text().splitlines()])
    cfg = config(path, gpt2_tokenizer_dir, val_tokens=1_000, shard_tokens=7_000, workers=workers)
    out = tmp_path / "out"
    prepare_pretrain(cfg, out_dir=out, metrics_path=tmp_path / "m.json")
    np.testing.assert_array_equal(read_tokens(out), expected)
    manifest = json.loads((out / "manifest.json").read_text())
    assert sum(manifest["documents"].values()) == sum(1 for d in docs if d)
    assert [s["tokens"] for s in manifest["shards"]][:3] == [1_000, 7_000, 7_000]

    # max_tokens: exactly the reference's first tokens, with threads and items still in flight
    cfg = config(path, gpt2_tokenizer_dir, val_tokens=100, shard_tokens=1_000, max_tokens=4_321, workers=workers)
    prepare_pretrain(cfg, out_dir=out, metrics_path=tmp_path / "m.json")
    np.testing.assert_array_equal(read_tokens(out), expected[:4_321])
    assert json.loads((out / "manifest.json").read_text())["truncated_at_max_tokens"]


ITEM_TEXT = st.lists(
    st.sampled_from(
        ["the", " the", "<|endoftext|>", "<|", "endoftext", "|>", " ", "\n", "é", "s", "\ud800", "'ll", "12"]
    ),
    max_size=12,
).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=st.lists(ITEM_TEXT, max_size=8))
def test_encode_item_is_encode_ordinary_per_document(gpt2_tokenizer_dir, docs):
    enc = load_tokenizer(str(gpt2_tokenizer_dir))
    item = [(d, True) for d in docs if d]
    ids = P.encode_item(enc, item)
    assert ids.dtype == np.uint16
    np.testing.assert_array_equal(ids, reference_ids(enc, docs))


def old_jsonl_reader(path: Path, text_field: str = "text") -> list[str]:
    """What the reader did before it read bytes in blocks: text mode, one json.loads a line."""
    out = []
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line)[text_field])
    return out


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64, 1 << 20])
def test_jsonl_reader_splits_lines_as_text_mode_does(tmp_path, monkeypatch, block):
    monkeypatch.setattr(P, "READ_BYTES", block)
    raw = (
        '{"text": "a"}\r\n\r\n{"text": "b\\r\\nc"}\r{"text": "é"}\n \t\n\u3000\n'
        '{"text": "\\ud83d\\ude00 \\ud800", "n": 12345678901234567890123}\n{"text": "x", "text": "last"}\r\n'
        '{"text": "no newline at the end"}'
    )
    path = tmp_path / "d.jsonl"
    path.write_bytes(raw.encode("utf-8"))
    assert list(P._jsonl_texts(path, "text")) == old_jsonl_reader(path)


@pytest.mark.parametrize(
    "content, line, message",
    [
        (b'{"text": "a"}\r\n{"text": "b",}\n', 2, "Expecting property name enclosed in double quotes"),
        (b'{"text": "a"}\r{"text": "b"}\r{"text": }\r', 3, "Expecting value"),
        (b'\xef\xbb\xbf{"text": "a"}\n', 1, "Unexpected UTF-8 BOM (decode using utf-8-sig)"),
        (b'{"text": "a"}\n\n{"text": "a"} x\n', 3, "Extra data"),
    ],
)
def test_jsonl_errors_keep_their_messages(tmp_path, small_tokenizer, content, line, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(BadInput) as e:
        list(P._jsonl_texts(path, "text"))
    assert str(e.value) == f"{path}:{line}: not valid JSON ({message})"


def test_jsonl_not_utf8(tmp_path, small_tokenizer, previous_output):
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert_fails(config(tmp_path / "d.jsonl", small_tokenizer), previous_output, r"d.jsonl:2: not UTF-8 text")
