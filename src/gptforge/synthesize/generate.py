"""Asking the endpoint: the prompts, parsing the replies, the response cache and bounded concurrency.

One request per chunk asks for `pairs_per_chunk` self-contained pairs grounded in the chunk, in
its language, as a JSON array of {"question", "answer"} objects (`response_format` carries the
same JSON schema; an endpoint that refuses the field with 400/422 is asked again without it,
for the rest of the run). A reply that does not parse is asked once more (another seed); if
that fails too the chunk counts as unparseable. The optional LLM checks (`verify`: does the
chunk support the answer, yes/no; `curate`: a 1-10 rating) are one request per pair.

Every reply is cached on disk under `.gptforge/cache/synthesize/` by a hash of the endpoint's
model, the messages and the sampling settings, outside the stage's DVC outputs (which DVC
deletes before a run): a stopped run resumes without asking again, and a repro with nothing
changed asks nothing. Requests run on `concurrency` daemon threads, so a stop (Ctrl-C,
SIGTERM) ends the process at once, with every answer received so far in the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

from gptforge.openai_client import ChatClient, Completion, EndpointError

log = logging.getLogger("gptforge")

CACHE_DIR = Path(".gptforge") / "cache" / "synthesize"

SYSTEM = "You write question and answer pairs for a reading-comprehension dataset. You reply with JSON only."

PAIRS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
        "required": ["question", "answer"],
    },
}


def pairs_messages(text: str, *, source: str, headings: Sequence[str], n: int) -> list[dict[str, str]]:
    """The generation prompt for one chunk: its document and heading path as context, its text."""
    where = f"Document: {source}\n" + (f"Section: {' > '.join(headings)}\n" if headings else "")
    user = (
        f"Write {n} question and answer pairs about the text below.\n"
        "Rules:\n"
        "- Each question must make sense on its own, to a reader who has never seen the text: name "
        "its subject, and never refer to the text, the passage, the document, a section, a figure, a "
        "table, a listing, an equation or a page.\n"
        "- Each answer must be stated by the text itself, in one to three sentences.\n"
        "- Write the questions and answers in the language of the text.\n"
        f'- Reply with a JSON array of {n} objects and nothing else: [{{"question": "...", "answer": "..."}}]\n\n'
        f'{where}Text:\n"""\n{text}\n"""'
    )
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def verify_messages(chunk: str, question: str, answer: str) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": f'Text:\n"""\n{chunk}\n"""\n\nQuestion: {question}\nAnswer: {answer}\n\n'
            "Does the text above state everything the answer says? Reply with one word: yes or no.",
        }
    ]


def curate_messages(question: str, answer: str) -> list[dict[str, str]]:
    """synthetic-data-kit's curate step: a 1-10 rating of the pair's accuracy, relevance and clarity."""
    return [
        {
            "role": "user",
            "content": "Rate this question and answer pair for a training set from 1 to 10, for accuracy, relevance, "
            "clarity and usefulness (10 is best).\n\n"
            f"Question: {question}\nAnswer: {answer}\n\nReply with the integer only.",
        }
    ]


# ---------------------------------------------------------------------------------------------
# Parsing replies


class Unparseable(ValueError):
    pass


_FENCE = re.compile(r"```[A-Za-z0-9_-]*\s*\n?(.*?)```", re.DOTALL)


def parse_pairs(content: str) -> list[Any]:
    """The items of the JSON array in a reply: the reply itself, a ```json fence around it, an
    object holding one list (what a json_schema-constrained endpoint may wrap it in), or the
    outermost [...] in surrounding prose. Items are returned as they are (the caller checks
    their shape). Raises Unparseable."""
    candidates = [content.strip()]
    candidates += [m.strip() for m in _FENCE.findall(content)]
    first, last = content.find("["), content.rfind("]")
    if 0 <= first < last:
        candidates.append(content[first : last + 1])
    for text in candidates:
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if isinstance(data, dict):
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) == 1:
                data = lists[0]
            elif "question" in data and "answer" in data:
                data = [data]
        if isinstance(data, list):
            return data
    raise Unparseable(f"no JSON array in the reply ({' '.join(content.split())[:80]!r})")


def pair_fields(item: Any) -> tuple[str, str] | None:
    """(question, answer) of one parsed item, or None when it is not an object with two strings."""
    if isinstance(item, dict) and isinstance(item.get("question"), str) and isinstance(item.get("answer"), str):
        return item["question"], item["answer"]
    return None


def parse_verdict(content: str) -> bool | None:
    word = re.match(r"\W*(\w+)", content.lower())
    return {"yes": True, "no": False}.get(word.group(1)) if word else None


def parse_rating(content: str) -> float | None:
    found = re.search(r"\d+(?:\.\d+)?", content)
    value = float(found.group()) if found else None
    return value if value is not None and 1 <= value <= 10 else None


# ---------------------------------------------------------------------------------------------
# Cached requests


@dataclass(frozen=True)
class Reply:
    content: str
    prompt_tokens: int | None
    completion_tokens: int | None
    seconds: float
    cached: bool = False


class ResponseCache:
    """One JSON file per request key under `root` (written whole or not at all)."""

    def __init__(self, root: str | os.PathLike = CACHE_DIR) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> Reply | None:
        try:
            data = json.loads(self._path(key).read_text(encoding="utf-8"))
            return Reply(**{**data, "cached": True})
        except (OSError, ValueError, TypeError):  # absent, or a file left by something else
            return None

    def put(self, key: str, reply: Reply) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({k: v for k, v in asdict(reply).items() if k != "cached"}), encoding="utf-8")
        os.replace(tmp, path)


def request_key(model: str, messages: Sequence[dict], settings: dict[str, Any]) -> str:
    blob = json.dumps(
        {"model": model, "messages": list(messages), "settings": settings}, sort_keys=True, ensure_ascii=False
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class Asker:
    """Cached chat completions: `ask(messages, **settings)` answers from the cache or the endpoint.
    `json_schema` asks for a structured reply; a request refused (400 or 422) with
    `response_format` is sent again without it, and when that one is answered the endpoint is
    not sent the field again in this run."""

    def __init__(self, client: ChatClient, cache: ResponseCache) -> None:
        self.client, self.cache = client, cache
        self.response_format_ok = True
        self.sent = 0  # requests answered by the endpoint in this run
        self._lock = threading.Lock()

    def ask(self, messages: Sequence[dict], *, json_schema: dict | None = None, **settings: Any) -> Reply:
        key = request_key(self.client.model, messages, {**settings, "json_schema": json_schema})
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        extra = {}
        if json_schema is not None and self.response_format_ok:
            extra = {
                "response_format": {"type": "json_schema", "json_schema": {"name": "qa_pairs", "schema": json_schema}}
            }
        try:
            done = self._send(messages, {**settings, **extra})
        except EndpointError as exc:
            if not extra or exc.status not in (400, 422):
                raise
            done = self._send(messages, settings)  # refused for the chunk itself: raises again
            with self._lock:
                if self.response_format_ok:
                    log.info(
                        "synthesize: the endpoint refused response_format (HTTP %d: %s); asking without it",
                        exc.status,
                        exc.detail,
                    )
                self.response_format_ok = False
        reply = Reply(done.content, done.prompt_tokens, done.completion_tokens, done.seconds)
        self.cache.put(key, reply)
        return reply

    def _send(self, messages: Sequence[dict], params: dict[str, Any]) -> Completion:
        done = self.client.complete(messages, **params)
        with self._lock:
            self.sent += 1
        return done


# ---------------------------------------------------------------------------------------------
# Bounded concurrency

T = TypeVar("T")
R = TypeVar("R")


def run_bounded(
    fn: Callable[[T], R], items: Iterable[T], concurrency: int
) -> Iterator[tuple[int, R | None, BaseException | None]]:
    """(index, result, error) for fn over items, as they complete, at most `concurrency` at once.

    An error stops new work at once (the thread that met it takes no other item; the others stop
    when the consumer does). Daemon threads: when the consumer stops early (an error it raises, a
    stop signal), the threads take no new item and do not hold the process open; a request in
    flight is dropped."""
    jobs: queue.Queue = queue.Queue()
    items = list(items)
    for i, item in enumerate(items):
        jobs.put((i, item))
    done: queue.Queue = queue.Queue()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            try:
                i, item = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((i, fn(item), None))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which decides
                stop.set()
                done.put((i, None, exc))

    for _ in range(min(concurrency, len(items))):
        threading.Thread(target=work, name="synthesize-request", daemon=True).start()
    try:
        for _ in range(len(items)):
            while True:
                try:
                    yield done.get(timeout=0.5)  # a timeout, so a stop signal is handled promptly
                    break
                except queue.Empty:
                    continue
    finally:
        stop.set()


__all__ = [
    "Asker",
    "ResponseCache",
    "Reply",
    "Unparseable",
    "curate_messages",
    "pair_fields",
    "pairs_messages",
    "parse_pairs",
    "parse_rating",
    "parse_verdict",
    "request_key",
    "run_bounded",
    "verify_messages",
]
