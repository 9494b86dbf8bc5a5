"""Whether a question or answer points at context the reader cannot see ("as shown in Figure 3",
"according to the passage", "如上图所示"): `context_reference` and its patterns, `EN_PATTERNS` and
`ZH_PATTERNS` (with the Chinese look-alikes of `ZH_NOT_REFERENCES`). `filters.check_pair` drops
such a pair as "not_self_contained".

Context references are matched in context rather than on bare words: "Figure 3", "Table IV",
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
"""

from __future__ import annotations

import re

from gptforge.synthesize.text import _CJK_CHAR, _nfkc

__all__ = ["EN_PATTERNS", "ZH_PATTERNS", "ZH_NOT_REFERENCES", "context_reference"]


def _words(*words: str) -> str:
    return "(?:" + "|".join(words) + ")"


# Things in a document a reader of the pair alone cannot see.
_VISUAL = _words(
    "figures?",
    "tables?",
    "listings?",
    "equations?",
    "pages?",
    "diagrams?",
    "charts?",
    "graphs?",
    "images?",
    "pictures?",
    "illustrations?",
    "screenshots?",
    "plots?",
)
_DOCUMENT = _words(
    "passages?",
    "texts?",
    "chapters?",
    "sections?",
    "documents?",
    "articles?",
    "excerpts?",
    "paragraphs?",
    "snippets?",
    "chunks?",
    "materials?",
    "papers?",
    "stud(?:y|ies)",
    "books?",
    "stor(?:y|ies)",
    "reports?",
    "essays?",
    "lectures?",
    "transcripts?",
    "sources?",
    "readings?",
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
    "days?",
    "weeks?",
    "months?",
    "years?",
    "decades?",
    "centur(?:y|ies)",
    "mornings?",
    "afternoons?",
    "evenings?",
    "nights?",
    "seasons?",
    "spring",
    "summer",
    "autumn",
    "fall",
    "winter",
    "weekends?",
    "generations?",
)
_SOURCE = _words(
    "texts?",
    "passages?",
    "documents?",
    "chunks?",
    "context",
    "articles?",
    "excerpts?",
    "paragraphs?",
    "sections?",
    "chapters?",
    "authors?",
    "sources?",
    "materials?",
    "snippets?",
    "extracts?",
    "figures?",
    "tables?",
    "charts?",
    "diagrams?",
    "graphs?",
    "images?",
    "papers?",
    "stud(?:y|ies)",
    "reports?",
    "information",
    "data",
    "content",
    "readings?",
    "transcripts?",
)
_AUTHOR_VERB = _words(
    "mention",
    "state",
    "say",
    "said",
    "describe",
    "discuss",
    "argue",
    "note",
    "suggest",
    "write",
    "wrote",
    "written",
    "claim",
    "explain",
    "propose",
    "present",
    "report",
    "refer",
    "mean",
    "meant",
    "believe",
    "think",
    "thought",
    "emphasi[sz]e",
    "highlight",
    "conclude",
    "define",
    "recommend",
    "point",
    "impl(?:y|ie)",
)

#: (what it catches, regex) for English; matched case-insensitively, on word boundaries.
EN_PATTERNS: tuple[tuple[str, str], ...] = (
    (
        "numbered figure/table/listing/equation/page",
        rf"\b(?:fig(?:ure)?s?\.?|tables?|listings?|eq(?:uation)?s?\.?|pages?|charts?|diagrams?)"
        rf"\s*{_LABEL}",
    ),
    ("roman-numbered figure/table", r"\b(?:fig(?:ure)?s?\.?|tables?)\s+(?-i:[IVX]{1,4})\b(?!['’])"),
    ("figure/table/... above or below", rf"\b{_VISUAL}\s+(?:above|below)\b{_NOT_AFTER_ABOVE_BELOW}"),
    (
        "this/the following figure/table/page/...",
        rf"\b{_DETERMINER}\s+{_VISUAL}\b(?!\s*:)(?!\s+(?:out|of\s+speech|skat\w*)\b)",
    ),
    (
        "this/the following chapter/section/document/article/excerpt/passage/...",
        rf"\b{_DETERMINER}\s+{_DOCUMENT}\b(?!\s*:)",
    ),
    ("the figure", r"\bthe\s+figures?\b(?!\s+(?:out|of\s+speech|skat\w*)\b)"),
    ("in/from the table", r"\b(?:in|from|see|per)\s+the\s+tables?\b"),
    (
        "the table shows",
        r"\bthe\s+tables?\s+(?:shows?|lists?|presents?|summari[sz]es|gives|displays|illustrates"
        r"|compares|indicates)\b",
    ),
    ("the passage", r"\bthe\s+passages?\b(?!\s+of\b)(?!\s*:)"),
    ("the excerpt/snippet", r"\bthe\s+(?:excerpt|snippet)s?\b(?!\s*:)"),
    (
        "the text above/below/says",
        r"\bthe\s+text\s+(?:above|below|says|states|mentions|describes|suggests|explains|implies"
        r"|indicates|notes|discusses|shows)\b",
    ),
    (
        "in/from the text",
        r"\b(?:in|from)\s+the\s+(?:given\s+|provided\s+)?text\b(?![\s-]+(?:field|box|editor|file"
        r"|area|input|message|mode|format|string|encoding|view|widget|node|colou?r|size)s?\b)",
    ),
    (
        "in the document/article/paragraph/...",
        r"\b(?:in|from)\s+the\s+(?:document|article|paragraph|excerpt|chapter|section)s?\b"
        r"(?!\s+(?:of|by|titled|called|named)\b)",
    ),
    ("the above", r"\bthe\s+above\b"),
    ("above-mentioned / aforementioned", r"\b(?:above|below)[\s-]mentioned\b|\baforementioned\b"),
    ("the following", rf"\bthe\s+following\b(?!\s+{_TIME}\b)(?!(?:\s+[\w'’-]+){{0,4}}\s*:)"),
    (
        "the author(s) mention",
        rf"\b(?:the|this)\s+authors?\s+(?:(?:also|further|then|clearly"
        rf"|explicitly|briefly|later|first|specifically|not|mainly)\s+)?{_AUTHOR_VERB}\w*",
    ),
    ("the author's", r"\bthe\s+author(?:'s|s'|’s|s’)"),
    (
        "according to / based on the text/passage/document/chunk/context",
        rf"\b(?:according\s+to|based\s+on|as\s+(?:stated|described|mentioned|shown|explained|noted"
        rf"|discussed|outlined)\s+in)\s+(?:the|this|these)\s+(?:(?:above|given|provided|preceding"
        rf"|following|previous|original)\s+)?{_SOURCE}\b"
        rf"(?!\s+(?:from|of|by|published|written|titled|called|on)\b)",
    ),
    (
        "mentioned/shown above/below",
        rf"\b(?:mentioned|shown|described|discussed|listed|given|stated|noted|illustrated|presented"
        rf"|depicted|outlined|cited|displayed|explained|defined|provided|quoted|summari[sz]ed"
        rf"|referenced|specified|indicated|seen)\s+(?:above|below)\b{_NOT_AFTER_ABOVE_BELOW}",
    ),
    (
        "mentioned earlier/previously",
        r"\b(?:mentioned|discussed|described|stated|noted|explained|defined|shown|introduced"
        r"|listed|outlined)\s+(?:earlier|previously|before)\b"
        r"(?!\s+(?:than|the|a|an|his|her|their|its|this|that|\d))",
    ),
    (
        "as mentioned,",
        r"\bas\s+(?:previously\s+|already\s+|earlier\s+)?(?:mentioned|noted|discussed|described"
        r"|stated|explained|shown|seen|illustrated|indicated)(?=\s*[,.;)]|\s*$)",
    ),
    (
        "in the context / this context",
        r"\b(?:in\s+the|this|the\s+(?:given|provided|above|following))\s+context\b(?!\s+of\b)",
    ),
)

#: Chinese words that contain a reference character but are not references (the pattern's
#: match is dropped when it overlaps one of them): books/maps/intent/Turing/imaging (图),
#: express/represent/publish/surface/list/watch/cousin (表), Japan/basic/text/version/cost (本),
#: language names (文中 in 中文中), "for example" (如上/如下 in 例如上海), in-context learning.
ZH_NOT_REFERENCES: tuple[str, ...] = (
    # 图
    "图书",
    "地图",
    "试图",
    "企图",
    "意图",
    "力图",
    "图谋",
    "贪图",
    "宏图",
    "蓝图",
    "版图",
    "图灵",
    "图像",
    "图形",
    "图案",
    "图标",
    "图层",
    "图论",
    "图谱",
    "图纸",
    "图腾",
    "图钉",
    "图章",
    "拼图",
    "构图",
    "视图",
    "流程图",
    "思维导图",
    # 表
    "表达",
    "表示",
    "代表",
    "发表",
    "表现",
    "表面",
    "表演",
    "表情",
    "表明",
    "表扬",
    "表态",
    "表决",
    "表述",
    "表白",
    "表彰",
    "表率",
    "表皮",
    "表层",
    "表象",
    "表征",
    "表兄",
    "表姐",
    "表弟",
    "表妹",
    "表哥",
    "表亲",
    "外表",
    "手表",
    "钟表",
    "仪表",
    "电表",
    "水表",
    "列表",
    "链表",
    "哈希表",
    "散列表",
    "数据表",
    "时间表",
    "课程表",
    "日程表",
    "报表",
    "年表",
    "页表",
    "符号表",
    "路由表",
    "价目表",
    "师表",
    # 本 (本文, 本章, 本节)
    "日本",
    "基本",
    "样本",
    "文本",
    "剧本",
    "版本",
    "课本",
    "成本",
    "资本",
    "根本",
    "脚本",
    "账本",
    "书本",
    "标本",
    "副本",
    "原本",
    "范本",
    "蓝本",
    "读本",
    "笔记本",
    # 文 (文中)
    "中文",
    "英文",
    "日文",
    "法文",
    "德文",
    "韩文",
    "俄文",
    "外文",
    "语文",
    "作文",
    "公文",
    "散文",
    # 如 (如上, 如下)
    "例如",
    "比如",
    "诸如",
    "譬如",
    "假如",
    "正如",
    "犹如",
    "宛如",
    # 上下文 as a technical term
    "上下文学习",
    "上下文窗口",
    "上下文长度",
    "上下文无关",
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
    (
        "下列/以下/以上 (the following/above)",
        r"下列|以下(?=哪|关于|选项|内容|代码|说法|描述|几|是|各|步骤)"
        r"|以上(?=哪|关于|选项|内容|代码|说法|描述|几|都|所述|各|步骤)",
    ),
    ("作者提到 (the author mentions)", r"作者(?:提到|认为|指出|说|写道|描述|强调|提出|表示|所说|的观点|在文)"),
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
    return None if best is None else text[best[0] : best[1]].strip()
