"""The engine's scheduling (serve.scheduler) over a real gptforge GPT (serve.gpt_backend), and
the prefix cache (serve.prefix_cache): chunked and batched prefill, prefixes reused, each
against the plain path, `decoding.generate` on one prompt alone (greedy, token for token).
"""

from __future__ import annotations

import pytest
import torch

from gptforge.modeling.decoding import generate
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.serve.engine_core import step
from gptforge.serve.gpt_backend import GPTBackend
from gptforge.serve.prefix_cache import PrefixCache
from gptforge.serve.sampling import Sampling
from gptforge.serve.scheduler import Job, Scheduler

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=256, vocab_size=VOCAB, n_vocab=VOCAB, n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)  # greedy answers that vary from token to token (serve_support.tiny_gpt)
    return m.eval()


def prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = generate(model, torch.tensor([prompt]), n, temperature=0)
    return out[0, len(prompt) :].tolist()


class Counting(GPTBackend):
    """GPTBackend noting each forward's segments as (row, length)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[list[tuple[int, int]]] = []

    def forward(self, segments):
        self.calls.append([(row, len(tokens)) for row, tokens in segments])
        return super().forward(segments)


def run_all(
    scheduler: Scheduler, jobs: list[Job], arrivals: dict[int, list[Job]] | None = None
) -> dict[int, list[int]]:
    """Step until every job ended; `arrivals[k]`: jobs added before step k."""
    arrivals = dict(arrivals or {})
    for job in jobs:
        scheduler.add(job)
    steps = 0
    while scheduler.has_work or arrivals:
        for job in arrivals.pop(steps, []):
            scheduler.add(job)
        step(scheduler)  # the engine core's step: schedule, the model and the sampler, update
        steps += 1
        assert steps < 1000
    return {job.id: job.fed for job in jobs + [j for js in (arrivals or {}).values() for j in js]}


def greedy(i: int, prompt: list[int], n: int) -> Job:
    return Job(i, prompt, Sampling(max_tokens=n, temperature=0), set())


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_running_rows(model):
    short = prompts(5, 4, 7)
    long = prompts(100, seed=2)[0]
    backend = Counting(model, 8)
    scheduler = Scheduler(backend, prefill_chunk=16)
    running = [greedy(i, p, 30) for i, p in enumerate(short)]
    late = greedy(9, long, 12)
    run_all(scheduler, running, {4: [late]})
    for job, prompt in zip(running, short):
        assert job.fed == alone(model, prompt, 30)
    assert late.fed == alone(model, long, 12)
    # Step 1 prefills the three short prompts together (one forward); from step 5 on the long
    # prompt goes in chunks of 16 tokens, each beside the three rows' one-token decode segments.
    assert backend.calls[0] == [(0, 5), (1, 4), (2, 7)]
    chunked = [c for c in backend.calls if any(n > 1 for _, n in c)][1:]
    assert [n for c in chunked for row, n in c if n > 1] == [16] * 6 + [4]
    assert all(sorted(n for _, n in c)[:3] == [1, 1, 1] for c in chunked)


def test_several_waiting_prompts_are_prefilled_in_one_forward_up_to_the_budget(model):
    ps = prompts(6, 11, 4, 9)
    backend = Counting(model, 8)
    scheduler = Scheduler(backend, prefill_chunk=20)
    jobs = [greedy(i, p, 8) for i, p in enumerate(ps)]
    run_all(scheduler, jobs)
    for job, p in zip(jobs, ps):
        assert job.fed == alone(model, p, 8)
    # 6 + 11 fit the budget of 20, the third gets the 3 tokens left; the fourth waits a step.
    assert backend.calls[0] == [(0, 6), (1, 11), (2, 3)]
    assert backend.calls[1] == [(0, 1), (1, 1), (2, 1), (3, 9)]


def test_a_shared_prefix_is_computed_once_and_answers_are_the_same(model):
    system = prompts(50, seed=3)[0]
    questions = prompts(5, 8, 3, seed=4)
    backend = Counting(model, 8)
    cache = PrefixCache(1 << 30, block_size=16)
    scheduler = Scheduler(backend, prefill_chunk=256, prefix_cache=cache)
    first = greedy(0, system + questions[0], 10)
    run_all(scheduler, [first])
    later = [greedy(i + 1, system + q, 10) for i, q in enumerate(questions[1:])]
    run_all(scheduler, later)
    for job, q in zip([first, *later], questions):
        assert job.fed == alone(model, system + q, 10)
    # The system prompt's three full blocks (48 tokens) come from the cache for the later two.
    assert [n for c in backend.calls for _, n in c if n > 1] == [55, 58 - 48, 53 - 48]
    assert cache.hit_tokens == 2 * 48 and cache.query_tokens == 55 + 58 + 53
    assert scheduler.prefilled_tokens == 55 + 10 + 5


def test_a_prompt_wholly_cached_still_computes_its_last_token(model):
    p = prompts(32, seed=5)[0]
    cache = PrefixCache(1 << 30, block_size=16)
    scheduler = Scheduler(Counting(model, 4), prefix_cache=cache)
    a, b = greedy(0, p, 6), greedy(1, p, 6)
    run_all(scheduler, [a])
    run_all(scheduler, [b])
    assert a.fed == b.fed == alone(model, p, 6)
    assert cache.hit_tokens == 16  # (32 - 1) // 16 blocks: the last token is computed


def test_the_cache_holds_exact_chains_within_its_bytes_and_evicts_leaves_first():
    stored = []

    def read(start, end):
        stored.append((start, end))
        return [torch.zeros(4) for _ in range(start, end)]  # 16 bytes a block

    cache = PrefixCache(16 * 4, block_size=2)
    a = [1, 2, 3, 4, 5, 6, 7]
    cache.store(a, 6, read)  # blocks (1,2) (3,4) (5,6)
    assert stored == [(0, 3)] and len(cache) == 3
    # The same tokens after another beginning are another block: nothing shared.
    assert cache.lookup([9, 9, 3, 4, 5]) == []
    assert len(cache.lookup([1, 2, 3, 4, 8])) == 2
    cache.store([1, 2, 3, 4, 5, 6], 6, read)  # all cached: nothing read
    assert stored == [(0, 3)]
    cache.store([1, 2, 8, 8, 8], 4, read)  # one new block after (1,2): 4 blocks, 64 bytes
    assert stored[-1] == (1, 2) and cache.nbytes == 64
    cache.store([7, 7, 7], 2, read)  # a fifth block: the least recent leaf goes, (5,6) after (3,4)
    assert cache.nbytes == 64 and cache.evicted_blocks == 1
    assert len(cache.lookup([1, 2, 3, 4, 5, 6, 0])) == 2  # (1,2) (3,4) left, (5,6) evicted
    assert len(cache.lookup([1, 2, 8, 8, 0])) == 2
    assert PrefixCache(0).capacity == 0
