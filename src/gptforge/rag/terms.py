"""Text to the terms BM25 matches on.

Words of alphabetic scripts are lowercased and kept whole, English stop words dropped. Chinese,
Japanese and Korean text has no spaces between words: a run of their characters becomes its
overlapping character bigrams ("自然语言" -> 自然, 然语, 语言), the standard segmentation-free
indexing of CJK text (Lucene's CJKBigramFilter), which needs no dictionary; a run of one
character is kept as it is.
"""

from __future__ import annotations

import re

# Han (CJK unified ideographs and extension A, compatibility), Hiragana, Katakana, Hangul syllables.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKEN = re.compile(rf"[{_CJK}]+|[^\W_{_CJK}]+")
_CJK_RUN = re.compile(rf"[{_CJK}]+")

# The English stop words bm25s ships (its STOPWORDS_EN), inlined so a query costs no import.
STOPWORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these "
    "they this to was will with".split()
)

VERSION = "words-cjk-bigrams-1"  # recorded in the index: a change here means rebuilding


def terms(text: str) -> list[str]:
    out: list[str] = []
    for token in _TOKEN.findall(text.lower()):
        if _CJK_RUN.fullmatch(token):
            out += [token] if len(token) == 1 else [token[i : i + 2] for i in range(len(token) - 1)]
        elif token not in STOPWORDS:
            out.append(token)
    return out
