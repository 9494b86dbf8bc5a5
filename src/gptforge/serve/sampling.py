"""Drawing each row's next token: a request's decoding settings (`Sampling`, OpenAI's names) and
`pick_tokens`, which the engine core runs on the logits of the rows that draw in a step (greedy,
temperature, top-k, top-p, each row with its own seeded generator); `pick_tokens_per_row` is the
plain form it is checked against. The scheduler never runs it: it plans a step and takes its
tokens back (`serve.scheduler`), the engine core samples between (`serve.engine_core.step`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sampling:
    """One request's decoding settings (OpenAI's names). temperature 0 is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


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
