"""synthesize: documents read from a folder or a file, cut into chunks with spans and heading paths.

Checks are independent of the code under test: spans are sliced from the document, token
counts re-encoded with the GPT-2 tokenizer, overlaps read off the spans, heading paths written
by hand for a hand-written Markdown text.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import gptforge.samples
from gptforge.errors import BadInput
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.synthesize.chunks import (
    Chunk,
    HeadingIndex,
    chunk_document,
    chunk_documents,
    heading_path,
    read_chunks,
    write_chunks,
)
from gptforge.synthesize.documents import Document, read_documents

REPO = Path(__file__).resolve().parents[1]
PARAM = "synthesize.documents"


@pytest.fixture(scope="module")
def count_tokens():
    enc = load_tokenizer(str(gptforge.samples.resolve("sample://gpt2_tokenizer")))
    return lambda s: len(enc.encode_ordinary(s))


def check_chunks(doc: Document, chunks: list[Chunk], count_tokens, chunk_tokens: int) -> None:
    """Spans round-trip, limits hold by re-encoding, ids number the chunks, order follows the text."""
    assert chunks
    for i, c in enumerate(chunks):
        assert c.id == f"{doc.source}#{i}" and c.source == doc.source
        assert doc.text[c.start : c.end] == c.text
        assert c.text and c.text == c.text.strip()
        assert c.tokens == count_tokens(c.text) <= chunk_tokens
    assert [c.start for c in chunks] == sorted(c.start for c in chunks)
    # nothing but whitespace is left out between chunks
    covered = 0
    for c in chunks:
        assert not doc.text[covered : c.start].strip()
        covered = max(covered, c.end)
    assert not doc.text[covered:].strip()


def one_line(e: pytest.ExceptionInfo, start: str = PARAM) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(start + ":"), msg
    return msg


def make_pdf(text: bytes) -> bytes:
    """A one-page PDF, written by hand: Helvetica, one text stream, a correct xref table."""
    stream = b"BT /F1 12 Tf 72 720 Td (" + text + b") Tj ET" if text else b""
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
        b"/Resources << /Font << /F1 4 0 R >> >> /Contents 5 0 R >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


MARKDOWN = """\
Intro text before any heading.

# Install

Alpha words about installing.

## From source

```bash
# not a heading
make install
```

Beta words after the fence.

### Deep ###

Gamma deep text.

## From wheel

Delta wheel text.

~~~
## also not a heading
~~~

# Usage

    # indented four spaces: code, not a heading

#hashtag is not a heading either.

Epsilon usage text.
"""


# ---------------------------------------------------------------- heading paths


def test_heading_index_paths_by_hand():
    index = HeadingIndex(MARKDOWN)
    at = lambda s: index.path(MARKDOWN.index(s))  # noqa: E731
    assert at("Intro text") == ()
    assert at("Alpha") == ("Install",)
    assert at("# not a heading") == ("Install", "From source")
    assert at("Beta") == ("Install", "From source")
    assert at("Gamma") == ("Install", "From source", "Deep")  # closing hashes dropped
    assert at("Delta") == ("Install", "From wheel")  # a level-2 heading closes the level-3 one
    assert at("## also not a heading") == ("Install", "From wheel")
    assert at("Epsilon") == ("Usage",)
    assert at("#hashtag") == ("Usage",)
    assert [MARKDOWN[s:e] for s, e in zip(index.starts, index.ends)] == [
        "# Install",
        "## From source",
        "### Deep ###",
        "## From wheel",
        "# Usage",
    ]
    assert heading_path(MARKDOWN, MARKDOWN.index("Gamma")) == ("Install", "From source", "Deep")


def test_a_span_that_starts_with_headings_takes_them():
    index = HeadingIndex(MARKDOWN)
    # starting at a heading line, or at the whitespace before it
    assert index.path(MARKDOWN.index("# Usage")) == ("Usage",)
    assert index.path(MARKDOWN.index("Delta") - len("\n\n## From wheel\n\n")) == ("Install", "From wheel")
    # headings before any other text: all of them, at their levels
    text = "Before.\n\n# A\n\n## B\n\n### C\n\nBody.\n\n## D\n\nMore.\n"
    index = HeadingIndex(text)
    assert index.path(text.index("# A")) == ("A", "B", "C")
    assert index.path(text.index("# A"), text.index("## B")) == ("A",)  # a span of the heading alone
    assert index.path(text.index("Body")) == ("A", "B", "C")
    assert index.path(text.index("Body"), text.index("More")) == ("A", "B", "C")  # its start decides
    assert index.path(text.index("More")) == ("A", "D")
    # an unclosed fence runs to the end of the text
    text = "# A\n\n```\n# no\n\nstill code\n"
    assert HeadingIndex(text).path(text.index("still")) == ("A",)
    assert HeadingIndex(text).starts == [0]


def test_markdown_chunks_carry_their_heading_path(count_tokens):
    doc = Document("guide.md", MARKDOWN, "markdown")
    chunks = chunk_document(doc, count_tokens=count_tokens, chunk_tokens=16, overlap=0)
    check_chunks(doc, chunks, count_tokens, 16)
    expected = {
        "Intro": (),
        "Alpha": ("Install",),
        "Beta": ("Install", "From source"),
        "Gamma": ("Install", "From source", "Deep"),
        "Delta": ("Install", "From wheel"),
        "Epsilon": ("Usage",),
    }
    for word, path in expected.items():
        (chunk,) = [c for c in chunks if word in c.text]
        assert chunk.headings == path, (word, chunk)
    (fenced,) = [c for c in chunks if "# not a heading" in c.text]
    assert fenced.headings == ("Install", "From source")
    # a chunk that starts with a heading is under it, even when it is the heading alone
    by_text = {c.text: c.headings for c in chunks}
    assert by_text["# Usage"] == ("Usage",)
    assert by_text["## From source"] == ("Install", "From source")
    # an indented code line the splitter trimmed to "# ..." is still not a heading
    (code,) = [c for c in chunks if "indented four spaces" in c.text]
    assert code.text.startswith("# indented") and code.headings == ("Usage",)


def test_text_and_pdf_documents_have_no_heading_path(count_tokens):
    doc = Document("notes.txt", "# not markdown here\n\nplain words " * 20, "text")
    chunks = chunk_document(doc, count_tokens=count_tokens, chunk_tokens=20, overlap=0)
    check_chunks(doc, chunks, count_tokens, 20)
    assert all(c.headings == () for c in chunks)


# ---------------------------------------------------------------- spans, limits, overlap


def test_the_projects_docs_chunk_within_limits(count_tokens):
    docs = read_documents(REPO / "docs", param=PARAM)
    assert all(d.kind == "markdown" for d in docs) and len(docs) >= 10
    chunks = chunk_documents(docs, count_tokens=count_tokens, chunk_tokens=512, overlap=64)
    for doc in docs:
        mine = [c for c in chunks if c.source == doc.source]
        check_chunks(doc, mine, count_tokens, 512)
        for a, b in zip(mine, mine[1:]):
            if b.start < a.end:  # what two chunks share is at most `overlap` tokens
                assert count_tokens(doc.text[b.start : a.end]) <= 64
    assert [c.source for c in chunks] == sorted(c.source for c in chunks)


def test_consecutive_chunks_overlap_by_whole_sentences(count_tokens):
    text = " ".join(f"Sentence number {i} is short." for i in range(80))
    doc = Document("s.txt", text, "text")
    chunks = chunk_document(doc, count_tokens=count_tokens, chunk_tokens=40, overlap=15)
    check_chunks(doc, chunks, count_tokens, 40)
    assert len(chunks) > 5
    for a, b in zip(chunks, chunks[1:]):
        assert a.start < b.start < a.end < b.end
        shared = text[b.start : a.end].strip()
        assert a.text.endswith(shared) and b.text.startswith(shared)
        assert shared.startswith("Sentence number") and shared.endswith("is short.")
        assert count_tokens(shared) <= 15
    no_overlap = chunk_document(doc, count_tokens=count_tokens, chunk_tokens=40, overlap=0)
    check_chunks(doc, no_overlap, count_tokens, 40)
    assert all(b.start >= a.end for a, b in zip(no_overlap, no_overlap[1:]))
    assert len(no_overlap) < len(chunks)


def test_overlap_is_a_maximum_units_longer_than_it_are_not_repeated(count_tokens):
    # Paragraphs of ~30 tokens, one sentence each: none fits in an overlap of 10 tokens, so the
    # splitter repeats nothing and consecutive chunks only touch (the behaviour this records).
    para = "This paragraph is one long sentence that goes on and on with many words in it"
    text = "\n\n".join(f"{para} number {i}." for i in range(12))
    doc = Document("p.md", text, "markdown")
    chunks = chunk_document(doc, count_tokens=count_tokens, chunk_tokens=64, overlap=10)
    check_chunks(doc, chunks, count_tokens, 64)
    assert len(chunks) > 3
    assert all(b.start >= a.end for a, b in zip(chunks, chunks[1:]))


def test_chinese_spans_are_character_offsets(count_tokens):
    text = "".join(f"第{i}句讲中文切分。" for i in range(60))  # 17 tokens a sentence
    doc = Document("zh.txt", text, "text")
    chunks = chunk_document(doc, count_tokens=count_tokens, chunk_tokens=50, overlap=20)
    check_chunks(doc, chunks, count_tokens, 50)
    assert len(chunks) > 3
    later = chunks[-1]
    assert len(text[: later.start].encode("utf-8")) > later.start  # bytes would be different offsets
    for a, b in zip(chunks, chunks[1:]):  # one sentence shared, sliced from character offsets
        assert a.start < b.start < a.end and text[b.start : a.end].endswith("句讲中文切分。")


def test_a_character_longer_than_the_limit_is_kept_with_a_warning(count_tokens, caplog):
    doc = Document("e.txt", "a 😀 b", "text")
    assert count_tokens("😀") > 1
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        chunks = chunk_document(doc, count_tokens=count_tokens, chunk_tokens=1, overlap=0)
    assert [c.text for c in chunks] == ["a", "😀", "b"]
    assert [doc.text[c.start : c.end] for c in chunks] == ["a", "😀", "b"]
    assert chunks[1].tokens == count_tokens("😀") > 1
    assert "1 chunk over synthesize.chunk_tokens=1" in caplog.text


@pytest.mark.parametrize(
    "chunk_tokens, overlap, param",
    [
        (64, 64, "synthesize.chunk_overlap"),
        (64, 100, "synthesize.chunk_overlap"),
        (64, -1, "synthesize.chunk_overlap"),
        (0, 0, "synthesize.chunk_tokens"),
    ],
)
def test_bad_sizes(count_tokens, chunk_tokens, overlap, param):
    doc = Document("a.txt", "words", "text")
    for call in (chunk_document, lambda d, **kw: chunk_documents([d], **kw)):
        with pytest.raises(BadInput) as e:
            call(doc, count_tokens=count_tokens, chunk_tokens=chunk_tokens, overlap=overlap)
        one_line(e, param)


# ---------------------------------------------------------------- jsonl


def test_write_and_read_chunks_round_trip(tmp_path, count_tokens):
    doc = Document("dir/guide.md", MARKDOWN + '\n中文 ✓ "quoted"\n', "markdown")
    chunks = chunk_document(doc, count_tokens=count_tokens, chunk_tokens=16, overlap=4)
    path = tmp_path / "out" / "chunks.jsonl"
    write_chunks(chunks, path)
    assert read_chunks(path) == chunks
    assert sorted(p.name for p in path.parent.iterdir()) == ["chunks.jsonl"]  # no temporary left
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(chunks)
    first = json.loads(lines[0])
    assert list(first) == ["id", "source", "headings", "span", "tokens", "text"]
    assert first["span"] == [chunks[0].start, chunks[0].end] and isinstance(first["headings"], list)
    assert "中文" in path.read_text(encoding="utf-8")


def test_read_chunks_errors(tmp_path):
    with pytest.raises(BadInput) as e:
        read_chunks(tmp_path / "none.jsonl")
    assert "not found" in one_line(e, str(tmp_path / "none.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a#0"}\n', encoding="utf-8")
    with pytest.raises(BadInput) as e:
        read_chunks(bad)
    assert "line 1 is not a chunk record" in one_line(e, str(bad))


# ---------------------------------------------------------------- reading documents


def test_read_a_folder(tmp_path, caplog):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_bytes(b"# Z\r\n\r\nwindows lines\rold mac\n")
    (tmp_path / "a.txt").write_text("plain text\n", encoding="utf-8")
    (tmp_path / "c.markdown").write_text("# C\n", encoding="utf-8")
    (tmp_path / "d.PDF").write_bytes(make_pdf(b"Hello PDF world"))
    (tmp_path / ".hidden.md").write_text("secret", encoding="utf-8")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.md").write_text("nope", encoding="utf-8")
    for name in ("img1.png", "img2.png", "b/img3.jpg", "notes.docx"):
        (tmp_path / name).write_bytes(b"\x89PNG")
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        docs = read_documents(tmp_path, param=PARAM)
    assert [(d.source, d.kind) for d in docs] == [
        ("a.txt", "text"),
        ("b/z.md", "markdown"),
        ("c.markdown", "markdown"),
        ("d.PDF", "pdf"),
    ]
    assert docs[1].text == "# Z\n\nwindows lines\nold mac\n"
    assert docs[0].text == "plain text\n"
    assert "Hello PDF world" in docs[3].text
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert msg.startswith(PARAM + ":") and "skipped 4 files" in msg
    assert "b/img3.jpg, img1.png, img2.png and 1 more" in msg


def test_read_one_file(tmp_path):
    f = tmp_path / "only.txt"
    f.write_text("\ufeffone file, BOM dropped\n", encoding="utf-8")
    assert read_documents(f, param=PARAM) == [Document("only.txt", "one file, BOM dropped\n", "text")]
    pdf = tmp_path / "one.pdf"
    pdf.write_bytes(make_pdf(b"Hello PDF world"))
    (doc,) = read_documents(str(pdf), param=PARAM)
    assert doc.source == "one.pdf" and doc.kind == "pdf"
    assert {"Hello", "PDF", "world"} <= set(doc.text.split())


def test_documents_without_text_are_skipped_with_a_warning(tmp_path, caplog):
    (tmp_path / "scan.pdf").write_bytes(make_pdf(b""))
    (tmp_path / "blank.md").write_text("  \n\n", encoding="utf-8")
    (tmp_path / "real.md").write_text("# Real\n\ntext\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        docs = read_documents(tmp_path, param=PARAM)
    assert [d.source for d in docs] == ["real.md"]
    assert ("skipped 2 documents without text: blank.md (empty), scan.pdf (no text layer: OCR it first)") in caplog.text


def test_errors_are_one_line_and_name_the_param(tmp_path):
    def error(path) -> str:
        with pytest.raises(BadInput) as e:
            read_documents(path, param=PARAM)
        return one_line(e)

    assert error(tmp_path / "missing") == f"{PARAM}: {tmp_path / 'missing'} not found"

    docx = tmp_path / "report.docx"
    docx.write_bytes(b"PK")
    assert error(docx) == f"{PARAM}: cannot read report.docx: .docx is not one of .md, .markdown, .txt, .pdf"

    latin = tmp_path / "latin" / "old.txt"
    latin.parent.mkdir()
    latin.write_bytes("caf\u00e9\n".encode("latin-1"))
    for path in (latin, latin.parent):
        msg = error(path)
        assert "old.txt" in msg and "not UTF-8" in msg

    broken = tmp_path / "broken" / "bad.pdf"
    broken.parent.mkdir()
    broken.write_bytes(b"%PDF-1.4\nthis is not really a pdf")
    msg = error(broken)
    assert "bad.pdf" in msg and "not a readable PDF" in msg

    images = tmp_path / "images"
    images.mkdir()
    (images / "a.png").write_bytes(b"\x89PNG")
    (images / ".notes.md").write_text("hidden", encoding="utf-8")
    msg = error(images)
    assert "no document in" in msg and ".md, .markdown, .txt, .pdf" in msg

    scans = tmp_path / "scans"
    scans.mkdir()
    (scans / "page.pdf").write_bytes(make_pdf(b""))
    msg = error(scans)
    assert "has text" in msg and "page.pdf (no text layer: OCR it first)" in msg
    assert "OCR it first" in error(scans / "page.pdf")


def test_chunks_of_an_indented_block_are_stripped_of_their_indentation(count_tokens):
    # semantic-text-splitter keeps the indentation of a code block's line at a chunk's start
    # (found on docs/results/tokenize_cpu.md); the chunk's span starts after it.
    text = "# Output\n\n```\n" + "\n".join(f"  line {i}: some words of output here" for i in range(120)) + "\n```\n"
    doc = Document("out.md", text, "markdown")
    chunks = chunk_document(doc, count_tokens=count_tokens, chunk_tokens=40, overlap=0)
    assert len(chunks) > 5
    check_chunks(doc, chunks, count_tokens, 40)
    assert all(not c.text.startswith(" ") for c in chunks)
