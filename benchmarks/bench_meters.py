"""What the training benchmarks measure a run with: the process's resident memory and its peak
during training (`PeakRSS`), a clock stamped after every optimizer step (`StepClock`), and the
machine they ran on (`machine`). Used by bench_lora.py and bench_generate_hf.py."""

from __future__ import annotations

import os
import platform
import resource
import time


def rss_mb() -> float:
    """Resident set size now (Linux /proc; the high-water mark elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return maxrss_mb()


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def hwm_mb() -> float | None:
    """The address space's RSS high-water mark (VmHWM), None where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


class PeakRSS:
    """The subprocess's peak RSS during training, above its RSS after loading.

    `ru_maxrss` alone would not do: Linux carries a process's maximum RSS across fork and exec,
    so a child starts with its parent's high-water mark (the parent here held the model for the
    initial held-out loss). So `loaded()` resets the address space's own high-water mark
    (VmHWM; writing 5 to /proc/self/clear_refs, Linux >= 4.0) and the peak is VmHWM at the end;
    where that cannot be done, it falls back to ru_maxrss and says so in `peak_source`."""

    def loaded(self) -> None:
        self.rss_after_load, self.hwm_after_load, self.maxrss_after_load = rss_mb(), hwm_mb(), maxrss_mb()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = hwm_mb() is not None
        except OSError:
            self.reset = False

    def result(self) -> dict:
        peak = hwm_mb() if self.reset else maxrss_mb()
        return {
            "rss_after_load_mb": round(self.rss_after_load, 1),
            "peak_while_loading_mb": round(self.hwm_after_load or self.maxrss_after_load, 1),
            "peak_rss_mb": round(peak, 1),
            "peak_rss_growth_mb": round(peak - self.rss_after_load, 1),
            "ru_maxrss_mb": round(maxrss_mb(), 1),
            "peak_source": "VmHWM reset after loading" if self.reset else "ru_maxrss (VmHWM not resettable)",
        }


class StepClock:
    """perf_counter stamps after every step of the optimizer that trains `param` (a global
    torch.optim post-hook, so it sees Trainer's optimizer as well as ours), with the real
    tokens so far from `real_tokens()`."""

    def __init__(self, param, real_tokens=None) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.param, self.real_tokens, self.optimizer = param, real_tokens, None
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.handle = register_optimizer_step_post_hook(self._hook)

    def _hook(self, optimizer, args, kwargs) -> None:
        if self.optimizer is None and any(p is self.param for g in optimizer.param_groups for p in g["params"]):
            self.optimizer = optimizer
        if optimizer is self.optimizer:
            self.times.append(time.perf_counter())
            if self.real_tokens is not None:
                self.tokens.append(self.real_tokens())

    def window(self, per_step_tokens: list[int], warmup: int) -> dict:
        """Real tokens/s over the steps after `warmup` (from the end of step `warmup`)."""
        self.handle.remove()
        steps = len(self.times)
        if steps != len(per_step_tokens):
            raise RuntimeError(f"{steps} optimizer steps but {len(per_step_tokens)} batches")
        if steps <= warmup:
            raise SystemExit(f"{steps} steps leave none to time after --warmup {warmup}")
        seconds = self.times[-1] - self.times[warmup - 1]  # warmup >= 1: the first step's start is not stamped
        tokens = sum(per_step_tokens[warmup:])
        return {
            "steps": steps,
            "warmup_steps": warmup,
            "timed_steps": steps - warmup,
            "timed_s": round(seconds, 4),
            "timed_real_tokens": tokens,
            "tokens_per_sec": round(tokens / seconds, 2),
        }


def machine() -> dict:
    from machine import cpu_model

    name = cpu_model() or platform.machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": name, "cores": cores, "arch": platform.machine()}
