"""Prefect flows, one per DVC stage. `stage_flow` makes the flow for a stage of the stage table."""

from __future__ import annotations

from prefect import Flow, flow, runtime
from prefect.artifacts import create_markdown_artifact

from gptforge.config import DEFAULT_PARAMS, load_config
from gptforge.stages import STAGES, run_stage
from tasks import PrefectSteps


def flow_run_tags() -> dict[str, str]:
    return {"prefect.flow_run_id": str(runtime.flow_run.id), "prefect.flow_run_name": runtime.flow_run.name}


def metrics_markdown(stage: str, metrics: dict) -> str:
    rows = "\n".join(f"| `{k}` | {v:,.4g} |" if isinstance(v, float) else f"| `{k}` | {v:,} |"
                     for k, v in metrics.items())
    return f"### {stage}\n\n| metric | value |\n| --- | --- |\n{rows}\n"


def stage_flow(stage: str) -> Flow:
    """A flow that loads the params and runs the stage's recipe with its steps as tasks."""
    summary = STAGES[stage].summary

    def run(params: str | None = DEFAULT_PARAMS, overrides: list[str] | None = None) -> dict:
        cfg = load_config(params, overrides or [])
        metrics = run_stage(stage, cfg, steps=PrefectSteps(), tags=flow_run_tags())
        create_markdown_artifact(key=f"{stage.replace('_', '-')}-metrics", markdown=metrics_markdown(stage, metrics),
                                 description=f"{stage} metrics")
        return metrics

    run.__name__ = stage
    run.__doc__ = f"Stage `{stage}`: {summary}."
    return flow(run, name=stage.replace("_", "-"), description=summary, validate_parameters=True)
