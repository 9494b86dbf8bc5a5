"""Documents cut into chunks that follow the document, with their spans and heading paths.

`chunk_document` splits a `Document` with semantic-text-splitter (`MarkdownSplitter` for
Markdown: it cuts at headings first, then blocks, lines, sentences, words; `TextSplitter`
otherwise: blank lines, lines, sentences, words), measuring sizes with the caller's
`count_tokens`. Each `Chunk` keeps its character span into `Document.text`
(`doc.text[start:end] == chunk.text`) and, for Markdown, the heading path in force where it
starts.

What the splitter guarantees, checked against semantic-text-splitter 0.33:
- `chunk_indices` gives offsets in characters (Python `str` indices), not UTF-8 bytes, also for
  Chinese text; chunks are stripped of surrounding whitespace.
- `count_tokens(chunk.text) <= chunk_tokens`, except for a chunk that is one character whose
  own encoding is longer than `chunk_tokens` (the splitter never cuts inside a character; with
  GPT-2's byte-level BPE a character is at most 4 tokens, so this needs chunk_tokens < 4). Such
  a chunk is kept, with a warning; its `tokens` field says its real size.
- `overlap` is the most tokens two consecutive chunks may share, not a promise that they share
  any: the splitter repeats the last whole units (at the level it is cutting at: sentences,
  lines, blocks) of one chunk at the start of the next when they fit in `overlap` tokens. Where
  that level's units are longer (Markdown paragraphs over `overlap` tokens), or where the next
  chunk starts a new section at a heading, consecutive chunks only touch.

Heading paths: ATX headings (`#` to `######`, up to 3 spaces of indent) outside ``` and ~~~
fenced code blocks, indexed once per document. A chunk's path is the stack of headings in force
at its start, including the headings it starts with (before any other text) at their levels.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from gptforge.errors import BadInput
from gptforge.io import atomic_file
from gptforge.synthesize.documents import Document

log = logging.getLogger("gptforge")


@dataclass(frozen=True)
class Chunk:
    id: str  # f"{source}#{index}", index from 0 within the document
    source: str
    headings: tuple[str, ...]  # Markdown heading path at the chunk, outermost first; () for text/pdf
    start: int  # character offsets: doc.text[start:end] == text
    end: int
    text: str
    tokens: int  # count_tokens(text)


def chunk_document(
    doc: Document, *, count_tokens: Callable[[str], int], chunk_tokens: int, overlap: int
) -> list[Chunk]:
    """`doc` in chunks of at most `chunk_tokens` tokens, consecutive ones sharing at most
    `overlap` tokens; see the module doc for what is and is not guaranteed."""
    _check_sizes(chunk_tokens, overlap)
    return _chunk(doc, _splitter(doc.kind, count_tokens, chunk_tokens, overlap), count_tokens, chunk_tokens)


def chunk_documents(
    docs: Sequence[Document], *, count_tokens: Callable[[str], int], chunk_tokens: int, overlap: int
) -> list[Chunk]:
    """The chunks of every document, in the documents' order."""
    _check_sizes(chunk_tokens, overlap)
    splitters: dict[str, object] = {}
    chunks: list[Chunk] = []
    for doc in docs:
        kind = "markdown" if doc.kind == "markdown" else "text"
        if kind not in splitters:
            splitters[kind] = _splitter(kind, count_tokens, chunk_tokens, overlap)
        chunks.extend(_chunk(doc, splitters[kind], count_tokens, chunk_tokens))
    return chunks


def write_chunks(chunks: Sequence[Chunk], path: str | os.PathLike) -> None:
    """JSON lines, one object per chunk: id, source, headings, span [start, end], tokens, text;
    written atomically."""
    with atomic_file(path, "w", encoding="utf-8") as f:
        for c in chunks:
            record = {
                "id": c.id,
                "source": c.source,
                "headings": list(c.headings),
                "span": [c.start, c.end],
                "tokens": c.tokens,
                "text": c.text,
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_chunks(path: str | os.PathLike) -> list[Chunk]:
    """What `write_chunks` wrote; a one-line BadInput naming the line that is not a chunk."""
    chunks = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    start, end = r["span"]
                    chunk = Chunk(
                        id=str(r["id"]),
                        source=str(r["source"]),
                        headings=tuple(str(h) for h in r["headings"]),
                        start=int(start),
                        end=int(end),
                        text=str(r["text"]),
                        tokens=int(r["tokens"]),
                    )
                except (ValueError, KeyError, TypeError) as e:
                    reason = " ".join(str(e).split()) or type(e).__name__
                    raise BadInput(f"{path}: line {n} is not a chunk record ({type(e).__name__}: {reason})") from None
                chunks.append(chunk)
    except FileNotFoundError:
        raise BadInput(f"{path}: not found") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    return chunks


class HeadingIndex:
    """The ATX headings of one Markdown text (outside fenced code), found in one pass, and the
    heading path at any offset by bisection."""

    # A line that may open a heading or a fence: up to 3 spaces, then #..###### followed by a
    # space, a tab or the end of the line, or a run of 3+ backticks or tildes.
    _LINE = re.compile(r"^ {0,3}(#{1,6}(?=[ \t]|$)|`{3,}|~{3,})(.*)$", re.M)
    _CLOSING_HASHES = re.compile(r"(?:^|[ \t]+)#+[ \t]*$")
    _SPACE = re.compile(r"\s*")

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts: list[int] = []  # line start of each heading, ascending
        self.ends: list[int] = []  # line end (the "\n" or len(text))
        self.paths: list[tuple[str, ...]] = []  # the path with that heading in force
        stack: list[tuple[int, str]] = []
        fence: str | None = None  # the opening run of the fenced block we are in
        for m in self._LINE.finditer(text):
            marker, rest = m.group(1), m.group(2)
            if fence is not None:
                if marker[0] == fence[0] and len(marker) >= len(fence) and not rest.strip():
                    fence = None
                continue
            if marker[0] in "`~":
                if not (marker[0] == "`" and "`" in rest):  # ```x``` on one line is inline code
                    fence = marker
                continue
            title = self._CLOSING_HASHES.sub("", rest).strip()
            level = len(marker)
            while stack and stack[-1][0] >= level:
                stack.pop()
            if title:
                stack.append((level, title))
            self.starts.append(m.start())
            self.ends.append(m.end())
            self.paths.append(tuple(t for _, t in stack))

    def path(self, start: int, end: int | None = None) -> tuple[str, ...]:
        """The heading path of the span text[start:end]: the headings in force at `start`, plus
        the headings the span starts with (before any other text) at their levels."""
        end = len(self.text) if end is None else end
        cursor = start
        while True:
            cursor = self._SPACE.match(self.text, cursor, end).end()
            j = bisect.bisect_right(self.starts, cursor) - 1
            if cursor >= end or j < 0 or not self.starts[j] <= cursor < self.ends[j]:
                break
            cursor = min(self.ends[j], end)  # a heading line: step over it
        j = bisect.bisect_left(self.starts, cursor) - 1  # the last heading starting before cursor
        return self.paths[j] if j >= 0 else ()


def heading_path(text: str, offset: int) -> tuple[str, ...]:
    """The heading path at `offset` of Markdown `text` (one-off: indexes the whole text; for
    many offsets build a `HeadingIndex` once)."""
    return HeadingIndex(text).path(offset)


def _check_sizes(chunk_tokens: int, overlap: int) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise BadInput(f"synthesize.chunk_tokens: must be a positive integer, got {chunk_tokens!r}")
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
        raise BadInput(f"synthesize.chunk_overlap: must be a non-negative integer, got {overlap!r}")
    if overlap >= chunk_tokens:
        raise BadInput(
            f"synthesize.chunk_overlap: must be less than synthesize.chunk_tokens ({overlap} >= {chunk_tokens})"
        )


def _splitter(kind: str, count_tokens: Callable[[str], int], chunk_tokens: int, overlap: int):
    from semantic_text_splitter import MarkdownSplitter, TextSplitter

    cls = MarkdownSplitter if kind == "markdown" else TextSplitter
    return cls.from_callback(count_tokens, capacity=chunk_tokens, overlap=overlap)


def _chunk(doc: Document, splitter, count_tokens: Callable[[str], int], chunk_tokens: int) -> list[Chunk]:
    index = HeadingIndex(doc.text) if doc.kind == "markdown" else None
    chunks, oversized = [], []
    for start, text in splitter.chunk_indices(doc.text):
        end = start + len(text)
        if doc.text[start:end] != text:  # its offsets are characters (module doc); never trust blindly
            raise RuntimeError(
                f"{doc.source}: semantic_text_splitter's offset {start} does not point at its chunk "
                "(has the package changed to byte offsets?)"
            )
        # The Markdown splitter keeps a code block line's indentation at a chunk's start: strip it.
        start += len(text) - len(text.lstrip())
        text = text.strip()
        end = start + len(text)
        if not text:
            continue
        tokens = count_tokens(text)
        if tokens > chunk_tokens:
            oversized.append(text)
        chunks.append(
            Chunk(
                id=f"{doc.source}#{len(chunks)}",
                source=doc.source,
                headings=index.path(start, end) if index is not None else (),
                start=start,
                end=end,
                text=text,
                tokens=tokens,
            )
        )
    if oversized:
        log.warning(
            "%s: %d chunk%s over synthesize.chunk_tokens=%d kept as they are (a single character "
            "the splitter cannot cut, first %r)",
            doc.source,
            len(oversized),
            "s" if len(oversized) != 1 else "",
            chunk_tokens,
            oversized[0][:20],
        )
    return chunks
