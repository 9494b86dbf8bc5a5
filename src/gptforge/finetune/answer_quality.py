"""How good the instruction follower's answers are: scores of `reports/instruct_responses.jsonl`.

Each row is {instruction, input, reference, response}. Against the reference we compute
SQuAD-style normalized exact match and token F1 (lowercase, no punctuation, no a/an/the,
collapsed whitespace) and ROUGE-L F-measure, all means over rows. ROUGE-L comes from Google's
`rouge-score` package directly (stemmed; the scorer is local code): `evaluate.load("rouge")`
wraps the same package but fetches its metric script from the Hugging Face hub, which an
offline run cannot reach. Optionally an LLM judge on any OpenAI-compatible server (Ollama, vLLM,
...) scores each response 0-100 with LLMs-from-scratch ch. 7's prompt; the judge only ever
degrades to "unscored": a judge outage must not fail the fine-tuning stage.
"""

from __future__ import annotations

import json
import logging
import os
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from gptforge.errors import BadInput
from gptforge.finetune.templates import ALPACA_NO_INPUT

log = logging.getLogger("gptforge")

Row = Mapping[str, Any]
_PUNCTUATION = frozenset(string.punctuation)

# ---------------------------------------------------------------------------------------------
# Against the reference


def normalize(text: str) -> str:
    """SQuAD v1.1's normalize_answer: lowercase, drop punctuation, drop articles, fold spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(response: str, reference: str) -> float:
    return float(normalize(response) == normalize(reference))


def token_f1(response: str, reference: str) -> float:
    """SQuAD token F1 over normalized tokens; both empty -> 1.0, exactly one empty -> 0.0."""
    pred, gold = normalize(response).split(), normalize(reference).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def distinct_share(response: str) -> float:
    """Distinct normalized tokens over all tokens of one answer (1.0: no word repeats; "is is is
    is" 0.25): how much a model degenerates into repetition. An empty answer scores 0."""
    tokens = normalize(response).split()
    return len(set(tokens)) / len(tokens) if tokens else 0.0


def _text(row: Row, key: str) -> str:
    return str(row.get(key) or "")


def reference_scores(rows: Sequence[Row]) -> dict[str, float]:
    """Means over rows of exact_match, token_f1, rouge_l and distinct_share, plus n_scored;
    {"n_scored": 0} if no rows."""
    if not rows:
        return {"n_scored": 0}
    from rouge_score import rouge_scorer  # imported here: it loads nltk (~3 s)

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    em = f1 = rl = distinct = 0.0
    for row in rows:
        response, reference = _text(row, "response"), _text(row, "reference")
        em += exact_match(response, reference)
        f1 += token_f1(response, reference)
        rl += scorer.score(reference, response)["rougeL"].fmeasure  # score(target, prediction)
        distinct += distinct_share(response)
    n = len(rows)
    return {"exact_match": em / n, "token_f1": f1 / n, "rouge_l": rl / n, "distinct_share": distinct / n, "n_scored": n}


# ---------------------------------------------------------------------------------------------
# LLM judge

# LLMs-from-scratch ch. 7 (rasbt/LLMs-from-scratch, ch07/01_main-chapter-code): `format_input`
# is Alpaca's no-input preamble and instruction, plus the input when there is one (always with
# the no-input preamble, unlike Alpaca's own two templates), without the "### Response:" header.
_INSTRUCTION = ALPACA_NO_INPUT.removesuffix("\n\n### Response:\n")


def format_input(row: Row) -> str:
    text = _INSTRUCTION.format(instruction=_text(row, "instruction"))
    return text + (f"\n\n### Input:\n{_text(row, 'input')}" if _text(row, "input") else "")


def judge_prompt(row: Row) -> str:
    """The scoring prompt of ch. 7's `generate_model_scores`, same wording."""
    return (
        f"Given the input `{format_input(row)}` and correct output `{_text(row, 'reference')}`, "
        f"score the model response `{_text(row, 'response')}` on a scale from 0 to 100, "
        "where 100 is the best score. Respond with the integer number only."
    )


def parse_score(content: Any) -> int | None:
    """The first integer in the reply if it lies in 0..100, else None."""
    found = re.search(r"-?\d+", content) if isinstance(content, str) else None
    score = int(found.group()) if found else None
    return score if score is not None and 0 <= score <= 100 else None


@dataclass
class JudgeResult:
    scores: list[int | None] = field(default_factory=list)
    mean: float | None = None
    unscored: int = 0
    error: str | None = None  # set when the judge stopped early (unreachable server)


def judge_scores(
    rows: Sequence[Row], *, url: str, model: str, api_key: str | None = None, timeout: float = 60.0, retries: int = 2
) -> JudgeResult:
    """Score every response 0..100 with an LLM on an OpenAI-compatible server at `url` (base URL,
    e.g. http://127.0.0.1:11434/v1). Unparsable or out-of-range replies and failed requests leave
    that row unscored (None); a server that cannot be reached stops the judging, sets `error`
    and leaves every remaining row unscored. Never raises for the server's sake."""
    from gptforge.openai_client import BadReply, ChatClient, EndpointError, Unreachable, check_url

    try:
        check_url(url, "instruct.judge.url")
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    api_key = api_key if api_key is not None else os.environ.get("GPTFORGE_JUDGE_API_KEY")
    client = ChatClient(url, model, api_key=api_key, timeout=timeout, retries=retries)
    result = JudgeResult()
    for row in tqdm(rows, desc="judge", leave=False):
        if result.error is not None:
            result.scores.append(None)
            continue
        score = None
        try:
            reply = client.complete(
                [{"role": "user", "content": judge_prompt(row)}], temperature=0, max_tokens=16, seed=123
            )
            score = parse_score(reply.content)
        except Unreachable as exc:
            result.error = f"judge at {client.endpoint} unreachable ({exc}); remaining rows unscored"
            log.warning("instruct: %s", result.error)
        except EndpointError as exc:
            log.warning("instruct: judge answered HTTP %s for row %d; row unscored", exc.status, len(result.scores))
        except BadReply:
            log.warning("instruct: judge reply for row %d is not a chat completion; row unscored", len(result.scores))
        result.scores.append(score)
    scored = [s for s in result.scores if s is not None]
    result.mean = sum(scored) / len(scored) if scored else None
    result.unscored = len(result.scores) - len(scored)
    return result


# ---------------------------------------------------------------------------------------------
# The file


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise BadInput(f"{path}:{number}: not a JSON line ({exc.msg})") from None
    return rows


def score_file(
    path: str | Path, *, judge_url: str | None = None, judge_model: str | None = None, api_key: str | None = None
) -> dict[str, float]:
    """Reference scores of a responses jsonl, plus judge_score (when any row was scored) and
    judge_unscored when both judge_url and judge_model are set. Flat numbers for metrics/instruct.json."""
    rows = read_rows(path)
    metrics = reference_scores(rows)
    if judge_url and judge_model:
        judged = judge_scores(rows, url=judge_url, model=judge_model, api_key=api_key)
        if judged.mean is not None:
            metrics["judge_score"] = judged.mean
        metrics["judge_unscored"] = judged.unscored
    else:
        log.info("instruct: no judge (instruct.judge.url and instruct.judge.model unset): judge score skipped")
    return metrics
