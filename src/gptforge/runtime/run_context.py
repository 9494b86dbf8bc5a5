"""What a run records about where and how it ran: the git commit, the device, tags a launching
process hands down (`GPTFORGE_RUN_TAGS`), the pinned pip requirements of a logged model, and the
system-metrics sampler (CPU, memory, disk, network, GPU) that publishes through the run."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

log = logging.getLogger("gptforge")

TAGS_ENV = "GPTFORGE_RUN_TAGS"


TAGS_ENV = "GPTFORGE_RUN_TAGS"


def start_system_metrics(run):
    """MLflow's system metrics sampler (CPU, memory, disk, network, GPU), publishing through
    `run.log_metrics`, hence through the outbox. MLflow's own loop asks the server for the run's
    status at every sample and stops for good at the first failed request: one restart of the
    server would end system metrics for the rest of a long run. This one never calls the server.
    Returns the started sampler, or None (a warning says why) when it cannot start."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        class Monitor(SystemMetricsMonitor):
            def monitor(self):
                try:
                    while not self._shutdown_event.is_set():
                        for _ in range(self.samples_before_logging):
                            self.collect_metrics()
                            if self._shutdown_event.wait(self.sampling_interval):
                                return
                        self.publish_metrics(self.aggregate_metrics())
                except Exception as e:  # noqa: BLE001 - a sampler failure must not touch the run
                    log.warning("MLflow: system metrics stopped (%s: %s)", type(e).__name__, e)

            def finish(self):
                self._shutdown_event.set()
                if self._process is not None:
                    self._process.join(timeout=5)  # it only waits on the event: quick
                    self._process = None

        class Sink:  # stands in for MLflow's BatchMetricsLogger
            def record_metrics(self, metrics, step=None):
                run.log_metrics(metrics, step=step)

            def flush(self):
                pass

        monitor = Monitor(run.run_id, tracking_uri=run.uri)
        monitor.mlflow_logger = Sink()
        monitor.start()
    except Exception as e:  # noqa: BLE001 - system metrics are a convenience
        log.warning("MLflow: system metrics not logged (%s: %s)", type(e).__name__, e)
        return None
    return monitor


def pinned_requirements(*packages: str) -> list[str]:
    """`pkg==version` pip requirements of the installed `packages` (local version labels such as
    +cpu dropped; a package that is not installed is left out), for logged MLflow models."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for pkg in packages:
        try:
            pins.append(f"{pkg}=={version(pkg).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return pins


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """HEAD of the working tree; in the worker image (no .git) the commit it was built from."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("GPTFORGE_GIT_COMMIT") or None
    return out.stdout.strip() or None


def device_name() -> str:
    """The device the run computes on. A stage that has not loaded torch (the data stages)
    runs on the CPU: importing torch (seconds) only to name a GPU it does not use is waste."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "cpu"
    try:
        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.get_device_name(0)}"
    except Exception:  # broken CUDA: tags are best effort
        pass
    return "cpu"


def env_tags() -> dict[str, Any]:
    """Tags handed down by a launching process in `GPTFORGE_RUN_TAGS`; a malformed value is
    named in a warning and ignored (tags never fail a run)."""
    raw = os.environ.get(TAGS_ENV)
    if not raw:
        return {}
    try:
        tags = json.loads(raw)
    except ValueError:
        tags = None
    if not isinstance(tags, dict):
        log.warning("%s is not a JSON object, ignored: %.200s", TAGS_ENV, raw)
        return {}
    return tags
