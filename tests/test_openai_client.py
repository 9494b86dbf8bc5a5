"""The one OpenAI-compatible client (judge and synthesize) and the reply parsing of synthesize,
against a scripted server and hand-written replies."""

from __future__ import annotations

import json

import pytest
from chat_endpoint import ChatEndpoint

from gptforge.openai_client import BadReply, ChatClient, EndpointError
from gptforge.synthesize.generate import Unparseable, pair_fields, parse_pairs, parse_rating, parse_verdict


class Scripted(ChatEndpoint):
    def __init__(self, answers):
        super().__init__()
        self.answers = list(answers)

    def answer(self, body):
        return self.answers.pop(0)


def test_retry_after_is_honoured_and_the_usage_counts_come_back(no_proxy):
    server = Scripted([(429, {"error": {"message": "slow down"}}), (503, {"detail": "warming up"}), "hello"])
    sleeps = []
    try:
        client = ChatClient(server.url, "m", retries=2, backoff=0.5, sleep=sleeps.append)
        # the Retry-After header is not sent by this server: the doubling backoff applies
        done = client.complete([{"role": "user", "content": "hi"}], temperature=0)
    finally:
        server.close()
    assert done.content == "hello" and done.finish_reason == "stop"
    assert done.completion_tokens == 1 and done.prompt_tokens > 0 and done.seconds >= 0
    assert sleeps == [0.5, 1.0] and len(server.requests) == 3
    assert server.requests[0]["body"] == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
    }


def test_a_4xx_is_raised_at_once_with_the_server_s_message(no_proxy):
    server = Scripted([(401, {"error": {"message": "Incorrect API key provided"}})])
    try:
        with pytest.raises(EndpointError) as failed:
            ChatClient(server.url, "m", retries=3, sleep=lambda s: None).complete([])
    finally:
        server.close()
    assert failed.value.status == 401 and failed.value.detail == "Incorrect API key provided"
    assert len(server.requests) == 1


def test_a_reply_that_is_not_a_chat_completion_is_bad_reply(no_proxy):
    class NotChat(ChatEndpoint):
        def answer(self, body):
            return 200, {"choices": []}

    server = NotChat()
    try:
        with pytest.raises(BadReply):
            ChatClient(server.url, "m").complete([])
    finally:
        server.close()


PAIR = {"question": "Where does the Rhine rise?", "answer": "In the Swiss Alps."}


@pytest.mark.parametrize(
    "content",
    [
        json.dumps([PAIR]),
        "```json\n" + json.dumps([PAIR], indent=2) + "\n```",
        "Here you go:\n```\n" + json.dumps([PAIR]) + "\n```\nAnything else?",
        json.dumps({"pairs": [PAIR]}),  # a json_schema endpoint's wrapper object
        json.dumps(PAIR),  # one object alone
        "Sure! " + json.dumps([PAIR]) + " Hope this helps.",
    ],
)
def test_pairs_are_found_in_the_shapes_endpoints_reply_in(content):
    assert [pair_fields(item) for item in parse_pairs(content)] == [(PAIR["question"], PAIR["answer"])]


@pytest.mark.parametrize(
    "content", ["", "I cannot help with that.", '[{"question": "x", "answer": "y"', json.dumps({"a": [1], "b": [2]})]
)
def test_replies_without_an_array_are_unparseable(content):
    with pytest.raises(Unparseable):
        parse_pairs(content)


def test_items_that_are_not_two_strings_are_malformed():
    assert [pair_fields(i) for i in [PAIR, {"q": "x"}, {"question": 1, "answer": "y"}, "text"]] == [
        (PAIR["question"], PAIR["answer"]),
        None,
        None,
        None,
    ]


def test_verdicts_and_ratings():
    assert [parse_verdict(t) for t in ["Yes.", "no", " NO, it does not", "maybe"]] == [True, False, False, None]
    assert [parse_rating(t) for t in ["8", "Rating: 7.5/10", "11", "none"]] == [8.0, 7.5, None, None]
