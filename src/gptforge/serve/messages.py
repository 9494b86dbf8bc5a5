"""The messages between the API side (`serve.engine`) and the engine core (`serve.engine_core`),
typed: the same dataclasses whether the core runs in a thread of the API process (a queue carries
them) or in a process of its own (`serve.engine_process`: pickled over a socket pair).

API side -> engine: `Add` a job, `Cancel` one, `Stop`.
Engine -> API side: `Drawn` after every step (each job's token and the scheduler's `Stats`),
`Failed` when a step raised (those jobs end with an error; the loop goes on).
Engine process start-up: `Ready` (what the API side needs of the model) or `LoadFailed` (one line).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gptforge.serve.sampling import Sampling


@dataclass(frozen=True)
class Add:
    job_id: int
    prompt_ids: list[int]
    sampling: Sampling
    stop_ids: frozenset[int]


@dataclass(frozen=True)
class Cancel:
    job_id: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass
class Stats:
    """The scheduler's counters after a step, for /metrics and the tests."""

    running: int = 0
    steps: int = 0
    prefilled_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_cache_bytes: int = 0
    drafted_tokens: int = 0  # speculative decoding (`--speculate`): tokens drafted
    accepted_tokens: int = 0  # and those the model kept


@dataclass(frozen=True)
class Drawn:
    tokens: list[tuple[int, int]]  # (job id, token), in the step's order
    stats: Stats = field(default_factory=Stats)


@dataclass(frozen=True)
class Failed:
    job_ids: list[int]
    reason: str  # "ErrorType: message"


@dataclass(frozen=True)
class Ready:
    context: int
    n_vocab: int
    stop_ids: list[int]


@dataclass(frozen=True)
class LoadFailed:
    reason: str  # one line
