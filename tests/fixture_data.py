"""The data that conftest.py's fixtures are made of, and the stand-ins tests hand to recipes.

`SMS_LINES` (the messages of the `sms_file` fixture), `write_tiktoken` and `SMALL_MERGES` (the
format and merges of the `small_tokenizer` fixture), `FakeRun` (records what a recipe logs,
instead of MLflow) and `FakeJudge` (the endpoint of the `fake_judge` fixture: an LLM judge on
127.0.0.1).
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

from chat_endpoint import ChatEndpoint

from gptforge.runtime.tracking import NullRun  # imported after conftest.py has set the environment


class FakeRun(NullRun):
    """Records what a recipe logs, instead of MLflow."""

    def __init__(self):
        self.metrics: list[dict] = []
        self.artifacts: list[Path] = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append(Path(path))


def write_tiktoken(path: Path, tokens: list[bytes]) -> Path:
    """A `.tiktoken` rank file: the 256 single bytes, then `tokens` in rank order."""
    ranks = [bytes([i]) for i in range(256)] + tokens
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return path


# Merges in rank order; each is the concatenation of two earlier tokens.
SMALL_MERGES = [
    b"th",
    b"he",
    b"the",
    b" t",
    b" the",
    b"in",
    b"ing",
    b"  ",
    b"\n\n",
    b"er",
    b" a",
    b"an",
    b"and",
    b" and",
    b"ou",
    b"is",
    b" is",
    b"re",
    b"on",
    b" o",
    b" of",
    b"e ",
    b".\n",
    b"\r\n",
]


SMS_LINES = [
    ("ham", "Hey, are we still on for lunch tomorrow?"),
    ("spam", "WINNER!! You have won a 1000 cash prize. Call 09061701461 now"),
    ("ham", "I'll be home by 7, see you then"),
    ("spam", "Free entry in 2 a wkly comp to win FA Cup final tkts. Text FA to 87121"),
    ("ham", "Can you pick up some milk on the way?"),
    ("spam", "URGENT! Your mobile number has been awarded a 2000 prize. Call now"),
    ("ham", "Ok lar... Joking wif u oni..."),
    ("ham", "Sorry, I'll call later"),
    ("spam", "Congratulations ur awarded 500 of CD vouchers. Text GO to 83600"),
    ("ham", "Did you finish the report?"),
]


class FakeJudge(ChatEndpoint):
    """The instruct stage's judge: "85" when the response equals the reference, "I think 150"
    when the response mentions "overflow", "Score: 12" otherwise."""

    def answer(self, body: dict) -> str:
        prompt = body["messages"][0]["content"]
        reference = re.search(r"correct output `(.*?)`, score", prompt, re.S).group(1)
        response = re.search(r"model response `(.*?)` on a scale", prompt, re.S).group(1)
        return "85" if response == reference else "I think 150" if "overflow" in response else "Score: 12"
