"""`gptforge synthesize`: one entry of `synthesize.documents` -> `data/synthetic/NAME/`.

The recipe reads the documents, cuts them into chunks (`chunks.py`), asks the endpoint for
pairs per chunk (`generate.py`), runs every pair returned through the filters (`filters.py`:
shape, self-contained, grounded, then the optional LLM checks, then duplicates among the
survivors, the first one kept) and writes:

- `data/synthetic/NAME/qa.jsonl`: the kept pairs as Alpaca records (`instruction`, `input` "",
  `output`) with their provenance (`source`, `chunk`, `span`) and `scores`;
- `chunks.jsonl` (every chunk with its id, heading path and span), `dropped.jsonl` (every
  dropped pair with its reason) and `dataset_info.json` (LLaMA-Factory's dataset registry
  entry for qa.jsonl);
- `reports/synthesize_NAME.md` and `metrics/synthesize_NAME.json`.

With no endpoint (`synthesize.endpoint.url` and `.model` null) the stage writes
`chunks.jsonl` alone, and a report and metrics that say so (`pairs_asked` 0, `kept` 0): no
`qa.jsonl`, so nothing downstream can take an absent set of pairs for an empty one
(`prepare_instruct` refuses `synthetic://NAME` in one line). The index of the set is then built
from its chunks, and its questions are the user's own (`evaluate_qa.questions.NAME`). A model
too small to write pairs (a 135M one answers with lines of "#") is no teacher: this is the
offline path.

Failures: bad documents or an endpoint that refuses the key (401/403) or the model (404) are
BadInput (exit 2, nothing written); an endpoint that cannot be reached, or stops answering
halfway, is SourceUnreachable (exit 1) with the number of chunks left (their answers so far
are cached: run again to resume); no pair kept at all fails with the drop counts.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from gptforge.config.checks import only_entries
from gptforge.errors import BadInput, SourceUnreachable, StageFailed
from gptforge.io import atomic_dir, atomic_file
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics

log = logging.getLogger("gptforge")

OUT_ROOT = Path("data/synthetic")
KEY_ENV = "GPTFORGE_SYNTH_API_KEY"
REFUSED_FOR_THE_CHUNK = (400, 413, 422)  # statuses that end one chunk's request, not the run
DATASET_INFO = {"formatting": "alpaca", "columns": {"prompt": "instruction", "query": "input", "response": "output"}}


def synthetic_path(name: str, root: str | os.PathLike = OUT_ROOT) -> Path:
    """Where prepare_instruct finds the kept pairs of `synthetic://NAME`."""
    return Path(root) / name / "qa.jsonl"


@dataclass
class Pair:
    question: str
    answer: str
    chunk: Any  # chunks.Chunk
    scores: dict[str, float] = field(default_factory=dict)
    reason: str | None = None  # why it was dropped; None: kept
    duplicate_of: str | None = None  # the question of the kept pair a duplicate repeats

    def record(self) -> dict[str, Any]:
        return {
            "instruction": self.question,
            "input": "",
            "output": self.answer,
            "source": self.chunk.source,
            "chunk": self.chunk.id,
            "span": [self.chunk.start, self.chunk.end],
            "scores": {k: round(v, 4) for k, v in self.scores.items()},
        }


@dataclass
class Generated:
    pairs: list[Pair]
    requests: int  # sent to the endpoint in this run
    cached: int  # generation replies read from the cache
    unparseable: int  # chunks whose reply (and its one retry) held no JSON array
    malformed: int  # items of a parsed array that were not {"question": str, "answer": str}
    refused: int  # chunks whose request the endpoint refused (HTTP 400, 413, 422)
    completion_tokens: int
    request_seconds: float
    wall_seconds: float


def synthesize(
    cfg,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    out_root: str | os.PathLike = OUT_ROOT,
    reports_dir: str | os.PathLike = "reports",
    metrics_dir: str | os.PathLike = "metrics",
    cache_dir: str | os.PathLike | None = None,
) -> dict:
    """Make `synthesize.documents[synthesize.only]` (every entry when `only` is null): dvc.yaml's
    synthesize@NAME runs `gptforge synthesize -S synthesize.only=NAME`."""
    metrics: dict[str, float] = {}
    names = selected_documents(cfg.synthesize)
    for name in names:
        got = synthesize_one(
            cfg,
            name,
            steps=steps,
            run=run,
            out_root=out_root,
            reports_dir=reports_dir,
            metrics_dir=metrics_dir,
            cache_dir=cache_dir,
        )
        metrics.update({f"{name}.{k}": v for k, v in got.items()} if len(names) > 1 else got)
    return metrics


def selected_documents(s) -> list[str]:
    """The entries of `synthesize.documents` this run makes (`synthesize.only`, else all); BadInput
    when there are none or `only` names no entry."""
    if not s.documents:
        raise BadInput("synthesize.documents is empty: add NAME: FOLDER_OR_FILE (of .md, .txt, .pdf)")
    return only_entries(s.documents, s.only, "synthesize.documents")


def synthesize_one(
    cfg,
    name: str,
    *,
    steps: Steps,
    run: NullRun,
    out_root: str | os.PathLike,
    reports_dir: str | os.PathLike,
    metrics_dir: str | os.PathLike,
    cache_dir: str | os.PathLike | None,
) -> dict:
    from gptforge.modeling.tokenizer import load_tokenizer
    from gptforge.openai_client import ChatClient
    from gptforge.synthesize.chunks import chunk_documents
    from gptforge.synthesize.documents import read_documents
    from gptforge.synthesize.generate import CACHE_DIR, Asker, ResponseCache

    s = cfg.synthesize
    docs = steps(read_documents, s.documents[name], param=f"synthesize.documents.{name}")
    encoding = load_tokenizer(cfg.tokenizer.path)
    chunks = steps(
        chunk_documents,
        docs,
        count_tokens=lambda text: len(encoding.encode_ordinary(text)),
        chunk_tokens=s.chunk_tokens,
        overlap=s.chunk_overlap,
    )
    log.info(
        "synthesize %s: %d documents, %d chunks (at most %d GPT-2 tokens, %d shared)",
        name,
        len(docs),
        len(chunks),
        s.chunk_tokens,
        s.chunk_overlap,
    )
    if s.endpoint.url is None:
        return chunks_only(
            name,
            docs,
            chunks,
            s,
            steps=steps,
            run=run,
            out_root=out_root,
            reports_dir=reports_dir,
            metrics_dir=metrics_dir,
        )
    client = ChatClient(
        s.endpoint.url,
        s.endpoint.model,
        api_key=os.environ.get(KEY_ENV) or None,
        timeout=s.endpoint.timeout,
        retries=s.endpoint.retries,
    )
    asker = Asker(client, ResponseCache(cache_dir if cache_dir is not None else CACHE_DIR))
    asked = [c for c in chunks if c.tokens >= s.min_chunk_tokens]
    generated = steps(generate_pairs, asked, asker, s)
    pairs = steps(filter_pairs, generated.pairs, asker, s)
    kept = [p for p in pairs if p.reason is None]
    metrics = summarize(name, chunks, asked, generated, pairs, asker, s)
    out = Path(out_root) / name
    steps(write_outputs, out, name, chunks, pairs)
    report = Path(reports_dir) / f"synthesize_{name}.md"
    steps(write_report, report, name, s, metrics, pairs)
    publish_metrics(run, metrics, Path(metrics_dir) / f"synthesize_{name}.json")
    run.log_artifact(report)
    log.info(
        "synthesize %s: %d pairs kept of %d returned (%d asked) -> %s; report %s",
        name,
        len(kept),
        len(pairs),
        metrics["pairs_asked"],
        out,
        report,
    )
    if not kept:
        drops = ", ".join(
            f"{k.removeprefix('dropped_')} {int(v)}" for k, v in metrics.items() if k.startswith("dropped_") and v
        )
        raise StageFailed(
            f"synthesize {name}: no pair kept of {len(pairs)} returned "
            f"({drops or 'the endpoint returned none'}; {int(metrics['unparseable'])} unparseable "
            f"replies, {int(metrics['refused_requests'])} refused requests); see {report}"
        )
    return metrics


def chunks_only(
    name: str,
    docs: Sequence[Any],
    chunks: Sequence[Any],
    s,
    *,
    steps: Steps,
    run: NullRun,
    out_root: str | os.PathLike,
    reports_dir: str | os.PathLike,
    metrics_dir: str | os.PathLike,
) -> dict:
    """No endpoint: `data/synthetic/NAME/` holds `chunks.jsonl` alone (replaced whole), and the
    report and metrics say that no pair was asked."""
    out = Path(out_root) / name
    steps(write_chunks_only, out, chunks)
    metrics: dict[str, float] = {
        "documents": len(docs),
        "chunks": len(chunks),
        "requests": 0,
        "pairs_asked": 0,
        "kept": 0,
    }
    report = Path(reports_dir) / f"synthesize_{name}.md"
    lines = [
        f"# synthesize {name}",
        "",
        f"Documents `{s.documents[name]}`: {len(docs)} documents, {len(chunks)} chunks of at most "
        f"{s.chunk_tokens} GPT-2 tokens ({s.chunk_overlap} shared), in `{out / 'chunks.jsonl'}`.",
        "",
        "**Chunks only: no pairs.** `synthesize.endpoint.url` and `synthesize.endpoint.model` are null, so "
        "no endpoint was asked and there is no `qa.jsonl`. The index (stage index@NAME) is built from these "
        "chunks; evaluate_qa asks the questions of `evaluate_qa.questions.NAME`. To make pairs, name an "
        "endpoint (docs/synthesize.md).",
    ]
    report.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(report, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    publish_metrics(run, metrics, Path(metrics_dir) / f"synthesize_{name}.json")
    run.log_artifact(report)
    log.warning(
        "synthesize %s: no endpoint (synthesize.endpoint.url is null): %d chunks written to %s, no pairs asked",
        name,
        len(chunks),
        out,
    )
    return metrics


# ---------------------------------------------------------------------------------------------
# Generation


def generate_pairs(chunks: Sequence[Any], asker, s) -> Generated:
    """Ask for pairs for every chunk (cached replies first), `s.concurrency` requests at once.
    The pairs come back in chunk order, whatever order the replies arrive in."""
    from tqdm.auto import tqdm

    from gptforge.openai_client import EndpointError, Unreachable
    from gptforge.synthesize.generate import run_bounded

    t0 = time.monotonic()
    results: list[tuple[Any, ...] | None] = [None] * len(chunks)
    returned = 0
    bar = tqdm(total=len(chunks), desc="synthesize", unit="chunk", leave=False)
    try:
        for i, result, error in run_bounded(lambda chunk: _ask_chunk(chunk, asker, s), chunks, s.concurrency):
            if error is not None:
                answered = sum(r is not None for r in results)
                left = len(chunks) - answered
                endpoint = asker.client.endpoint
                if isinstance(error, EndpointError) and error.status in (401, 403):
                    raise BadInput(
                        f"synthesize.endpoint.url: {endpoint} answered HTTP {error.status} "
                        f"({error.detail or 'not authorized'}): set {KEY_ENV} to a key it accepts"
                    ) from None
                if isinstance(error, EndpointError) and error.status == 404:
                    raise BadInput(
                        f"synthesize.endpoint: {endpoint} answered HTTP 404 ({error.detail or 'not found'}): "
                        f"check the URL (base URL with /v1) and synthesize.endpoint.model "
                        f"{asker.client.model!r}"
                    ) from None
                if isinstance(error, (Unreachable, EndpointError)):
                    why = f"HTTP {error.status}: {error.detail}" if isinstance(error, EndpointError) else str(error)
                    raise SourceUnreachable(
                        f"synthesize.endpoint.url: {endpoint} did not answer ({why}); {answered} of {len(chunks)} "
                        f"chunks answered and cached, {left} left: run again to resume"
                    ) from None
                raise error
            results[i] = result
            returned += len(result[0])
            bar.update(1)
            elapsed = time.monotonic() - t0
            bar.set_postfix(pairs_per_s=f"{returned / elapsed:.2f}" if elapsed > 0 else "-")
    finally:
        bar.close()
    pairs: list[Pair] = []
    unparseable = malformed = tokens = cached = 0
    refused: list[str] = []
    seconds = 0.0
    for chunk, (found, bad_items, parsed, replies, refusal) in zip(chunks, results):
        pairs += [Pair(q, a, chunk) for q, a in found]
        malformed += bad_items
        unparseable += not parsed
        if refusal:
            refused.append(f"{chunk.id} ({refusal})")
        for reply in replies:
            cached += reply.cached
            if not reply.cached:
                tokens += reply.completion_tokens or 0
                seconds += reply.seconds
    if refused:
        log.warning("synthesize: the endpoint refused the requests of %d chunks (first: %s)", len(refused), refused[0])
    return Generated(
        pairs=pairs,
        requests=asker.sent,
        cached=cached,
        unparseable=unparseable,
        malformed=malformed,
        refused=len(refused),
        completion_tokens=tokens,
        request_seconds=seconds,
        wall_seconds=time.monotonic() - t0,
    )


def _ask_chunk(chunk, asker, s) -> tuple[list[tuple[str, str]], int, bool, list, str | None]:
    """(pairs, malformed items, parsed?, replies, refusal) for one chunk; one more request
    (another seed) when the first reply does not parse. A request the endpoint refuses for this
    chunk alone (HTTP 400, 413, 422: a prompt longer than its context, say) is that chunk's
    `refusal`, not the run's end."""
    from gptforge.openai_client import EndpointError
    from gptforge.synthesize.generate import PAIRS_SCHEMA, Unparseable, pair_fields, pairs_messages, parse_pairs

    messages = pairs_messages(chunk.text, source=chunk.source, headings=chunk.headings, n=s.pairs_per_chunk)
    replies = []
    for attempt in range(2):
        try:
            reply = asker.ask(
                messages,
                json_schema=PAIRS_SCHEMA,
                temperature=s.temperature,
                max_tokens=s.max_tokens,
                seed=s.seed + attempt,
            )
        except EndpointError as exc:
            if exc.status not in REFUSED_FOR_THE_CHUNK:
                raise
            return [], 0, True, replies, f"HTTP {exc.status}: {exc.detail}"
        replies.append(reply)
        try:
            items = parse_pairs(reply.content)
        except Unparseable:
            continue
        fields = [pair_fields(item) for item in items]
        return [f for f in fields if f is not None], sum(f is None for f in fields), True, replies, None
    return [], 0, False, replies, None


# ---------------------------------------------------------------------------------------------
# Filters


def filter_pairs(pairs: list[Pair], asker, s) -> list[Pair]:
    """Set each pair's `reason` (None: kept) and `scores`: the rule filters, then the LLM checks
    when enabled (on the pairs still in), then duplicates among the pairs still in."""
    from gptforge.synthesize.filters import check_pair, deduplicate

    for pair in pairs:
        pair.reason, scores = check_pair(pair.question, pair.answer, pair.chunk.text, s.filters)
        pair.scores.update(scores)
    if s.verify:
        _llm_check(pairs, asker, s, "verify")
    if s.curate.enabled:
        _llm_check(pairs, asker, s, "curate")
    alive = [p for p in pairs if p.reason is None]
    for pair, verdict in zip(alive, deduplicate([(p.question, p.answer) for p in alive], s.filters)):
        if verdict is not None:
            pair.reason, pair.duplicate_of = verdict[0], alive[verdict[1]].question
    return pairs


def _llm_check(pairs: list[Pair], asker, s, kind: str) -> None:
    from gptforge.openai_client import EndpointError, Unreachable
    from gptforge.synthesize.generate import curate_messages, parse_rating, parse_verdict, run_bounded, verify_messages

    alive = [p for p in pairs if p.reason is None]

    def ask(pair: Pair):
        messages = (
            verify_messages(pair.chunk.text, pair.question, pair.answer)
            if kind == "verify"
            else curate_messages(pair.question, pair.answer)
        )
        return asker.ask(messages, temperature=0, max_tokens=8, seed=s.seed).content

    for i, content, error in run_bounded(ask, alive, s.concurrency):
        if isinstance(error, (Unreachable, EndpointError)):
            raise SourceUnreachable(
                f"synthesize.endpoint.url: {asker.client.endpoint} did not answer the {kind} "
                f"requests ({error}); answers so far are cached: run again to resume"
            ) from None
        if error is not None:
            raise error
        pair = alive[i]
        if kind == "verify":
            verdict = parse_verdict(content)
            pair.scores["verified"] = float(verdict) if verdict is not None else -1.0
            if verdict is False:
                pair.reason = "unsupported"
        else:
            rating = parse_rating(content)
            if rating is not None:
                pair.scores["curate"] = rating
            if rating is not None and rating < s.curate.threshold:
                pair.reason = "low_rating"


# ---------------------------------------------------------------------------------------------
# Outputs


def summarize(
    name: str, chunks: Sequence[Any], asked: Sequence[Any], generated: Generated, pairs: Sequence[Pair], asker, s
) -> dict:
    from gptforge.synthesize.filters import REASONS

    reasons = Counter(p.reason for p in pairs if p.reason is not None)
    order = list(REASONS) + [r for r in ("unsupported", "low_rating") if r not in REASONS]
    metrics: dict[str, float] = {
        "documents": len({c.source for c in chunks}),
        "chunks": len(chunks),
        "chunks_too_short": len(chunks) - len(asked),  # under synthesize.min_chunk_tokens: not asked about
        "requests": asker.sent,
        "cached_replies": generated.cached,
        "unparseable": generated.unparseable,
        "refused_requests": generated.refused,
        "pairs_asked": len(asked) * s.pairs_per_chunk,
        "pairs_returned": len(pairs),
        "kept": sum(p.reason is None for p in pairs),
        "dropped_malformed": generated.malformed,
        **{f"dropped_{r}": reasons.get(r, 0) for r in order},
        "completion_tokens": generated.completion_tokens,
        "wall_seconds": round(generated.wall_seconds, 3),
    }
    if generated.request_seconds > 0 and generated.completion_tokens:
        # the endpoint's decoding speed seen by one request, from its own usage counts
        metrics["endpoint_tokens_per_sec"] = round(generated.completion_tokens / generated.request_seconds, 2)
    if generated.requests and generated.wall_seconds > 0:
        metrics["pairs_per_min"] = round(len(pairs) / generated.wall_seconds * 60, 2)
    return metrics


def write_outputs(out: Path, name: str, chunks: Sequence[Any], pairs: Sequence[Pair]) -> None:
    """data/synthetic/NAME/, replaced as a whole."""
    from gptforge.synthesize.chunks import write_chunks

    with atomic_dir(out) as tmp:
        with open(tmp / "qa.jsonl", "w", encoding="utf-8") as f:
            for pair in pairs:
                if pair.reason is None:
                    f.write(json.dumps(pair.record(), ensure_ascii=False) + "\n")
        with open(tmp / "dropped.jsonl", "w", encoding="utf-8") as f:
            for pair in pairs:
                if pair.reason is not None:
                    extra = {"duplicate_of": pair.duplicate_of} if pair.duplicate_of else {}
                    f.write(json.dumps({"reason": pair.reason, **pair.record(), **extra}, ensure_ascii=False) + "\n")
        write_chunks(chunks, tmp / "chunks.jsonl")
        (tmp / "dataset_info.json").write_text(
            json.dumps({f"gptforge_{name}": {"file_name": "qa.jsonl", **DATASET_INFO}}, indent=2) + "\n",
            encoding="utf-8",
        )


def write_chunks_only(out: Path, chunks: Sequence[Any]) -> None:
    """data/synthetic/NAME/ with chunks.jsonl alone, replaced as a whole."""
    from gptforge.synthesize.chunks import write_chunks

    with atomic_dir(out) as tmp:
        write_chunks(chunks, tmp / "chunks.jsonl")


def write_report(path: Path, name: str, s, metrics: dict, pairs: Sequence[Pair]) -> None:
    lines = [
        f"# synthesize {name}",
        "",
        f"Documents `{s.documents[name]}`, endpoint `{s.endpoint.url}` model `{s.endpoint.model}`, "
        f"{s.pairs_per_chunk} pairs asked per chunk of at most {s.chunk_tokens} GPT-2 tokens "
        f"({s.chunk_overlap} shared).",
        "",
        "| | |",
        "| --- | ---: |",
    ]
    for key in (
        "documents",
        "chunks",
        "chunks_too_short",
        "requests",
        "cached_replies",
        "unparseable",
        "refused_requests",
        "pairs_asked",
        "pairs_returned",
        "kept",
        "completion_tokens",
        "endpoint_tokens_per_sec",
        "pairs_per_min",
        "wall_seconds",
    ):
        if key in metrics:
            lines.append(f"| {key.replace('_', ' ')} | {metrics[key]:g} |")
    lines += ["", "## Dropped, by reason", "", "| reason | pairs |", "| --- | ---: |"]
    for key, value in metrics.items():
        if key.startswith("dropped_") and value:
            lines.append(f"| {key.removeprefix('dropped_')} | {value:g} |")
    for reason in dict.fromkeys(p.reason for p in pairs if p.reason is not None):
        lines += ["", f"### {reason}", ""]
        for pair in [p for p in pairs if p.reason == reason][:2]:
            lines.append(
                f"- Q: {_one_line(pair.question)}  \n  A: {_one_line(pair.answer)}  \n"
                f"  ({pair.chunk.id}; {', '.join(f'{k} {v:.2f}' for k, v in pair.scores.items())})"
            )
    kept = [p for p in pairs if p.reason is None][:3]
    if kept:
        lines += ["", "## Kept, the first few", ""]
        lines += [f"- Q: {_one_line(p.question)}  \n  A: {_one_line(p.answer)}  \n  ({p.chunk.id})" for p in kept]
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
