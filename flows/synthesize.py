"""The synthesize stage (documents -> checked question/answer pairs) as a Prefect flow (deployment entry point)."""

from flows.stages import stage_flow

synthesize = stage_flow("synthesize")
