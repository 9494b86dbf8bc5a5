"""The RAG prompt: the retrieved chunks in front of the question, cut to fit the model's context.

Layout (the user's turn; the chat template, when the model has one, wraps it as usual):

    Answer the question using the context below. If the context does not hold the answer, say so.

    Context:
    [1] rivers.md > Rivers > The Nile
    The Nile is ...

    [2] ...

    Question: <the user's question>

Fitting: the caller says whether a candidate prompt fits (`fits(text)`: its tokens, after the
chat template, plus `max_tokens` within the model's positions). Chunks go in best first; the
first that does not fit whole is cut to the longest prefix of whole words that fits (by bisection
over its word ends) and every lower-ranked chunk is dropped. So the retrieved text is cut
lowest-ranked first, and each source says what became of it: `whole`, `cut` (with the
characters kept) or `dropped`. When not even the bare question fits, no context is added.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

INSTRUCTION = "Answer the question using the context below. If the context does not hold the answer, say so."


@dataclass
class Sourced:
    text: str  # the user's turn with the context
    sources: list[dict]  # one per retrieved chunk, best first: what the response's `sources` holds


def label(hit) -> str:
    """`file > heading > heading`: where a chunk comes from, as the prompt and the citations show it."""
    return " > ".join([hit.chunk.source, *hit.chunk.headings])


def layout(question: str, parts: Sequence[tuple[str, str]]) -> str:
    """The user's turn for (label, text) parts, best first; no parts: the question alone."""
    if not parts:
        return question
    context = "\n\n".join(f"[{n}] {where}\n{text}" for n, (where, text) in enumerate(parts, 1))
    return f"{INSTRUCTION}\n\nContext:\n{context}\n\nQuestion: {question}"


def augment(question: str, hits: Sequence, fits: Callable[[str], bool]) -> Sourced:
    """The question with as much of `hits` (rag.index.Hit, best first) as `fits` allows."""
    parts: list[tuple[str, str]] = []
    kept = 0  # characters of the cut chunk, when one is cut
    status: list[str] = []
    for hit in hits:
        if status and status[-1] in ("cut", "dropped"):
            status.append("dropped")
            continue
        whole = parts + [(label(hit), hit.chunk.text)]
        if fits(layout(question, whole)):
            parts = whole
            status.append("whole")
            continue
        kept = _longest_prefix(hit.chunk.text, lambda prefix: fits(layout(question, parts + [(label(hit), prefix)])))
        if kept:
            parts.append((label(hit), hit.chunk.text[:kept]))
            status.append("cut")
        else:
            status.append("dropped")
    sources = []
    for hit, state in zip(hits, status):
        c = hit.chunk
        source = {
            "rank": hit.rank,
            "id": c.id,
            "file": c.source,
            "headings": list(c.headings),
            "span": [c.start, c.end],
            "score": round(float(hit.score), 6),
            "included": state,
        }
        if state == "cut":
            source["chars_included"] = kept
        sources.append(source)
    return Sourced(layout(question, parts), sources)


def _longest_prefix(text: str, fits: Callable[[str], bool]) -> int:
    """The length of the longest prefix of `text` that ends at a word's end and `fits` (0: none).
    Bisection over the word ends: a prefix of whole words never takes fewer tokens than a shorter
    one, where a prefix cut mid-word can ("northeaste" may take more tokens than "northeastern")."""
    ends = [m.start() for m in re.finditer(r"\s+", text) if m.start() > 0] + [len(text)]
    lo, hi = 0, len(ends)  # how many of `ends` fit: the largest n with fits(text[:ends[n - 1]])
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(text[: ends[mid - 1]]):
            lo = mid
        else:
            hi = mid - 1
    return ends[lo - 1] if lo else 0
