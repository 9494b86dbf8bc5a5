"""The stage flows: `stage_flow` makes the Prefect flow of a stage of the stage table (deployments run it);
`run_stage_flow` runs one as a subflow of the pipeline's flow run."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from prefect import Flow, Task, flow, runtime
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.flow_engine import run_flow
from prefect.states import Completed, Failed, Running

from flows.outage import Finished, best_effort, run_recorded
from gptforge.config.load import DEFAULT_PARAMS, load_config
from gptforge.pipeline.stages import STAGES, flow_name, metrics_markdown, run_stage
from gptforge.runtime.recording import PIPELINE_FLOW_ENV
from gptforge.runtime.signals import deadline_on_stop
from tasks import PrefectSteps


def temporary_server_in_own_session() -> None:
    """Make the temporary Prefect server (the one Prefect starts on first use when no
    PREFECT_API_URL is set) start in a session of its own.

    As Prefect starts it, it shares the terminal's process group with the command: Ctrl-C (SIGINT
    to that whole group) killed the server at once while the stages it had started under dvc,
    stopping, still reported to it; their Prefect clients then retried for minutes and the
    pipeline, waiting for them, hung. In its own session the server hears only its owner, which
    stops it after the flow, its stages included, has ended (`gptforge.cli.stages._stop_temporary_server`).
    Prefect's own start-up code runs unchanged; only the Popen it calls gets
    `start_new_session=True`, for the duration of that call."""
    import functools
    import subprocess
    from unittest import mock

    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # a real server (environment or Prefect profile): nothing to start
        return
    from prefect.server.api import server as server_module

    base = server_module.SubprocessASGIServer
    if None in base._instances:
        return

    class OwnSessionServer(base):
        def _run_uvicorn_command(self):
            popen = functools.partial(subprocess.Popen, start_new_session=True)
            with mock.patch.object(server_module.subprocess, "Popen", popen):
                return super()._run_uvicorn_command()

    OwnSessionServer()  # registered as the port-less instance that Prefect's clients start


def flow_run_tags() -> dict[str, str]:
    return {"prefect.flow_run_id": str(runtime.flow_run.id), "prefect.flow_run_name": runtime.flow_run.name}


def stage_flow(stage: str) -> Flow:
    """A flow that loads the params and runs the stage's recipe with its steps as tasks. Its
    metrics become a markdown artifact, and so does the markdown report the stage writes (the
    stage table's `report`). A stage command typed in a shell makes the same flow run through
    its journal instead (`gptforge.pipeline.stages.run_recorded`); deployments run this one."""
    summary, report = STAGES[stage].summary, STAGES[stage].report
    finished = Finished()

    def run(params: str | None = DEFAULT_PARAMS, overrides: list[str] | None = None) -> dict:
        cfg = load_config(params, overrides or [])
        finished.flow_run_id = str(runtime.flow_run.id)
        with deadline_on_stop():  # Prefect's SIGTERM bridge is in place now: a stop ends in bounded time
            metrics = run_stage(stage, cfg, steps=PrefectSteps(), tags=flow_run_tags())
        key = flow_name(stage)
        best_effort(
            "artifacts",
            create_markdown_artifact,
            key=f"{key}-metrics",
            markdown=metrics_markdown(stage, metrics),
            description=f"{stage} metrics",
        )
        if report is not None and Path(report).is_file():
            best_effort(
                "artifacts",
                create_markdown_artifact,
                key=f"{key}-report",
                markdown=Path(report).read_text(encoding="utf-8"),
                description=f"{stage}: {report}",
            )
        return finished.keep(metrics)

    run.__name__ = stage
    run.__doc__ = f"Stage `{stage}`: {summary}."
    stage_flow_ = flow(run, name=flow_name(stage), description=summary, validate_parameters=True)
    stage_flow_.gptforge_finished = finished  # read by run_stage_flow
    return stage_flow_


def run_stage_flow(stage_flow_: Flow, parameters: dict[str, Any]) -> Any:
    """Run a stage's flow; started by the pipeline (its flow run id in the environment), as a
    subflow of the pipeline's flow run although it runs in another process (`dvc repro` starts
    it). Prefect links a subflow through a task run of the parent that stands for it: make
    that task run, make the flow run with it as parent, run the flow, then settle the task
    run's state like the flow run's."""
    finished: Finished = stage_flow_.gptforge_finished
    parent = os.environ.get(PIPELINE_FLOW_ENV)
    if not parent:
        return run_recorded(lambda: stage_flow_(**parameters), finished, f"flow run {stage_flow_.name}")
    with get_client(sync_client=True) as client:
        tracker = Task(name=stage_flow_.name, fn=lambda: None)
        tracker.task_key = f"gptforge.stage.{stage_flow_.name}"
        task_run = client.create_task_run(
            task=tracker, flow_run_id=uuid.UUID(parent), dynamic_key=str(uuid.uuid4()), state=Running()
        )
        flow_run = client.create_flow_run(
            stage_flow_, parameters=stage_flow_.serialize_parameters(parameters), parent_task_run_id=task_run.id
        )
    try:
        result = run_recorded(
            lambda: run_flow(stage_flow_, flow_run=flow_run, parameters=parameters),
            finished,
            f"flow run {stage_flow_.name}",
        )
        final = Completed()
        return result
    except BaseException as e:
        final = Failed(message=f"{type(e).__name__}: {e}")
        raise
    finally:
        best_effort("subflow states", _set_task_run_state, task_run.id, final)


def _set_task_run_state(task_run_id: uuid.UUID, state) -> None:
    with get_client(sync_client=True) as client:
        client.set_task_run_state(task_run_id, state, force=True)
