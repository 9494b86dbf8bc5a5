"""The benchmark stage as a Prefect flow (deployment entry point)."""

from flows.stages import stage_flow

benchmark = stage_flow("benchmark")
