"""synthesize.filters against hand-written pairs: every reason with a pair that has it and one
that does not, every context-reference pattern and the look-alikes that are not references,
grounding fractions worked out by hand, normalization, deduplication and its indices."""

from __future__ import annotations

import random
import re
import types
from collections import Counter
from fractions import Fraction

import pytest

from gptforge.synthesize.filters import (
    DEFAULTS,
    REASONS,
    check_pair,
    deduplicate,
    grounding,
    near_duplicate_score,
)
from gptforge.synthesize.references import EN_PATTERNS, ZH_PATTERNS, context_reference
from gptforge.synthesize.text import normalize_question

SETTINGS = types.SimpleNamespace(**DEFAULTS)
CHUNK = (
    "Rice is a cereal grain and the staple food of over half the world's population. "
    "Paddy rice grows in flooded fields; the water suppresses weeds. "
    "Asia produces about 90 percent of the world's rice."
)
GOOD_Q = "Why is paddy rice grown in flooded fields?"
GOOD_A = "The water in flooded fields suppresses weeds."


def test_defaults_and_reasons():
    assert DEFAULTS == {
        "min_question_chars": 10,
        "max_question_chars": 300,
        "min_answer_chars": 2,
        "max_answer_chars": 1500,
        "min_grounding": 0.5,
        "near_duplicate": 0.7,
    }
    assert REASONS == (
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


# --- context_reference -------------------------------------------------------------------

# (text, the phrase found): at least one per entry of EN_PATTERNS / ZH_PATTERNS.
REFERENCES = [
    # numbered figure/table/listing/equation/page
    ("What does Figure 3 show?", "Figure 3"),
    ("What is plotted in Fig. 2b?", "Fig. 2b"),
    ("What does Table 2.1 list?", "Table 2.1"),
    ("What does Listing 4 print?", "Listing 4"),
    ("How is Eq. (3) derived?", "Eq. (3)"),
    ("What does equation 5 describe?", "equation 5"),
    ("What is explained on page 12?", "page 12"),
    # roman-numbered
    ("What does Table IV report?", "Table IV"),
    # ... above / below
    ("What trend does the chart below show?", "chart below"),
    ("What is the slope of the graph above?", "graph above"),
    # this / the following + figure, table, page, ...
    ("What does this table summarize?", "this table"),
    ("What is described in the following equation?", "the following equation"),
    ("What is on the next page?", "the next page"),
    ("What does this figure illustrate?", "this figure"),
    ("What is in these images?", "these images"),
    # this + chapter/section/document/article/excerpt/passage
    ("What does this chapter cover?", "this chapter"),
    ("What is defined in this section?", "this section"),
    ("Who wrote this document?", "this document"),
    ("What does this article argue?", "this article"),
    ("Where does this excerpt come from?", "this excerpt"),
    ("What does this passage describe?", "this passage"),
    ("What did the present study find?", "the present study"),
    # the figure
    ("What does the figure show?", "the figure"),
    # in/from the table, the table shows
    ("Which value is highest in the table?", "in the table"),
    ("Which tool does the table list?", "the table list"),
    # the passage, the excerpt/snippet
    ("What is the main idea of the passage?", "the passage"),
    ("What does the snippet print?", "the snippet"),
    # the text above/below/says, in the text, in the document
    ("What does the text above say about rice?", "the text above"),
    ("What is described in the text?", "in the text"),
    ("What is explained in the document?", "in the document"),
    # the above, above-mentioned, aforementioned
    ("Summarize the above.", "the above"),
    ("Why does the above-mentioned method fail?", "the above"),
    ("What is the aforementioned method?", "aforementioned"),
    # the following
    ("List the following items.", "the following"),
    # the author(s) mention, the author's
    ("What do the authors mention about sleep?", "the authors mention"),
    ("What does the author argue?", "the author argue"),
    ("What is the author's main argument?", "the author's"),
    # according to / based on
    ("According to the text, what is rice?", "According to the text"),
    ("According to the passage, why do weeds die?", "According to the passage"),
    ("According to the document, who pays?", "According to the document"),
    ("According to the chunk, what grows?", "According to the chunk"),
    ("According to the context, what is X?", "According to the context"),
    ("Based on the information provided, what is X?", "Based on the information"),
    ("As shown in the figure above, what grows?", "As shown in the figure"),
    # mentioned/shown above/below, earlier
    ("Which method was mentioned above?", "mentioned above"),
    ("What is shown below?", "shown below"),
    ("What was discussed earlier?", "discussed earlier"),
    # as mentioned,
    ("As mentioned, what is X?", "As mentioned"),
    # in the context / this context
    ("What does 'bank' mean in the context?", "in the context"),
    ("What does 'bank' mean in this context?", "this context"),
    # full-width forms are folded first
    ("What does Ｆｉｇｕｒｅ　３ show?", "Figure 3"),
    # Chinese
    ("图1中的曲线说明什么？", "图1"),
    ("如上图所示，光合作用产生什么？", "如上"),
    ("上图说明了什么？", "上图"),
    ("这张图片里有什么？", "图"),
    ("根据图表，销量如何变化？", "图"),
    ("表2列出了哪些数据？", "表2"),
    ("附表中有几列？", "附表"),
    ("上文提到的方法是什么？", "上文"),
    ("下文将介绍什么？", "下文"),
    ("如下所示的代码输出什么？", "如下"),
    ("如上所述，光合作用需要什么？", "如上"),
    ("本章讨论了什么？", "本章"),
    ("本节的主要内容是什么？", "本节"),
    ("本文提出了什么方法？", "本文"),
    ("文中提到的人物是谁？", "文中"),
    ("上述方法有什么缺点？", "上述"),
    ("原文如何描述秋天？", "原文"),
    ("这篇文章的主旨是什么？", "这篇"),
    ("这段文字的主旨是什么？", "这段文字"),
    ("以下哪个是质数？", "以下"),
    ("下列说法正确的是哪个？", "下列"),
    ("作者表示什么？", "作者表示"),
    ("根据材料，水稻生长在哪里？", "根据材料"),
    # English and Chinese mixed: the earliest wins
    ("In Figure 2, 哪条曲线最高？", "Figure 2"),
]

# Look-alikes that are not references.
NOT_REFERENCES = [
    # figure out / figure of speech / a key figure / fig the fruit
    "How do you figure out the area of a circle?",
    "How can we figure it out quickly?",
    "Who was a key figure in the Reformation?",
    "What is a figure of speech?",
    "What is the figure of speech in 'time flies'?",
    "What is a fig?",
    # table inside other words, and tables that are the topic
    "Which vegetable is rich in iron?",
    "Why is the chair comfortable?",
    "Is the compound stable at room temperature?",
    "What is the periodic table?",
    "How much table salt is safe per day?",
    "What is table tennis?",
    "How are tables created in SQL?",
    # page
    "What is a web page?",
    "How does a webpage load?",
    "What is a homepage?",
    "Which web page lists the prices?",
    # equations written out
    "Solve the equation 2x + 3 = 7.",
    # the following <time>, the following ...: inline content
    "What happened the following year?",
    "Which of the following is a prime number: 4, 6, 7?",
    # passage of / context of / author of
    "When was the passage of the Civil Rights Act?",
    "What does overfitting mean in the context of machine learning?",
    "Who is the author of Hamlet?",
    # plain questions
    "Who discovered penicillin?",
    "Why is paddy rice grown in flooded fields?",
    # Chinese compounds: 图书, 地图, 图灵, 试图, 图像; 表达, 表示, 代表, 发表, 列表, 手表;
    # 日本, 文本; 中文; 例如; 上下文学习; 这段时间; 以下 as "under"
    "图书馆几点开门？",
    "这张地图的比例尺是多少？",
    "什么是图灵测试？",
    "他试图证明什么？",
    "图像识别有哪些应用？",
    "如何表达感谢？",
    "这个符号表示什么？",
    "谁代表中国参加比赛？",
    "他发表了哪篇论文？",
    "什么是链表？",
    "手表为什么会变慢？",
    "日本文化有什么特点？",
    "什么是文本文件？",
    "在中文中，“的”怎么用？",
    "例如上海有哪些景点？",
    "什么是上下文学习？",
    "这段时间发生了什么？",
    "18岁以下的人能投票吗？",
    "光合作用需要什么条件？",
]


@pytest.mark.parametrize("text, phrase", REFERENCES)
def test_context_reference_finds(text, phrase):
    assert context_reference(text) == phrase


@pytest.mark.parametrize("text", NOT_REFERENCES)
def test_context_reference_look_alikes(text):
    assert context_reference(text) is None


def test_every_pattern_is_exercised():
    """Each English and Chinese pattern has a positive example in REFERENCES."""
    texts = [text for text, _ in REFERENCES]
    for name, pattern in EN_PATTERNS:
        regex = re.compile(pattern, re.IGNORECASE)
        assert any(regex.search(t) for t in texts), name
    for name, pattern in ZH_PATTERNS:
        assert any(re.search(pattern, t) for t in texts), name


def test_context_reference_case_and_answers():
    assert context_reference("WHAT DOES THIS PASSAGE SAY?") == "THIS PASSAGE"
    assert context_reference("As shown in Table 1, rice needs water.") == "Table 1"
    assert context_reference("") is None


# --- grounding ---------------------------------------------------------------------------


def test_grounding_hand_computed():
    # answer content words: eiffel, tower, completed, 1889, gustave, company ("the", "was",
    # "in", "by", "'s" are stopwords; "eiffel" twice counts once): 6. The chunk has all but
    # "completed" (it says "finished").
    answer = "The Eiffel Tower was completed in 1889 by Gustave Eiffel's company."
    chunk = "The Eiffel Tower, finished in 1889, was designed by the company of Gustave Eiffel."
    assert Fraction(grounding(answer, chunk)).limit_denominator(100) == Fraction(5, 6)
    assert grounding(answer, chunk) == 5 / 6


def test_grounding_cjk_characters():
    # 光 合 作 用 产 生 氧 气: 8 content characters; the chunk has all but 产 生.
    assert grounding("光合作用产生氧气", "植物通过光合作用制造氧气。") == 6 / 8
    # particles (的, 是, 了) are not content: 水稻 / 水稻
    assert grounding("是水稻的了", "水稻") == 1.0


def test_grounding_stem_is_a_five_letter_prefix_without_plural_s():
    # plural and tense: produces/produced, plants/plant -> "produ", "plant"
    assert grounding("Oxygen is produced by plants.", "A plant produces oxygen.") == 1.0
    # short plurals: trees/tree, cities/city; -ss is not a plural
    assert grounding("Trees in cities.", "A tree in a city.") == 1.0
    assert grounding("glass", "glas") == 0.0
    # the price of the prefix: informal ~ information
    assert grounding("informal", "information") == 1.0
    # below five letters the whole word counts
    assert grounding("cat", "car") == 0.0
    assert grounding("Cats and dogs.", "a cat, a dog and a car") == 1.0
    # numbers (anything with a digit) are content and compared whole
    assert grounding("It was 123456.", "The code was 123457.") == 0.0
    assert grounding("In 1889.", "Finished in 1889.") == 1.0


def test_grounding_case_width_and_empty():
    assert grounding("ＲＩＣＥ", "rice") == 1.0
    assert grounding("Yes, it is.", "anything") == 1.0  # no content word
    assert grounding("", "anything") == 1.0
    assert grounding("Bananas ripen on palms.", CHUNK) == 0.0
    assert grounding("Bananas grow on trees.", CHUNK) == 1 / 3  # "grows" is in the chunk


# --- normalize_question ------------------------------------------------------------------


def test_normalize_question():
    assert normalize_question("ＷＨＡＴ　ｉｓ　ｘ？") == "what is x"
    assert normalize_question("  What   is X?! ") == "what is x"
    assert normalize_question("Is it well-known?") == normalize_question("is it well known")
    assert normalize_question("什么是光合作用？") == "什么是光合作用"
    assert normalize_question("你好，世界。") == normalize_question("你好世界")
    assert normalize_question("Straße?") == "strasse"


# --- check_pair ----------------------------------------------------------------------------


def test_check_pair_good_pair():
    reason, scores = check_pair(GOOD_Q, GOOD_A, CHUNK, SETTINGS)
    assert reason is None
    assert set(scores) == {"grounding"}
    assert scores["grounding"] == 1.0


@pytest.mark.parametrize(
    "question, answer, reason",
    [
        ("", GOOD_A, "empty"),
        (GOOD_Q, "   ", "empty"),
        ("Why?", GOOD_A, "too_short"),
        (GOOD_Q, "A", "too_short"),
        ("Why is rice grown in " + "very " * 80 + "wet fields?", GOOD_A, "too_long"),
        (GOOD_Q, "Weeds. " * 300, "too_long"),
        ("Paddy rice is grown in flooded fields.", GOOD_A, "not_a_question"),
        ("Rice and the flooding of fields", GOOD_A, "not_a_question"),
        ("What is paddy rice?", "Paddy rice.", "repeats_question"),
        (GOOD_Q, "Why is paddy rice grown in flooded fields", "repeats_question"),
        (GOOD_Q, "Paddy rice is grown in flooded fields why", "repeats_question"),
        ("What does the passage say about weeds?", GOOD_A, "not_self_contained"),
        (GOOD_Q, "As shown in Figure 2, the water suppresses weeds.", "not_self_contained"),
        (GOOD_Q, "Farmers like the taste of swamp bananas.", "ungrounded"),
    ],
)
def test_check_pair_reasons(question, answer, reason):
    assert check_pair(question, answer, CHUNK, SETTINGS)[0] == reason


@pytest.mark.parametrize(
    "question, answer",
    [
        # question shapes: a question mark, an interrogative or instruction word, Chinese
        ("Explain why paddy rice is grown in flooded fields", GOOD_A),
        ("Describe how paddy fields suppress weeds", GOOD_A),
        ("Paddy fields are flooded for what reason?", GOOD_A),
        ("水稻为什么种在水田里", "水田里的水能抑制杂草。"),
        ("请说明水稻为什么种在水田里。", "水田里的水能抑制杂草。"),
        ("水稻种在水田里吗", "是的，水田里的水能抑制杂草。"),
        # answers inside the question are fine for a choice, and yes/no
        ("Which grows in flooded fields, paddy rice or wheat?", "Paddy rice."),
        ("Does paddy rice grow in flooded fields?", "Yes."),
        # the shortest accepted lengths: 10 columns, 2 columns; a CJK character is 2 columns
        ("Why weeds?", "Water suppresses weeds."),
        ("水稻种在哪？", "水田"),
    ],
)
def test_check_pair_accepts(question, answer):
    chunk = CHUNK + " 水稻种在水田里，水田里的水能抑制杂草。"
    assert check_pair(question, answer, chunk, SETTINGS) == (None, {"grounding": 1.0})


def test_check_pair_length_limits_from_settings():
    tight = types.SimpleNamespace(**{**DEFAULTS, "min_question_chars": 60, "max_answer_chars": 20})
    assert check_pair(GOOD_Q, GOOD_A, CHUNK, tight)[0] == "too_short"
    loose = types.SimpleNamespace(**{**DEFAULTS, "max_answer_chars": 20})
    assert check_pair(GOOD_Q, GOOD_A, CHUNK, loose)[0] == "too_long"
    # a partial settings object or a mapping takes the defaults for what it lacks
    assert check_pair(GOOD_Q, GOOD_A, CHUNK, types.SimpleNamespace())[0] is None
    assert check_pair(GOOD_Q, GOOD_A, CHUNK, {"min_grounding": 0.5})[0] is None
    assert check_pair("什么是水稻？", "谷物", CHUNK, None)[0] != "too_short"  # 12 columns


def test_check_pair_min_grounding():
    answer = "Paddy rice suppresses bananas."  # paddy, rice, suppresses found; bananas not
    reason, scores = check_pair(GOOD_Q, answer, CHUNK, SETTINGS)
    assert (reason, scores["grounding"]) == (None, 3 / 4)
    strict = types.SimpleNamespace(**{**DEFAULTS, "min_grounding": 0.8})
    assert check_pair(GOOD_Q, answer, CHUNK, strict) == ("ungrounded", {"grounding": 3 / 4})


def test_check_pair_reason_order():
    # shape before self-containment before grounding; the grounding score comes every time
    ungrounded_ref = "As shown in Figure 2, bananas ripen on palms."
    assert check_pair("Weeds in the passage above", ungrounded_ref, CHUNK, SETTINGS) == (
        "not_a_question",
        {"grounding": 0.0},
    )
    assert check_pair("Why?", ungrounded_ref, CHUNK, SETTINGS)[0] == "too_short"
    assert check_pair("", "", CHUNK, SETTINGS)[0] == "empty"
    assert check_pair(GOOD_Q, ungrounded_ref, CHUNK, SETTINGS)[0] == "not_self_contained"
    assert (
        check_pair("What does this passage say?", "What does this passage say", CHUNK, SETTINGS)[0]
        == "repeats_question"
    )
    assert check_pair(GOOD_Q, "Bananas ripen on palms.", CHUNK, SETTINGS)[0] == "ungrounded"


# --- near duplicates -------------------------------------------------------------------------

X = ("What is X?", "X is a fruit that grows on trees.")
Y = ("What is Y?", "Y is a vegetable that grows underground.")


def test_near_duplicate_score():
    # bigrams of "what is x x is a fruit that grows on trees" (10) and of the Y pair (9)
    # share "what is", "is a", "that grows": 3 / 16
    assert near_duplicate_score(X, Y) == 3 / 16
    assert near_duplicate_score(X, X) == 1.0
    # one word added: 9 shared of 12
    assert near_duplicate_score(X, ("What exactly is X?", X[1])) == 9 / 12
    # one word removed: 8 shared of 11
    assert near_duplicate_score(X, ("What is X?", "X is fruit that grows on trees.")) == 8 / 11
    # case, width and punctuation do not count
    assert near_duplicate_score(X, ("ＷＨＡＴ　ＩＳ　Ｘ", "x is a fruit, that grows on trees")) == 1.0
    # CJK: character bigrams 光合 合作 作用 / 光合 合作 作用 用很 很重 重要
    assert near_duplicate_score(("光合作用", ""), ("光合作用很重要", "")) == 3 / 6


def test_deduplicate_keeps_first_and_points_back():
    pairs = [
        ("What exactly is X?", X[1]),  # 0 kept
        Y,  # 1 kept: 3/16 of X
        ("What is X?", X[1]),  # 2: one word removed from 0
        ("What exactly is Y?", Y[1]),  # 3: one word added to 1
        ("ＷＨＡＴ　ｅｘａｃｔｌｙ　ｉｓ　ｘ？", "Something else entirely."),  # 4: same question as 0
        ("what is y", "A different answer."),  # 5: same question as 1
        ("What is Z?", "Z is a mineral found in caves."),  # 6 kept
    ]
    assert deduplicate(pairs, SETTINGS) == [
        None,
        None,
        ("near_duplicate", 0),
        ("near_duplicate", 1),
        ("duplicate", 0),
        ("duplicate", 1),
        None,
    ]


def test_deduplicate_full_and_half_width_questions():
    pairs = [("what is x?", "One."), ("ＷＨＡＴ　ｉｓ　ｘ？", "Two.")]
    assert deduplicate(pairs, SETTINGS) == [None, ("duplicate", 0)]


def test_deduplicate_points_at_kept_pairs_only_and_the_most_similar():
    a = ("How do paddy fields suppress weeds in rice farming?", "Flooding drowns the weeds.")
    b = ("How do paddy fields suppress weeds in rice farming today?", "Flooding drowns the weeds.")
    c = ("How do paddy fields suppress weeds in rice farming today?", "Flooding drowns weeds.")
    loose = types.SimpleNamespace(near_duplicate=0.5)
    # b is dropped as a near-duplicate of a; c's question repeats b's, but b was not kept,
    # so c is compared with a
    result = deduplicate([a, b, c], loose)
    assert result[:2] == [None, ("near_duplicate", 0)]
    assert result[2] == ("near_duplicate", 0)
    # of two kept pairs, the more similar one is named
    d = ("How do paddy fields suppress weeds in rice farming now?", "Flooding drowns the weeds.")
    assert deduplicate([X, Y, a, d], loose) == [None, None, None, ("near_duplicate", 2)]


def test_deduplicate_threshold():
    pairs = [X, Y]
    assert deduplicate(pairs, types.SimpleNamespace(near_duplicate=0.1)) == [
        None,
        ("near_duplicate", 0),
    ]
    assert deduplicate(pairs, types.SimpleNamespace(near_duplicate=3 / 16)) == [
        None,
        ("near_duplicate", 0),
    ]
    assert deduplicate(pairs, types.SimpleNamespace(near_duplicate=0.19)) == [None, None]
    # above 1: near-duplicates off, exact duplicates still found
    off = types.SimpleNamespace(near_duplicate=1.01)
    assert deduplicate([X, X, ("what is x", "")], off) == [
        None,
        ("duplicate", 0),
        ("duplicate", 0),
    ]
    with pytest.raises(ValueError):
        deduplicate(pairs, types.SimpleNamespace(near_duplicate=0))
    assert deduplicate([], SETTINGS) == []


def test_deduplicate_matches_all_pairs_comparison():
    """The inverted index finds exactly what comparing every kept pair would."""
    rng = random.Random(7)
    vocab = [f"w{i}" for i in range(40)] + list("光合作用产生氧气")
    bases = [[rng.choice(vocab) for _ in range(rng.randint(2, 12))] for _ in range(40)]
    pairs = []
    for _ in range(200):
        words = list(rng.choice(bases))
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.5 and len(words) > 2:
                del words[rng.randrange(len(words))]
            else:
                words.insert(rng.randrange(len(words) + 1), rng.choice(vocab))
        cut = rng.randint(1, len(words))
        pairs.append((" ".join(words[:cut]) + "?", " ".join(words[cut:])))
    score_cache: dict[tuple[int, int], float] = {}

    def score(i: int, j: int) -> float:
        if (i, j) not in score_cache:
            score_cache[i, j] = near_duplicate_score(pairs[i], pairs[j])
        return score_cache[i, j]

    for threshold in (0.4, 0.7, 0.95):
        expected, kept, questions = [], [], {}
        for i, pair in enumerate(pairs):
            key = normalize_question(pair[0])
            if key in questions:
                expected.append(("duplicate", questions[key]))
                continue
            scores = [(score(i, j), -j) for j in kept]
            best = max(scores, default=(-1.0, 0))
            if best[0] >= threshold:
                expected.append(("near_duplicate", -best[1]))
                continue
            kept.append(i)
            questions[key] = i
            expected.append(None)
        settings = types.SimpleNamespace(near_duplicate=threshold)
        assert deduplicate(pairs, settings) == expected, threshold
        found = Counter(r[0] for r in expected if r is not None)
        assert found["near_duplicate"] > 10 and found["duplicate"] > 0, (threshold, found)
