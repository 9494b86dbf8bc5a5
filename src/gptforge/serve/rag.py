"""Retrieval-augmented chat in `gptforge serve --rag data/index/NAME`: the serve side of RAG.

`load_retrieval` reads the index once at start (`rag.index.Index.load`: a missing folder, or
one of another version, is a one-line BadInput) and `attach` sets it as `lm.rag` on every
served language model (one without it is not augmented). For each chat request to such a
model (not `/v1/completions`, and not one that sends `rag: false`), `Retrieval.augment` takes
the last user message as the question, searches the index for its `top_k` chunks and replaces
that message with `rag.prompt.augment`'s text: the chunks, best first, in front of the
question, cut to fit. A candidate fits when the conversation with it, rendered exactly as the
server renders chats for that model (`ServedLM.chat_ids`: its chat template, or the instruction
template), plus the answer's room is within the model's positions. The answer's room is the request's
`max_tokens` (`max_completion_tokens`); without one the server lets an answer run to the end of
the context, so the chunks leave it `min(ANSWER_ROOM, context // 4)` tokens instead. What
became of each chunk (`whole`, `cut`, `dropped`) is the response's `sources`.

The search and the fitting (a tokenization of the whole chat per candidate, a bisection for
the cut chunk) run in a worker thread, off the event loop that streams the other answers.
`/metrics` gets their times and the chunks' fates (`serve.metrics`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from gptforge.errors import BadInput

ANSWER_ROOM = 256  # tokens left for the answer when a request gives no max_tokens (a quarter of a short context)


def load_retrieval(folder: str, top_k: int) -> "Retrieval":
    """The index at `folder` for `--rag` (BadInput, one line, when it is not one)."""
    from gptforge.rag.index import Index

    if top_k < 1:
        raise BadInput(f"--rag-top-k must be >= 1, got {top_k}")
    return Retrieval(Index.load(folder, param="--rag"), top_k)


def attach(models: list, retrieval: "Retrieval | None") -> None:
    """Give `retrieval` to every served language model in `models` (classifiers have no chat)."""
    from gptforge.serve.loading import ServedLM

    for m in models:
        if isinstance(m, ServedLM):
            m.rag = retrieval


def answer_room(context: int, max_tokens: int | None) -> int:
    """The tokens a prompt leaves for the answer when chunks are fitted in front of it."""
    return max_tokens if max_tokens is not None else min(ANSWER_ROOM, max(1, context // 4))


@dataclass
class Augmented:
    messages: list[dict]  # the conversation, its last user message augmented
    sources: list[dict]  # rag.prompt.augment's, best first ([] when nothing was retrieved)
    search_s: float  # the index search
    fit_s: float  # the fitting (rendering and tokenizing candidates)
    asked: bool = True  # False: no user message, nothing retrieved


@dataclass
class Retrieval:
    index: object  # gptforge.rag.index.Index
    top_k: int

    async def augment(self, lm, messages: list[dict], max_tokens: int | None, metrics=None) -> Augmented:
        """`messages` (role/content dicts) for `lm` with the retrieved chunks in front of the
        last user message; `metrics` (serve.metrics.ServeMetrics) records it."""
        done = await asyncio.to_thread(self.augment_now, lm, messages, max_tokens)
        if metrics is not None and done.asked:
            metrics.observe_rag(lm.name, done.search_s, done.fit_s, done.sources)
        return done

    def augment_now(self, lm, messages: list[dict], max_tokens: int | None) -> Augmented:
        from gptforge.rag.prompt import augment

        last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None)
        if last is None:  # nothing asked: nothing to retrieve for
            return Augmented(list(messages), [], 0.0, 0.0, asked=False)
        question = messages[last]["content"]
        start = time.perf_counter()
        hits = self.index.search(question, self.top_k)
        searched = time.perf_counter()
        room = answer_room(lm.context, max_tokens)

        def with_question(text: str) -> list[dict]:
            return [*messages[:last], {**messages[last], "content": text}, *messages[last + 1 :]]

        def fits(text: str) -> bool:
            return len(lm.chat_ids(with_question(text))) + room <= lm.context

        sourced = augment(question, hits, fits)
        return Augmented(with_question(sourced.text), sourced.sources, searched - start, time.perf_counter() - searched)
