"""The engine side of `gptforge serve`: which rows run in the next model step, and the token
each row draws. No threads, no event loop, no text: `serve.engine_core` runs `step()` in a loop
(in the engine process, or in a thread), and the API side (`serve.engine`) turns tokens into text.

One step is one `backend.forward` over segments of rows (vLLM's chunked prefill):

1. rows whose job ended (its last token was a stop id, it reached max_tokens or the context, or
   the API side cancelled it: a stop string, a client gone) leave the batch;
2. every decoding row gets a one-token segment (its last token);
3. prompts take the step's prefill budget of `prefill_chunk` tokens, oldest first: a prompt
   already part-way through continues, then waiting jobs are admitted while rows are free, each
   starting after the part of its prompt the prefix cache holds (`serve.prefix_cache`). A prompt
   longer than the budget is prefilled over several steps, each beside the running rows' decode
   segments, so running streams keep their pace; several short prompts are prefilled in one
   step, in the same forward;
4. a row whose prompt is complete draws its next token with its own settings (greedy,
   temperature, top-k, top-p, its own seeded generator); a row still prefilling draws none.

A finished prompt's full blocks go into the prefix cache (copied out of the row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptforge.serve.prefix_cache import PrefixCache

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens prefilled per step (`--prefill-chunk`); see docs/serving.md


@dataclass
class Sampling:
    """One request's decoding settings (OpenAI's names). temperature 0 is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


class Job:
    """One generation as the engine sees it: token ids in, token ids out."""

    def __init__(self, id: int, prompt_ids: list[int], sampling: Sampling, stop_ids: set[int] | frozenset[int]):
        self.id = id
        self.prompt_ids = list(prompt_ids)
        self.sampling = sampling
        self.stop_ids = set(stop_ids)
        self.computed = 0  # prompt tokens whose keys/values the row holds
        self.fed: list[int] = []  # tokens drawn
        self.ended = False  # the last token drawn ends the answer
        self.cancelled = False
        self.generator = None
        if sampling.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(sampling.seed) if sampling.seed is not None else self.generator.seed()

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt_ids)


class Scheduler:
    """Rows of `backend` (`serve.gpt_backend`, `serve.hf_backend`), stepped together."""

    def __init__(self, backend, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prefix_cache: PrefixCache | None = None):
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        self.backend = backend
        self.max_batch, self.context = backend.max_batch, backend.context
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.capacity > 0 else None
        self.waiting: list[Job] = []
        self.rows: list[Job] = []  # in the backend's row order
        self._by_id: dict[int, Job] = {}
        self.steps = 0
        self.prefilled_tokens = 0  # prompt tokens computed (not taken from the prefix cache)

    def add(self, job: Job) -> None:
        self.waiting.append(job)
        self._by_id[job.id] = job

    def cancel(self, job_id: int) -> None:
        job = self._by_id.get(job_id)
        if job is not None:
            job.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self.rows) or any(not j.cancelled for j in self.waiting)

    @property
    def busy_rows(self) -> int:
        return len(self.rows)

    def drop_all(self) -> list[Job]:
        """After a failed step: every job leaves (the API side ends them with an error)."""
        jobs = self.rows + self.waiting
        self.rows, self.waiting = [], []
        self._by_id.clear()
        self.backend.keep([])
        return jobs

    def step(self) -> list[tuple[Job, int]]:
        """One model step (the module's docstring); the tokens drawn, by job."""
        keep = [i for i, j in enumerate(self.rows) if not (j.ended or j.cancelled)]
        if len(keep) < len(self.rows):
            for i, job in enumerate(self.rows):
                if i not in keep:
                    self._by_id.pop(job.id, None)
            self.backend.keep(keep)
            self.rows = [self.rows[i] for i in keep]
        for job in self.waiting:
            if job.cancelled:
                self._by_id.pop(job.id, None)
        self.waiting = [j for j in self.waiting if not j.cancelled]

        segments: list[tuple[int, list[int]]] = []
        drawing: list[Job] = []  # rows that draw a token this step, in segment order
        for row, job in enumerate(self.rows):
            if not job.prefilling:
                segments.append((row, [job.fed[-1]]))
                drawing.append(job)
        budget = self.prefill_chunk
        for row, job in enumerate(self.rows):
            if job.prefilling and budget > 0:
                budget -= self._prefill(row, job, budget, segments, drawing)
        while budget > 0 and self.waiting and len(self.rows) < self.max_batch:
            job = self.waiting.pop(0)
            self._open(job)
            budget -= self._prefill(len(self.rows) - 1, job, budget, segments, drawing)
        if not segments:
            return []

        if (
            len(segments) == 1
            and len(segments[0][1]) == 1
            and drawing
            and drawing[0].sampling.temperature == 0
            and len(self.rows) == 1
            and hasattr(self.backend, "decode_greedy")
        ):
            tokens = [self.backend.decode_greedy(segments[0][1][0])]  # one greedy row: no logits needed
        else:
            logits = self.backend.forward(segments)
            rows_drawing = [i for i, (row, _) in enumerate(segments) if not self.rows[row].prefilling]
            picked = logits if len(rows_drawing) == len(segments) else logits[rows_drawing]
            tokens = pick_tokens(picked, drawing) if drawing else []
        self.steps += 1
        out = []
        for job, token in zip(drawing, tokens):
            job.fed.append(token)
            job.ended = (
                token in job.stop_ids
                or len(job.fed) >= job.sampling.max_tokens
                or len(job.prompt_ids) + len(job.fed) >= self.context
            )
            out.append((job, token))
        if self.prefix_cache is not None:
            self._cache_prompts(drawing)
        return out

    def _open(self, job: Job) -> None:
        """A row for `job`, holding the part of its prompt the prefix cache has."""
        prefix = self.prefix_cache.lookup(job.prompt_ids) if self.prefix_cache is not None else []
        self.backend.open_row(prefix or None)
        job.computed = len(prefix) * (self.prefix_cache.block_size if prefix else 0)
        self.rows.append(job)

    def _prefill(self, row: int, job: Job, budget: int, segments: list, drawing: list) -> int:
        """The next chunk of `job`'s prompt (at most `budget` tokens) as a segment; the tokens used.
        The chunk that completes the prompt makes the row draw its first token."""
        start = job.computed
        chunk = job.prompt_ids[start : start + budget]
        segments.append((row, chunk))
        job.computed += len(chunk)
        self.prefilled_tokens += len(chunk)
        if not job.prefilling:
            drawing.append(job)
        return len(chunk)

    def _cache_prompts(self, jobs: list[Job]) -> None:
        """Put the full blocks of prompts completed this step into the prefix cache."""
        cache = self.prefix_cache
        for job in jobs:
            if len(job.fed) == 1:  # its first token: the prompt was completed by this step
                row = self.rows.index(job)
                cache.store(
                    job.prompt_ids, job.computed, lambda a, b: self.backend.read_blocks(row, a, b, cache.block_size)
                )


def pick_tokens(logits: torch.Tensor, jobs: list) -> list[int]:
    """Each row's next token under its job's settings: argmax for temperature 0 (the lowest
    index on ties, as `decoding.generate`), else a draw from softmax(logits / temperature) cut
    to the top_k most likely and to the smallest set whose probability reaches top_p.

    The sampled rows are drawn together: one batched top-k, softmax and cumulative sum, and per
    row one uniform number from its own generator, whose place in the row's cumulative
    distribution is the token (inverse transform sampling). `pick_tokens_per_row` is the plain
    form, one `torch.multinomial` per row: on this project's 2-core CPU a multinomial over
    GPT-2's 50257 tokens took about 1 ms a row, more than the tiny models' whole decode step
    at 16 rows (benchmarks/bench_serve.py's sampled loads)."""
    sampled = [i for i, j in enumerate(jobs) if j.sampling.temperature > 0]
    if len(sampled) < len(jobs):
        out = logits.argmax(dim=-1).tolist()
        if not sampled:
            return out
    else:
        out = [0] * len(jobs)
    rows = [jobs[i] for i in sampled]
    vocab = logits.size(-1)
    scores = logits[sampled].float() / torch.tensor([[j.sampling.temperature] for j in rows], device=logits.device)
    ks = [min(j.sampling.top_k or vocab, vocab) for j in rows]
    candidates = None  # the token id of each column, where the columns are not the vocabulary
    if min(ks) < vocab:  # (a row without top_k beside one with it: max(ks) is the vocabulary, a full sort)
        scores, candidates = torch.topk(scores, max(ks), dim=-1)  # sorted, most likely first
        beyond = (
            torch.arange(scores.size(1), device=scores.device)[None, :]
            >= torch.tensor(ks, device=scores.device)[:, None]
        )
        scores = scores.masked_fill(beyond, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    top_p = torch.tensor([[j.sampling.top_p] for j in rows], device=probs.device)
    if bool((top_p < 1.0).any()):
        if candidates is None:
            probs, candidates = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
        probs = probs.masked_fill(before >= top_p, 0.0)
    cdf = torch.cumsum(probs.double(), dim=-1)
    u = torch.cat([torch.rand(1, generator=j.generator, dtype=torch.float64) for j in rows]).to(cdf.device)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).clamp_(max=cdf.size(1) - 1)
    tokens = (candidates.gather(1, choice) if candidates is not None else choice).view(-1).tolist()
    for i, token in zip(sampled, tokens):
        out[i] = token
    return out


def pick_tokens_per_row(logits: torch.Tensor, jobs: list) -> list[int]:
    """`pick_tokens` row by row with `torch.multinomial`: the plain form of the same choice."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, job in enumerate(jobs):
        s = job.sampling
        if s.temperature == 0:
            out.append(greedy[row])
            continue
        scores = logits[row].float() / s.temperature
        if s.top_k is not None and s.top_k < scores.numel():
            kth = torch.topk(scores, s.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if s.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, 0) - sorted_probs
            sorted_probs[before >= s.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=job.generator)))
    return out
