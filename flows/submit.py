"""Run the pipeline on a work pool's worker through its deployment (`gptforge pipeline --pool`)."""

from __future__ import annotations

import logging
import os

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from gptforge.errors import BadInput, StageFailed

log = logging.getLogger("gptforge")


def submit_pipeline(pool: str, parameters: dict) -> None:
    """Trigger deployment `pipeline/POOL` and wait for its flow run to finish."""
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise BadInput(
            f"--pool {pool} needs a Prefect server with workers: set PREFECT_API_URL "
            "(e.g. http://127.0.0.1:4200/api, see docker/compose.yaml)"
        )
    name = f"pipeline/{pool}"
    with get_client(sync_client=True) as client:
        try:
            work_pool = client.read_work_pool(pool)
        except ObjectNotFound:
            pools = sorted(p.name for p in client.read_work_pools())
            raise BadInput(
                f"work pool '{pool}' does not exist on {url} (pools: {', '.join(pools) or 'none'}); "
                f"create it with `prefect work-pool create {pool} --type process` (or --type docker)"
            ) from None
        try:
            client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise BadInput(
                f"no deployment '{name}' on {url}: run `prefect --no-prompt deploy --all` in the repository first"
            ) from None
    if str(getattr(work_pool.status, "value", work_pool.status)).upper() != "READY":
        log.warning(
            "no worker is polling work pool %s yet: the run waits until one starts (`prefect worker start --pool %s`)",
            pool,
            pool,
        )
    flow_run = run_deployment(name, parameters=parameters, timeout=None, as_subflow=False)
    state = flow_run.state
    log.info("flow run %s of %s finished: %s", flow_run.name, name, state.name if state else "unknown")
    if state is None or not state.is_completed():
        raise StageFailed(
            f"pipeline run {flow_run.name} on pool {pool} ended {state.name if state else 'unknown'}: "
            f"{' '.join(str(state.message if state else '').split())}"
        )
