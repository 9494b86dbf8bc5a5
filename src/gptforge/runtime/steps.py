"""How a recipe runs its steps.

A stage recipe is a plain function that calls its steps through a `Steps` object:
`steps(download, url, dest, retry=Retry(3, 2.0))`. The default runs each step directly (with
retries where asked), so recipes work under torchrun or in a notebook; `tasks.PrefectSteps`
runs each step as a Prefect task instead, so the same recipe shows its task runs, retries and
logs in the Prefect UI. The library itself never imports Prefect.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from gptforge.errors import BadInput

T = TypeVar("T")
log = logging.getLogger("gptforge")


@dataclass(frozen=True)
class Retry:
    retries: int  # extra attempts after the first
    backoff: float  # seconds before the first retry; doubles each time

    def delays(self) -> list[float]:
        return [self.backoff * 2**i for i in range(self.retries)]


def retryable(exc: BaseException) -> bool:
    """Bad input does not get better by trying again, nor does an error that says so
    (`retryable = False`, e.g. an HTTP 404); everything else may (network, disk)."""
    return isinstance(exc, Exception) and not isinstance(exc, BadInput) and getattr(exc, "retryable", True)


class Steps:
    def __call__(self, fn: Callable[..., T], /, *args: Any, retry: Retry | None = None, **kwargs: Any) -> T:
        delays = retry.delays() if retry else []
        for attempt in range(len(delays) + 1):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if attempt == len(delays) or not retryable(e):
                    raise
                self.retrying(fn, e, attempt + 1, len(delays), delays[attempt])
                time.sleep(delays[attempt])
        raise AssertionError("unreachable")

    def retrying(self, fn: Callable, error: Exception, attempt: int, retries: int, delay: float) -> None:
        """Said before retry `attempt` of `retries`, `delay` seconds from now."""
        log.warning(
            "%s failed (%s: %s); retry %d/%d in %.1fs",
            fn.__name__,
            type(error).__name__,
            error,
            attempt,
            retries,
            delay,
        )


DIRECT = Steps()
