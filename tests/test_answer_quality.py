"""Answer quality of instruction responses: reference metrics by hand, and the LLM judge against a
fake OpenAI-compatible server on 127.0.0.1 (no network, no model)."""

from __future__ import annotations

import json
import logging
import socket
import time
import types
import urllib.request

import pytest
from fixture_data import FakeJudge

from gptforge import openai_client
from gptforge.errors import BadInput
from gptforge.finetune import answer_quality as Q

# ---------------------------------------------------------------------------------------------
# Reference metrics


def test_exact_match_and_token_f1_by_hand():
    rows = [
        # normalized both sides: "cat sat on mat" -> EM 1, F1 1
        {"reference": "cat sat on mat", "response": "The cat sat, on the mat."},
        # "big dog" vs "dog barked": 1 common token, P = R = 1/2 -> EM 0, F1 0.5
        {"reference": "the dog barked", "response": "A big dog"},
        # both empty -> EM 1, F1 1
        {"reference": "", "response": ""},
        # one empty -> EM 0, F1 0
        {"reference": "Paris", "response": ""},
    ]
    scores = Q.reference_scores(rows)
    assert scores["n_scored"] == 4
    assert scores["exact_match"] == pytest.approx((1 + 0 + 1 + 0) / 4)
    assert scores["token_f1"] == pytest.approx((1 + 0.5 + 1 + 0) / 4)
    # Articles alone normalize to nothing, so they equal an empty reference.
    assert Q.exact_match("The", "") == 1.0 and Q.token_f1("a an the", "") == 1.0
    # Repeated tokens match as often as both sides have them: common = min(2, 1) = 1, P = 1/3,
    # R = 1/2 -> F1 = 0.4; and common = min(2, 2) = 2, P = R = 2/3 -> F1 = 2/3.
    assert Q.token_f1("red red blue", "red green") == pytest.approx(0.4)
    assert Q.token_f1("red red blue", "red red green") == pytest.approx(2 / 3)
    assert Q.reference_scores([]) == {"n_scored": 0}
    # distinct_share: "cat sat on mat" 4/4, "big dog" 2/2, the two empty answers 0
    assert scores["distinct_share"] == pytest.approx((1 + 1 + 0 + 0) / 4)


def test_distinct_share_counts_repetition():
    assert Q.distinct_share("is is is is") == 0.25
    assert Q.distinct_share("The cat saw the dog.") == 1.0  # articles are normalized away
    assert Q.distinct_share("red red blue") == pytest.approx(2 / 3)
    assert Q.distinct_share("") == 0.0


def test_rouge_l_is_lcs_f_measure():
    reference = "quick brown fox jumps over lazy dog"  # 7 tokens
    response = "brown fox leaps over the dog"  # 6 tokens; no word shares a stem with another
    # LCS by hand: brown fox over dog -> 4.  P = 4/6, R = 4/7, F = 2PR/(P+R) = 8/13.
    p, r = 4 / 6, 4 / 7
    scores = Q.reference_scores([{"reference": reference, "response": response}])
    assert scores["rouge_l"] == pytest.approx(2 * p * r / (p + r))
    assert scores["rouge_l"] == pytest.approx(8 / 13)
    assert scores["exact_match"] == 0.0


# ---------------------------------------------------------------------------------------------
# The judge against a fake OpenAI-compatible server


ROWS = [
    {"instruction": "Name the capital of France.", "input": "", "reference": "Paris", "response": "Paris"},
    {
        "instruction": "Convert to passive voice.",
        "input": "The cat chased the mouse.",
        "reference": "The mouse was chased by the cat.",
        "response": "The cat was chasing.",
    },
    {"instruction": "Say something.", "input": "", "reference": "Hello.", "response": "stack overflow"},
]


def test_judge_prompt_model_header_and_scores(fake_judge):
    result = Q.judge_scores(ROWS, url=fake_judge.url + "/", model="llama3.2:1b", api_key="sk-test")
    assert result.scores == [85, 12, None]  # "I think 150" is out of range: unscored
    assert result.mean == pytest.approx((85 + 12) / 2)
    assert result.unscored == 1 and result.error is None
    assert len(fake_judge.requests) == 3
    for row, request in zip(ROWS, fake_judge.requests):
        body = request["body"]
        assert request["path"] == "/v1/chat/completions"
        assert request["headers"]["Authorization"] == "Bearer sk-test"
        assert body["model"] == "llama3.2:1b" and body["temperature"] == 0 and body["max_tokens"] == 16
        prompt = body["messages"][0]["content"]
        for key in ("instruction", "reference", "response"):
            assert row[key] in prompt
        assert prompt.startswith("Given the input `Below is an instruction that describes a task. ")
        assert prompt.endswith("Respond with the integer number only.")
    with_input = fake_judge.requests[1]["body"]["messages"][0]["content"]
    assert "### Instruction:\nConvert to passive voice.\n\n### Input:\nThe cat chased the mouse.`" in with_input
    assert "### Input" not in fake_judge.requests[0]["body"]["messages"][0]["content"]


def test_judge_key_from_environment_and_none_without(fake_judge, monkeypatch):
    Q.judge_scores(ROWS[:1], url=fake_judge.url, model="m")
    assert "Authorization" not in fake_judge.requests[-1]["headers"]
    monkeypatch.setenv("GPTFORGE_JUDGE_API_KEY", "from-env")
    Q.judge_scores(ROWS[:1], url=fake_judge.url, model="m")
    assert fake_judge.requests[-1]["headers"]["Authorization"] == "Bearer from-env"


@pytest.mark.parametrize("status", [500, 429])
def test_judge_retries_5xx_and_429(no_proxy, status):
    judge = FakeJudge(fail_first=1, fail_status=status)
    try:
        result = Q.judge_scores(ROWS[:1], url=judge.url, model="m")
    finally:
        judge.close()
    assert len(judge.requests) == 2
    assert result.scores == [85] and result.error is None and result.unscored == 0


def test_judge_unreachable_server_gives_error_not_exception(no_proxy, monkeypatch):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    # Counted, not timed: the attempts made and the backoff asked for (no real sleeping).
    attempts, sleeps = [], []
    urlopen = urllib.request.urlopen
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **kw: attempts.append(1) or urlopen(*a, **kw))
    monkeypatch.setattr(openai_client, "time", types.SimpleNamespace(sleep=sleeps.append, monotonic=time.monotonic))
    result = Q.judge_scores(ROWS * 2, url=f"http://127.0.0.1:{port}/v1", model="m")
    # The first row is tried 3 times (backoff 0.5 + 1 s), then no other row is tried.
    assert len(attempts) == 3 and sleeps == [0.5, 1.0]
    assert result.error and "unreachable" in result.error and "\n" not in result.error
    assert result.scores == [None] * 6 and result.unscored == 6 and result.mean is None


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/v1", "127.0.0.1:11434/v1", ""])
def test_bad_judge_url_is_bad_input(url):
    with pytest.raises(BadInput, match="instruct.judge.url"):
        Q.judge_scores(ROWS, url=url, model="m")


# ---------------------------------------------------------------------------------------------
# The file


def test_score_file_with_and_without_judge(fake_judge, tmp_path, caplog, monkeypatch):
    path = tmp_path / "instruct_responses.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n\n", encoding="utf-8")  # blank lines skipped
    monkeypatch.setattr(logging.getLogger("gptforge"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="gptforge"):
        plain = Q.score_file(path)
    assert set(plain) == {"exact_match", "token_f1", "rouge_l", "distinct_share", "n_scored"} and plain["n_scored"] == 3
    assert plain["exact_match"] == pytest.approx(1 / 3)
    assert "no judge (instruct.judge.url and instruct.judge.model unset): judge score skipped" in caplog.text
    judged = Q.score_file(path, judge_url=fake_judge.url, judge_model="m")
    assert judged["judge_score"] == pytest.approx(48.5) and judged["judge_unscored"] == 1
    assert {k: judged[k] for k in plain} == plain
