"""The text basics the pair filters share: NFKC folding, tokens (runs of letters/digits, each CJK
character alone), display width, and `normalize_question` (the key duplicates are found by).

Pure Python (stdlib `re` and `unicodedata`); used by `filters` and `references`.
"""

from __future__ import annotations

import re
import unicodedata

# CJK ideographs (with extension A, compatibility and the supplementary planes) and kana: one
# token per character, since these scripts do not separate words with spaces.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
_TOKEN = re.compile(rf"[{_CJK}]|[^\W{_CJK}_]+")
_CJK_CHAR = re.compile(rf"[{_CJK}]")
_SPACE_BETWEEN_CJK = re.compile(rf"(?<=[{_CJK}]) (?=[{_CJK}])")


def _nfkc(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


def _tokens(text: str) -> list[str]:
    """NFKC, case-folded tokens: runs of letters/digits, and each CJK character alone."""
    return _TOKEN.findall(_nfkc(text).casefold())


def _columns(text: str) -> int:
    """Display width: wide and full-width characters count 2."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


class _PunctuationToSpace(dict):
    """A `str.translate` table, filled as characters are met: punctuation (Unicode category
    P*, ASCII and CJK alike) -> space, everything else -> itself."""

    def __missing__(self, cp: int) -> int:
        out = 32 if unicodedata.category(chr(cp)).startswith("P") else cp
        self[cp] = out
        return out


_PUNCTUATION_TO_SPACE = _PunctuationToSpace()


def normalize_question(text: str) -> str:
    """NFKC (full-width -> half-width), casefold, punctuation (ASCII and CJK, e.g. ？，。) removed,
    whitespace collapsed.

    Punctuation becomes a space ("well-known" == "well known"), and a space between two CJK
    characters is dropped afterwards ("你好，世界" == "你好世界"), so "ＷＨＡＴ　ｉｓ　ｘ？" and
    "what is x?" both give "what is x"."""
    text = _nfkc(text).casefold().translate(_PUNCTUATION_TO_SPACE)
    return _SPACE_BETWEEN_CJK.sub("", " ".join(text.split()))
