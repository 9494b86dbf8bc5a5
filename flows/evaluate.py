"""The evaluation stage as a Prefect flow (deployment entry point)."""

from flows.stages import stage_flow

evaluate = stage_flow("evaluate")
