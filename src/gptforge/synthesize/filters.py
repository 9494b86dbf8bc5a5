"""The checks a generated question/answer pair must pass before it may enter a fine-tuning set.

A set that keeps bad pairs teaches the model to hallucinate, so each pair is checked against
the chunk it was generated from: its shape (`check_pair`: empty, too short or long, not a
question, an answer that only repeats the question), whether it points at context the reader
cannot see (`references.context_reference`: "as shown in Figure 3", "according to the passage",
"如上图所示"), whether the chunk supports the answer (`grounding`), and, over the whole set,
whether it repeats an earlier pair (`deduplicate`: same question, or near-duplicate question +
answer). Every function is pure Python (stdlib `re` and `unicodedata`), deterministic, and takes
English, Chinese and mixed text; full-width forms are folded to half-width (NFKC) first (`text`:
the folding, tokens and `normalize_question` these checks share).

`settings` is the config section `synthesize.filters`: any object with the attributes of
`DEFAULTS` (a mapping works too; a missing attribute takes its default, `None` takes them all):
- `min_question_chars` / `max_question_chars`, `min_answer_chars` / `max_answer_chars`: length
  limits of the stripped text in display columns: a wide (CJK, full-width) character counts 2,
  so "什么是光合作用？" (8 characters, 16 columns) passes the minimum of 10 like an English
  question of about the same content would;
- `min_grounding`: the least `grounding` an answer needs;
- `near_duplicate`: the `near_duplicate_score` at and above which a pair repeats a kept one
  (in (0, 1]; above 1 turns the near-duplicate check off).

Reasons (`REASONS`), in the order `check_pair` tries them, then `deduplicate`'s two:
- "empty": the question or the answer is blank;
- "too_short" / "too_long": outside the length limits above (question or answer);
- "not_a_question": the question neither ends with "?"/"？" nor starts with an interrogative or
  instruction word (`QUESTION_WORDS`: what, how, explain, list, ...), nor, for Chinese, holds
  an interrogative (什么, 为什么, 如何, 怎么, 怎样, 哪, 谁, 是否, 多少), ends in 吗/呢 or
  starts with 请;
- "repeats_question": the answer says nothing the question does not: the same normalized
  text, its words contained in the question's (except yes/no answers and questions that offer
  a choice: "or", 还是, 或者, 是否), or a token F1 >= 0.9 against the question;
- "not_self_contained": `references.context_reference` finds a phrase in the question or the
  answer;
- "ungrounded": `grounding(answer, chunk) < min_grounding`;
- "duplicate" / "near_duplicate": see `deduplicate`.

Decisions worth knowing (how context references are matched: `references`):
- Grounding is lexical: words are compared by their first 5 characters after a plural -s/-ies
  is dropped (numbers and other tokens with a digit whole), which folds plurals and tenses
  ("trees"/"tree", "produces"/"produced") at the price of some false matches between long
  words ("information"/"informal"); each distinct content word counts once. A CJK character
  is one token.
- Near-duplicates are found through an inverted index over the rarest shingles of each kept
  pair (prefix filtering: two sets with Jaccard >= t must share one of them), then scored
  exactly: 10,000 random pairs take about a second (0.6-1.4 s on a busy 2-core machine)
  instead of 50 million comparisons.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from gptforge.synthesize.references import context_reference
from gptforge.synthesize.text import _CJK_CHAR, _TOKEN, _columns, _nfkc, _tokens, normalize_question

__all__ = [
    "DEFAULTS",
    "REASONS",
    "QUESTION_WORDS",
    "grounding",
    "check_pair",
    "near_duplicate_score",
    "deduplicate",
]

REASONS = (
    "empty",
    "too_short",
    "too_long",
    "not_a_question",
    "repeats_question",
    "not_self_contained",
    "ungrounded",
    "duplicate",
    "near_duplicate",
)

#: The defaults of `synthesize.filters`, for the config to reuse.
DEFAULTS: dict[str, float] = {
    "min_question_chars": 10,
    "max_question_chars": 300,
    "min_answer_chars": 2,
    "max_answer_chars": 1500,
    "min_grounding": 0.5,
    "near_duplicate": 0.7,
}


def _setting(settings: Any, name: str) -> Any:
    if settings is None:
        return DEFAULTS[name]
    if isinstance(settings, Mapping):
        return settings.get(name, DEFAULTS[name])
    return getattr(settings, name, DEFAULTS[name])


# --- grounding -----------------------------------------------------------------------------

#: English function words: not content, for `grounding`.
EN_STOPWORDS = frozenset(
    """a about above after again against all almost also although always am among an and any
    anyone anything are around as at be became because become been before being below between
    both but by can cannot could did do does doing done down during each either else enough etc
    even ever every few for from further had has have having he her here hers herself him
    himself his how however i if in into is it its itself just least less let like many may
    me might more most much must my myself neither never no nor not now of off often on once
    only onto or other others otherwise our ours ourselves out over own per perhaps quite rather
    really same several shall she should since so some something still such than that the
    their theirs them themselves then there therefore these they this those though through thus
    to too toward towards under until up upon us usually very via was we well were what
    whatever when whenever where whereas wherever whether which while who whoever whom whose
    why will with within without would yes yet you your yours yourself yourselves
    s t d ll m re ve don doesn didn isn aren wasn weren hasn haven hadn won wouldn shouldn
    couldn e g eg ie""".split()
)
#: Chinese particles and function characters: not content, for `grounding`.
ZH_STOPWORDS = frozenset(
    "的了是在和与及或等也就都而之其这那个一有为以于对"  # the brief's list
    "不否吗呢吧着过们些把被所并"  # negation and question particles, aspect/plural markers
    "のはがをにでともへ"  # Japanese particles
)
_STEM = 5  # letters compared: "produces"/"produced" -> "produ"


def _key(tok: str) -> str:
    """What a word is compared by: a token with a digit whole; a word without a plural -s
    (-ies -> -y; not -ss), then its first 5 characters."""
    if not tok.isalpha():
        return tok
    if len(tok) > 4 and tok.endswith("ies"):
        tok = tok[:-3] + "y"
    elif len(tok) > 3 and tok.endswith("s") and not tok.endswith("ss"):
        tok = tok[:-1]
    return tok[:_STEM]


def _content_keys(text: str) -> frozenset[str]:
    return frozenset(_key(tok) for tok in _tokens(text) if tok not in EN_STOPWORDS and tok not in ZH_STOPWORDS)


# A chunk is checked against every pair generated from it: its words are worked out once.
_chunk_keys = functools.lru_cache(maxsize=64)(_content_keys)


def grounding(answer: str, chunk: str) -> float:
    """Lexical support: the share of the answer's content words (stopwords removed, case-folded,
    NFKC) found in the chunk; 1.0 when the answer has no content word.

    Tokens are runs of letters/digits and single CJK characters; content words are those not
    in `EN_STOPWORDS`/`ZH_STOPWORDS`; numbers are content. Words are compared by their first 5
    characters after a plural -s/-ies is dropped (a crude stem: "trees"/"tree", "cities"/"city",
    "produces"/"produced" match), tokens with a digit whole ("1889" is not "18890", "h2o" is not
    "h2o2"); each distinct word of the answer counts once."""
    wanted = _content_keys(answer)
    if not wanted:
        return 1.0
    return len(wanted & _chunk_keys(chunk)) / len(wanted)


# --- shape ---------------------------------------------------------------------------------

#: First words that make a sentence a question or an instruction.
QUESTION_WORDS = frozenset(
    """what which who whom whose when where why how is are was were do does did can could
    should would will explain describe list name define compare give summarize summarise tell
    identify outline discuss state calculate has have had""".split()
)
_ZH_INTERROGATIVES = ("什么", "为什么", "如何", "怎么", "怎样", "哪", "谁", "是否", "多少")
_ENDS_WITH_QUESTION_MARK = re.compile(r"[?？][\s\"'”’)\]）」』】]*$")
_ENDS_WITH_ZH_PARTICLE = re.compile(r"[吗呢][\s。.!！\"'”’)\]）」』】]*$")
_FIRST_WORD = re.compile(r"[\W_]*([^\W_]+)")
_OFFERS_CHOICE = re.compile(r"\bor\b|还是|或者|或是|是否")
_YES_NO = frozenset({"yes", "no", "true", "false", "是", "否", "不", "对", "不是", "是的", "没有", "有"})


def _is_question(question: str) -> bool:
    q = question.strip()
    if _ENDS_WITH_QUESTION_MARK.search(q) or _ENDS_WITH_ZH_PARTICLE.search(q):
        return True
    m = _FIRST_WORD.match(q.casefold())
    if m and m.group(1) in QUESTION_WORDS:
        return True
    return q.startswith("请") or any(w in q for w in _ZH_INTERROGATIVES)


def _token_f1(a: str, b: str) -> float:
    ta, tb = Counter(_tokens(a)), Counter(_tokens(b))
    common = sum((ta & tb).values())
    if not common:
        return 0.0
    precision, recall = common / sum(ta.values()), common / sum(tb.values())
    return 2 * precision * recall / (precision + recall)


def _repeats_question(question: str, answer: str) -> bool:
    nq, na = normalize_question(question), normalize_question(answer)
    if na == nq:
        return True
    if na not in _YES_NO and not _OFFERS_CHOICE.search(nq):
        padded = na if _CJK_CHAR.search(na) else f" {na} "
        if padded in f" {nq} ":
            return True
    return _token_f1(na, nq) >= 0.9


def check_pair(question: str, answer: str, chunk: str, settings: Any) -> tuple[str | None, dict[str, float]]:
    """The first reason the pair fails (order: shape checks, not_self_contained, ungrounded) or
    None, and its scores ({"grounding": g}).

    Shape checks, in order: "empty", "too_short", "too_long" (question or answer, in display
    columns of the NFKC, stripped text), "not_a_question", "repeats_question". The grounding
    score is computed and returned whatever the reason."""
    q, a = _nfkc(question).strip(), _nfkc(answer).strip()
    scores = {"grounding": grounding(a, chunk)}
    if not q or not a:
        return "empty", scores
    q_len, a_len = _columns(q), _columns(a)
    if q_len < _setting(settings, "min_question_chars") or a_len < _setting(settings, "min_answer_chars"):
        return "too_short", scores
    if q_len > _setting(settings, "max_question_chars") or a_len > _setting(settings, "max_answer_chars"):
        return "too_long", scores
    if not _is_question(q):
        return "not_a_question", scores
    if _repeats_question(q, a):
        return "repeats_question", scores
    if context_reference(q) is not None or context_reference(a) is not None:
        return "not_self_contained", scores
    if scores["grounding"] < _setting(settings, "min_grounding"):
        return "ungrounded", scores
    return None, scores


# --- duplicates ----------------------------------------------------------------------------


def _shingles(question: str, answer: str) -> frozenset[str]:
    tokens = _TOKEN.findall(normalize_question(question) + " " + normalize_question(answer))
    if len(tokens) < 2:
        return frozenset(tokens)
    return frozenset(f"{x} {y}" for x, y in zip(tokens, tokens[1:]))


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    if not a and not b:
        return 1.0
    common = len(a & b)
    return common / (len(a) + len(b) - common)


def near_duplicate_score(a: tuple[str, str], b: tuple[str, str]) -> float:
    """Jaccard similarity of word-bigram shingles (CJK: character bigrams) of question + answer
    together.

    Both are normalized as by `normalize_question` and tokenized (words, single CJK characters);
    the shingles are consecutive token pairs, so a CJK run gives its character bigrams. A text
    of one token is its own shingle; two empty texts score 1.0."""
    return _jaccard(_shingles(*a), _shingles(*b))


def deduplicate(pairs: Sequence[tuple[str, str]], settings: Any) -> list[tuple[str, int] | None]:
    """For each (question, answer) in order: None when kept, else (reason, index of the earlier
    kept pair it repeats); the first one is kept. "duplicate": same normalize_question;
    "near_duplicate": near_duplicate_score >= settings.near_duplicate.

    A near-duplicate points at the most similar kept pair (the earliest of equals). Only kept
    pairs are compared against. Candidates come from an inverted index holding, for each kept
    pair, its rarest shingles (the first |S| - ceil(t*|S|) + 1 by frequency over all pairs):
    two shingle sets with Jaccard >= t share at least ceil(t*max(|A|,|B|)) shingles, hence one
    of those prefixes; each candidate is then scored exactly."""
    threshold = float(_setting(settings, "near_duplicate"))
    if threshold <= 0:
        raise ValueError(f"near_duplicate must be > 0 (1 or more turns it off), not {threshold}")
    shingles = [_shingles(q, a) for q, a in pairs]
    frequency: Counter[str] = Counter()
    for s in shingles:
        frequency.update(s)

    results: list[tuple[str, int] | None] = []
    kept_questions: dict[str, int] = {}
    index: defaultdict[str, list[int]] = defaultdict(list)
    for i, (question, _answer) in enumerate(pairs):
        key = normalize_question(question)
        if key in kept_questions:
            results.append(("duplicate", kept_questions[key]))
            continue
        s = shingles[i]
        prefix: list[str] = []
        if s and threshold <= 1:
            n = len(s)
            size = n - max(1, math.ceil(threshold * n - 1e-9)) + 1
            prefix = sorted(s, key=lambda x: (frequency[x], x))[:size]
            candidates: set[int] = set()
            for x in prefix:
                candidates.update(index.get(x, ()))
            best, best_score = -1, -1.0
            for j in sorted(candidates):
                score = _jaccard(s, shingles[j])
                if score >= threshold and score > best_score:
                    best, best_score = j, score
            if best >= 0:
                results.append(("near_duplicate", best))
                continue
        for x in prefix:
            index[x].append(i)
        kept_questions[key] = i
        results.append(None)
    return results
