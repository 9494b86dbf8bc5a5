"""The engine side of `gptforge serve`: which rows run in the next model step, and what the
tokens they drew do to them. No threads, no event loop, no text, no model call: as vLLM V1's
EngineCore.step does, `serve.engine_core.step` asks `schedule()` for a `Plan`, runs the backend and
the sampler (`serve.sampling`) on it, and hands the tokens back to `update(plan, tokens)`; the API
side (`serve.engine`) turns tokens into text.

One step is one `backend.forward` over the plan's segments of rows (vLLM's chunked prefill):

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

A finished prompt's full blocks go into the prefix cache (copied out of the row) in `update`.

With `speculate=K` a lone greedy row (nothing else running or waiting) drafts up to K tokens by
prompt lookup over its prompt and answer (`modeling.speculative.prompt_lookup`), and the
backend verifies them in the same forward as its last token (`decode_greedy_draft`): the step
then gives the row one token or several, each taken in by `update` in turn (a stop id among
them ends the job there). Only backends that can verify a draft speculate (`HFBackend` over the
lean Llama-family decoder).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptforge.modeling.speculative import prompt_lookup
from gptforge.serve.backend import Backend
from gptforge.serve.prefix_cache import PrefixCache
from gptforge.serve.sampling import Sampling

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens prefilled per step (`--prefill-chunk`); see docs/serving.md


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


@dataclass
class Plan:
    """One step, as `Scheduler.schedule` planned it: the (row, tokens) segments to run, the jobs
    that draw a token (in segment order) and which segments they are (a row still prefilling
    runs but draws nothing)."""

    segments: list[tuple[int, list[int]]]
    drawing: list[Job]
    drawing_segments: list[int]
    lone_greedy_decode: bool = False  # one row, decoding, greedy: `Backend.decode_greedy`
    draft: list[int] = field(default_factory=list)  # the lone greedy row's drafted tokens, to verify


class Scheduler:
    """Rows of `backend` (`serve.gpt_backend`, `serve.hf_backend`), stepped together."""

    def __init__(
        self,
        backend: Backend,
        *,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefix_cache: PrefixCache | None = None,
        speculate: int = 0,
    ):
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        if speculate < 0:
            raise ValueError("speculate must be >= 0")
        # drafts only for a backend that verifies them
        self.speculate = speculate if getattr(backend, "verifies_drafts", False) else 0
        self.drafted_tokens = self.accepted_tokens = 0
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

    def schedule(self) -> Plan:
        """The next step (the module's docstring, 1-3); a plan without segments has nothing to run."""
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
        lone = (
            len(segments) == 1
            and len(segments[0][1]) == 1
            and bool(drawing)
            and drawing[0].sampling.temperature == 0
            and len(self.rows) == 1
        )
        at = [i for i, (row, _) in enumerate(segments) if not self.rows[row].prefilling]
        draft = self._draft(drawing[0]) if lone and self.speculate and not self.waiting else []
        return Plan(segments, drawing, at, lone, draft)

    def _draft(self, job: Job) -> list[int]:
        """Up to `speculate` tokens for the lone greedy row to verify: as many as its answer
        (max_tokens) and the context still take after the token this step draws anyway."""
        used = len(job.prompt_ids) + len(job.fed)
        room = min(self.speculate, job.sampling.max_tokens - len(job.fed) - 1, self.context - used - 1)
        return prompt_lookup(job.prompt_ids + job.fed, room) if room > 0 else []

    def update(self, plan: Plan, tokens: list[int]) -> list[tuple[Job, int]]:
        """Each drawing job's token (in `plan.drawing`'s order) taken in: the job grows, ends at a
        stop id, max_tokens or the context, and a prompt completed by the step goes into the
        prefix cache. Returns the (job, token) pairs. A plan with a draft gives its one job every
        token the backend verified (the kept drafts, then the model's own), taken in up to the
        first that ends the job."""
        drawing = plan.drawing
        self.steps += 1
        if plan.draft:
            self.drafted_tokens += len(plan.draft)
            self.accepted_tokens += len(tokens) - 1
            drawing = drawing * len(tokens)
        out = []
        for job, token in zip(drawing, tokens):
            if plan.draft and job.ended:  # a verified token after the one that ended the answer
                break
            job.fed.append(token)
            job.ended = (
                token in job.stop_ids
                or len(job.fed) >= job.sampling.max_tokens
                or len(job.prompt_ids) + len(job.fed) >= self.context
            )
            out.append((job, token))
        if self.prefix_cache is not None:
            self._cache_prompts(plan.drawing)
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
