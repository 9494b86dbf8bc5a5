"""The checks a generated question/answer pair must pass before it may enter a fine-tuning set.

A set that keeps bad pairs teaches the model to hallucinate, so each pair is checked against
the chunk it was generated from: its shape (`check_pair`: empty, too short or long, not a
question, an answer that only repeats the question), whether it points at context the reader
cannot see (`context_reference`: "as shown in Figure 3", "according to the passage", "如上图所示"),
whether the chunk supports the answer (`grounding`), and, over the whole set, whether it repeats
an earlier pair (`deduplicate`: same question, or near-duplicate question + answer). Every
function is pure Python (stdlib `re` and `unicodedata`), deterministic, and takes English,
Chinese and mixed text; full-width forms are folded to half-width (NFKC) first.

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
- "not_self_contained": `context_reference` finds a phrase in the question or the answer;
- "ungrounded": `grounding(answer, chunk) < min_grounding`;
- "duplicate" / "near_duplicate": see `deduplicate`.

Decisions worth knowing:
- Context references are matched in context rather than on bare words: "Figure 3", "Table IV",
  "Eq. (2)", "page 12" (numbered), "this table", "the following figure", "the chart below",
  "the figure" (but not "figure out", "figure of speech", "a key figure", "fig" the fruit, nor
  "table" inside "vegetable"/"comfortable"/"stable", "the periodic table", "webpage", "web page",
  "Solve the equation 2x + 3 = 7"). "the following" followed by a colon within four words
  ("Which of the following is prime: 4, 6, 7?") shows its content inline and is fine, so is
  "the following year/day/..."; "in the context of X" is fine, "in this context" is not.
  Chinese: 图, 表, 上文, 下文, 如下, 如上, 本章, 本节, 本文, 文中, 上述 (and a few more, see
  `ZH_PATTERNS`), not inside the common compounds of `ZH_NOT_REFERENCES` (图书, 地图, 试图,
  图灵, 图像, 表达, 表示, 代表, 发表, 列表, 手表, 日本, 文本, 中文, 例如, 上下文学习, ...).
  图片 and 图表 are references ("这张图片", "根据图表").
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
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "DEFAULTS",
    "REASONS",
    "QUESTION_WORDS",
    "EN_PATTERNS",
    "ZH_PATTERNS",
    "ZH_NOT_REFERENCES",
    "context_reference",
    "grounding",
    "check_pair",
    "normalize_question",
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


# --- text basics ---------------------------------------------------------------------------

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


# --- self-contained ------------------------------------------------------------------------


def _words(*words: str) -> str:
    return "(?:" + "|".join(words) + ")"


# Things in a document a reader of the pair alone cannot see.
_VISUAL = _words(
    "figures?", "tables?", "listings?", "equations?", "pages?", "diagrams?", "charts?",
    "graphs?", "images?", "pictures?", "illustrations?", "screenshots?", "plots?",
)
_DOCUMENT = _words(
    "passages?", "texts?", "chapters?", "sections?", "documents?", "articles?", "excerpts?",
    "paragraphs?", "snippets?", "chunks?", "materials?", "papers?", "stud(?:y|ies)", "books?",
    "stor(?:y|ies)", "reports?", "essays?", "lectures?", "transcripts?", "sources?", "readings?",
)
# Words that make "<word> figure/passage/..." a pointer ("this table", "the following passage").
_DETERMINER = (
    r"(?:this|these|above|aforementioned|the\s+(?:above|below|following|preceding|previous|"
    r"next|accompanying|attached|given|provided|present|current|aforementioned|original))"
)
# A figure/table/equation number: "3", "2b", "2.1", "S1", "(3)"; not "2x + 3" or "2 = 2".
_LABEL = (
    r"(?:\(\s*(?-i:[A-Z])?\d+(?:\.\d+)*[a-z]?\s*\)"
    r"|(?-i:[A-Z])?\d+(?:[.\-]\d+)*[a-z]?\b(?!\s*[=+*/^<>]))"
)
_NOT_AFTER_ABOVE_BELOW = r"(?!\s+(?:the|a|an|zero|average|sea|ground|\d)\b)"
_TIME = _words(
    "days?", "weeks?", "months?", "years?", "decades?", "centur(?:y|ies)", "mornings?",
    "afternoons?", "evenings?", "nights?", "seasons?", "spring", "summer", "autumn", "fall",
    "winter", "weekends?", "generations?",
)
_SOURCE = _words(
    "texts?", "passages?", "documents?", "chunks?", "context", "articles?", "excerpts?",
    "paragraphs?", "sections?", "chapters?", "authors?", "sources?", "materials?", "snippets?",
    "extracts?", "figures?", "tables?", "charts?", "diagrams?", "graphs?", "images?", "papers?",
    "stud(?:y|ies)", "reports?", "information", "data", "content", "readings?", "transcripts?",
)
_AUTHOR_VERB = _words(
    "mention", "state", "say", "said", "describe", "discuss", "argue", "note", "suggest",
    "write", "wrote", "written", "claim", "explain", "propose", "present", "report", "refer",
    "mean", "meant", "believe", "think", "thought", "emphasi[sz]e", "highlight", "conclude",
    "define", "recommend", "point", "impl(?:y|ie)",
)

#: (what it catches, regex) for English; matched case-insensitively, on word boundaries.
EN_PATTERNS: tuple[tuple[str, str], ...] = (
    ("numbered figure/table/listing/equation/page",
     rf"\b(?:fig(?:ure)?s?\.?|tables?|listings?|eq(?:uation)?s?\.?|pages?|charts?|diagrams?)"
     rf"\s*{_LABEL}"),
    ("roman-numbered figure/table", r"\b(?:fig(?:ure)?s?\.?|tables?)\s+(?-i:[IVX]{1,4})\b(?!['’])"),
    ("figure/table/... above or below",
     rf"\b{_VISUAL}\s+(?:above|below)\b{_NOT_AFTER_ABOVE_BELOW}"),
    ("this/the following figure/table/page/...",
     rf"\b{_DETERMINER}\s+{_VISUAL}\b(?!\s*:)(?!\s+(?:out|of\s+speech|skat\w*)\b)"),
    ("this/the following chapter/section/document/article/excerpt/passage/...",
     rf"\b{_DETERMINER}\s+{_DOCUMENT}\b(?!\s*:)"),
    ("the figure", r"\bthe\s+figures?\b(?!\s+(?:out|of\s+speech|skat\w*)\b)"),
    ("in/from the table", r"\b(?:in|from|see|per)\s+the\s+tables?\b"),
    ("the table shows",
     r"\bthe\s+tables?\s+(?:shows?|lists?|presents?|summari[sz]es|gives|displays|illustrates"
     r"|compares|indicates)\b"),
    ("the passage", r"\bthe\s+passages?\b(?!\s+of\b)(?!\s*:)"),
    ("the excerpt/snippet", r"\bthe\s+(?:excerpt|snippet)s?\b(?!\s*:)"),
    ("the text above/below/says",
     r"\bthe\s+text\s+(?:above|below|says|states|mentions|describes|suggests|explains|implies"
     r"|indicates|notes|discusses|shows)\b"),
    ("in/from the text",
     r"\b(?:in|from)\s+the\s+(?:given\s+|provided\s+)?text\b(?![\s-]+(?:field|box|editor|file"
     r"|area|input|message|mode|format|string|encoding|view|widget|node|colou?r|size)s?\b)"),
    ("in the document/article/paragraph/...",
     r"\b(?:in|from)\s+the\s+(?:document|article|paragraph|excerpt|chapter|section)s?\b"
     r"(?!\s+(?:of|by|titled|called|named)\b)"),
    ("the above", r"\bthe\s+above\b"),
    ("above-mentioned / aforementioned", r"\b(?:above|below)[\s-]mentioned\b|\baforementioned\b"),
    ("the following", rf"\bthe\s+following\b(?!\s+{_TIME}\b)(?!(?:\s+[\w'’-]+){{0,4}}\s*:)"),
    ("the author(s) mention", rf"\b(?:the|this)\s+authors?\s+(?:(?:also|further|then|clearly"
     rf"|explicitly|briefly|later|first|specifically|not|mainly)\s+)?{_AUTHOR_VERB}\w*"),
    ("the author's", r"\bthe\s+author(?:'s|s'|’s|s’)"),
    ("according to / based on the text/passage/document/chunk/context",
     rf"\b(?:according\s+to|based\s+on|as\s+(?:stated|described|mentioned|shown|explained|noted"
     rf"|discussed|outlined)\s+in)\s+(?:the|this|these)\s+(?:(?:above|given|provided|preceding"
     rf"|following|previous|original)\s+)?{_SOURCE}\b"
     rf"(?!\s+(?:from|of|by|published|written|titled|called|on)\b)"),
    ("mentioned/shown above/below",
     rf"\b(?:mentioned|shown|described|discussed|listed|given|stated|noted|illustrated|presented"
     rf"|depicted|outlined|cited|displayed|explained|defined|provided|quoted|summari[sz]ed"
     rf"|referenced|specified|indicated|seen)\s+(?:above|below)\b{_NOT_AFTER_ABOVE_BELOW}"),
    ("mentioned earlier/previously",
     r"\b(?:mentioned|discussed|described|stated|noted|explained|defined|shown|introduced"
     r"|listed|outlined)\s+(?:earlier|previously|before)\b"
     r"(?!\s+(?:than|the|a|an|his|her|their|its|this|that|\d))"),
    ("as mentioned,",
     r"\bas\s+(?:previously\s+|already\s+|earlier\s+)?(?:mentioned|noted|discussed|described"
     r"|stated|explained|shown|seen|illustrated|indicated)(?=\s*[,.;)]|\s*$)"),
    ("in the context / this context",
     r"\b(?:in\s+the|this|the\s+(?:given|provided|above|following))\s+context\b(?!\s+of\b)"),
)

#: Chinese words that contain a reference character but are not references (the pattern's
#: match is dropped when it overlaps one of them): books/maps/intent/Turing/imaging (图),
#: express/represent/publish/surface/list/watch/cousin (表), Japan/basic/text/version/cost (本),
#: language names (文中 in 中文中), "for example" (如上/如下 in 例如上海), in-context learning.
ZH_NOT_REFERENCES: tuple[str, ...] = (
    # 图
    "图书", "地图", "试图", "企图", "意图", "力图", "图谋", "贪图", "宏图", "蓝图", "版图", "图灵",
    "图像", "图形", "图案", "图标", "图层", "图论", "图谱", "图纸", "图腾", "图钉", "图章", "拼图",
    "构图", "视图", "流程图", "思维导图",
    # 表
    "表达", "表示", "代表", "发表", "表现", "表面", "表演", "表情", "表明", "表扬", "表态", "表决",
    "表述", "表白", "表彰", "表率", "表皮", "表层", "表象", "表征", "表兄", "表姐", "表弟", "表妹",
    "表哥", "表亲", "外表", "手表", "钟表", "仪表", "电表", "水表", "列表", "链表", "哈希表",
    "散列表", "数据表", "时间表", "课程表", "日程表", "报表", "年表", "页表", "符号表", "路由表",
    "价目表", "师表",
    # 本 (本文, 本章, 本节)
    "日本", "基本", "样本", "文本", "剧本", "版本", "课本", "成本", "资本", "根本", "脚本", "账本",
    "书本", "标本", "副本", "原本", "范本", "蓝本", "读本", "笔记本",
    # 文 (文中)
    "中文", "英文", "日文", "法文", "德文", "韩文", "俄文", "外文", "语文", "作文", "公文", "散文",
    # 如 (如上, 如下)
    "例如", "比如", "诸如", "譬如", "假如", "正如", "犹如", "宛如",
    # 上下文 as a technical term
    "上下文学习", "上下文窗口", "上下文长度", "上下文无关",
)

#: (what it catches, regex) for Chinese, matched on the NFKC text; a match that overlaps one
#: of `ZH_NOT_REFERENCES` does not count.
ZH_PATTERNS: tuple[tuple[str, str], ...] = (
    ("图 (figure)", r"[上下左右该此本附如见]?图(?:\s*[0-9]+(?:\.[0-9]+)*)?"),
    ("表 (table)", r"[上下左右该此本附如见]?表(?:\s*[0-9]+(?:\.[0-9]+)*)?"),
    ("上文/下文 (the text above/below)", r"[上下]文(?!件)"),
    ("如下 (as follows)", r"如下(?![雨雪棋])"),
    ("如上 (as above)", r"如上(?![海市午升涨])"),
    ("本章/本节/本文/本段 (this chapter/section/text/paragraph)", r"本[章节文段]"),
    ("文中 (in the text)", r"文中"),
    ("上述 (the above)", r"上述"),
    ("原文 (the original text)", r"原文"),
    ("这篇/该篇 (this article)", r"[这该此本]篇"),
    ("这段文字 (this passage)", r"[这该此上下]段(?:文字|话|材料|内容|代码|文本|引文)"),
    ("下列/以下/以上 (the following/above)",
     r"下列|以下(?=哪|关于|选项|内容|代码|说法|描述|几|是|各|步骤)"
     r"|以上(?=哪|关于|选项|内容|代码|说法|描述|几|都|所述|各|步骤)"),
    ("作者提到 (the author mentions)",
     r"作者(?:提到|认为|指出|说|写道|描述|强调|提出|表示|所说|的观点|在文)"),
    ("根据材料 (according to the material)", r"根据(?:材料|文章|段落|资料|短文|这段|上下文)"),
)

_EN_REGEXES = tuple(re.compile(p, re.IGNORECASE) for _, p in EN_PATTERNS)
_ZH_REGEXES = tuple(re.compile(p) for _, p in ZH_PATTERNS)
_ZH_COMPOUNDS = re.compile("|".join(sorted(ZH_NOT_REFERENCES, key=len, reverse=True)))
# Patterns whose own words may sit inside a compound (作者表示 is a reference although 表示
# alone is not): these are not checked against `ZH_NOT_REFERENCES`.
_ZH_UNCHECKED = {"作者提到 (the author mentions)", "根据材料 (according to the material)"}
_ZH_CHECKED = tuple(name not in _ZH_UNCHECKED for name, _ in ZH_PATTERNS)


def context_reference(text: str) -> str | None:
    """The phrase that points at context the reader cannot see, or None.

    The earliest match of `EN_PATTERNS` and `ZH_PATTERNS` in the NFKC text (the longest of
    those starting at the same place), as it appears there: "Figure 3", "the following
    equation", "according to the passage", "上图"."""
    text = _nfkc(text)
    best: tuple[int, int] | None = None

    def consider(start: int, end: int) -> None:
        nonlocal best
        if best is None or start < best[0] or (start == best[0] and end > best[1]):
            best = (start, end)

    for regex in _EN_REGEXES:
        m = regex.search(text)
        if m:
            consider(m.start(), m.end())
    if _CJK_CHAR.search(text):
        compounds = [m.span() for m in _ZH_COMPOUNDS.finditer(text)]
        for regex, checked in zip(_ZH_REGEXES, _ZH_CHECKED):
            for m in regex.finditer(text):
                s, e = m.span()
                if checked and any(s < ce and cs < e for cs, ce in compounds):
                    continue
                consider(s, e)
                break
    return None if best is None else text[best[0]:best[1]].strip()


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
    return frozenset(
        _key(tok) for tok in _tokens(text) if tok not in EN_STOPWORDS and tok not in ZH_STOPWORDS
    )


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


def check_pair(
    question: str, answer: str, chunk: str, settings: Any
) -> tuple[str | None, dict[str, float]]:
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
    if q_len < _setting(settings, "min_question_chars") or a_len < _setting(
        settings, "min_answer_chars"
    ):
        return "too_short", scores
    if q_len > _setting(settings, "max_question_chars") or a_len > _setting(
        settings, "max_answer_chars"
    ):
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
