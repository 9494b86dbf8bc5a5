"""`gptforge pipeline` typed with Prefect on: the pipeline's own flow run journaled like a
stage's (`gptforge.runtime.recording`), so the command starts `dvc repro` at once instead of
first waiting for a Prefect server (the recorder's own one takes about 10 s to start on a fresh
machine, its database's migrations included).

The recorder makes the flow run, with a task run per step (`dvc-pull`, `dvc-repro`, `dvc-push`),
the pipeline's log lines and its `pipeline-summary` artifact. Each stage's flow run names its
parent by the pipeline journal's key (GPTFORGE_PIPELINE_JOURNAL) and the recorder makes it a
subflow of that flow run, as Prefect's engine would. The pipeline's MLflow run is made in this
process, as before (its stages nest under its run id), and tagged with the flow run once the
recorder has made it. A pipeline that a Prefect worker runs from a deployment is a flow in
Prefect's engine instead (`flows/pipeline.py`).
"""

from __future__ import annotations

import os
from typing import Sequence

from gptforge.pipeline.run import run_pipeline
from gptforge.pipeline.summary import closing_summary

# How long the pipeline's end waits for the recorder to have made its flow run (for its MLflow
# run's tags and the summary's link): by then the stages' journals are delivered, which needed
# it, unless the Prefect server is away (the records are delivered later; the tags then lack it).
FLOW_RUN_WAIT_SECONDS = 10.0


def run_pipeline_recorded(
    stages: Sequence[str], *, params: str | None, overrides: Sequence[str], pull: bool, push: bool, force: bool
) -> list[str]:
    """Run the pipeline with its flow run journaled; the closing summary's lines. A failed
    stage raises StageFailed after the summary artifact is recorded."""
    from gptforge.runtime import recording

    parameters = {
        "stages": list(stages),
        "params": params,
        "overrides": list(overrides),
        "pull": pull,
        "push": push,
        "force": force,
    }
    with recording.recorded(
        stage="pipeline",
        flow_name="pipeline",
        summary="dvc repro of every stage (or the named ones), each stage a subflow",
        parameters=parameters,
        prefect=True,
        mlflow=False,
    ) as steps:
        made: dict[str, str] = {}

        def flow_run_tags() -> dict[str, str]:
            api = os.environ.get("PREFECT_API_URL")
            if api is None or recording.answers(api):  # else the flow run cannot be made now
                made.update(recording.flow_run_of(steps.journal, timeout=FLOW_RUN_WAIT_SECONDS))
            return made

        # For its stages (their parent) and for this process (recording.pending leaves it out).
        os.environ[recording.PIPELINE_JOURNAL_ENV] = steps.journal.key
        try:
            report = run_pipeline(
                stages,
                params=params,
                overrides=overrides,
                pull=pull,
                push=push,
                force=force,
                steps=steps,
                late_tags=flow_run_tags,
            )
        finally:
            os.environ.pop(recording.PIPELINE_JOURNAL_ENV, None)
        steps.journal.write(
            "artifact_md",
            key="pipeline-summary",
            markdown=report.markdown(),
            description="each stage's status, duration, headline metrics and MLflow run",
        )
        report.raise_for_failure()
        api = os.environ.get("PREFECT_API_URL") or recording.own_prefect_url()
        return closing_summary(report, prefect_flow_run=made.get("prefect.flow_run_id"), prefect_api=api)
