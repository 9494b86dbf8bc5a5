"""The pipeline as a Prefect flow: `dvc repro` with every stage's flow run as its subflow.

The flow hands its Prefect API (a real server, or the temporary one Prefect started for this
process) and its flow run id to the stage commands that `dvc repro` starts, so they report to
the same server, without starting one each, and show up as subflows of this run. The MLflow
nesting is the library's (`gptforge.pipeline.run`).
"""

from __future__ import annotations

from prefect import flow, runtime
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client

from flows.outage import Finished, best_effort
from flows.stages import flow_run_tags
from gptforge.pipeline.run import run_pipeline
from gptforge.pipeline.summary import closing_summary
from gptforge.runtime.recording import PIPELINE_FLOW_ENV
from tasks import PrefectSteps


@flow(
    name="pipeline",
    description="dvc repro of every stage (or the named ones), each stage a subflow",
    validate_parameters=True,
)
def pipeline(
    stages: list[str] | None = None,
    params: str | None = None,
    overrides: list[str] | None = None,
    pull: bool = True,
    push: bool = True,
    force: bool = False,
) -> dict:
    """Run `dvc repro` for `stages` (default: all). `params` (a file) and `overrides`
    (`key=value`) are written to params.yaml first, so DVC tracks them."""
    with get_client(sync_client=True) as client:
        api_url = str(client.api_url).rstrip("/")
    env = {"PREFECT_API_URL": api_url, PIPELINE_FLOW_ENV: str(runtime.flow_run.id)}
    FINISHED.flow_run_id = str(runtime.flow_run.id)
    report = run_pipeline(
        stages or [],
        params=params,
        overrides=overrides or [],
        pull=pull,
        push=push,
        force=force,
        steps=PrefectSteps(),
        env=env,
        tags=flow_run_tags(),
    )
    best_effort(
        "artifacts",
        create_markdown_artifact,
        key="pipeline-summary",
        markdown=report.markdown(),
        description="each stage's status, duration, headline metrics and MLflow run",
    )
    report.raise_for_failure()
    return FINISHED.keep(
        {
            "stages": {s.name: s.status for s in report.stages},
            "summary": closing_summary(report, prefect_flow_run=str(runtime.flow_run.id)),
        }
    )


FINISHED = Finished()  # the pipeline's result once it has one (flows.outage.run_recorded)
