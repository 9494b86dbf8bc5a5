"""Keep freed memory in the process on Linux CPUs: glibc malloc's thresholds, raised once.

glibc serves every allocation above its mmap threshold (128 KiB, adapting up to 32 MiB) with a
fresh `mmap` and gives it back with `munmap` when freed; a kept heap top above 128 KiB is also
trimmed back to the OS. A training step on the CPU allocates and frees the same large tensors
every step (a (tokens x 50,257) logits buffer is hundreds of MB), so each step pays the kernel
to zero and map those pages again: page faults, measured as system time larger than the user
time. With the thresholds raised the freed blocks stay in the heap and are reused.

Measured on a 2-core AMD EPYC (2026-11-24), glibc as it ships against the raised thresholds:
trl's fused log-probability head, forward and backward over 16 x 86 tokens of the quickstart
GPT (the preference stage's step): 3.24 s -> 1.08 s; `benchmarks/bench_train_step.py` on the
quickstart params (a pretraining step): 1,936 -> 3,053 tokens/s (the thresholds set through
MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, which glibc reads at start).
The cost: a process keeps its peak heap until it exits.

`gptforge`'s command line calls `keep_freed_memory()` first thing, so every stage gets it.

`mallopt` only changes how later allocations are served, so calling it after torch is imported
is fine. Anything that is not glibc (macOS, musl) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True when it applied."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = (
        mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
        and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
        and mallopt(_M_TOP_PAD, 1 << 28) == 1
    )
    _done = ok
    return ok
