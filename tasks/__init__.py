"""Prefect tasks: the library's recipe steps, each run as a Prefect task.

A recipe calls its steps through a `gptforge.runtime.steps.Steps` object; `PrefectSteps` turns each
call into a task run (named after the library function) so the Prefect UI shows every step
with its logs, duration and state. Steps the recipe marks with a `Retry` (downloads) get
Prefect retries with the same exponential backoff; errors that retrying cannot fix (bad input,
HTTP 4xx) fail at once.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE

from gptforge.runtime.signals import stop_cause
from gptforge.runtime.steps import Retry, Steps, retryable

T = TypeVar("T")


def _retry_condition(task_, task_run, state) -> bool:
    exc = state.data if isinstance(state.data, BaseException) else None
    return exc is None or retryable(exc)


class PrefectSteps(Steps):
    def __call__(self, fn: Callable[..., T], /, *args: Any, retry: Retry | None = None, **kwargs: Any) -> T:
        options: dict[str, Any] = {
            "name": fn.__name__.replace("_", "-"),
            # Steps take configs, paths and arrays; caching their results would hide re-runs
            # that DVC asked for.
            "cache_policy": NO_CACHE,
            "persist_result": False,
        }
        if retry is not None:
            options.update(
                retries=retry.retries, retry_delay_seconds=retry.delays() or 0, retry_condition_fn=_retry_condition
            )
        try:
            return task(fn, **options)(*args, **kwargs)
        except Exception as e:
            stop = stop_cause(e)
            if stop is None:
                raise
            raise stop from None  # the stop itself, so the flow run ends Crashed and the run KILLED
