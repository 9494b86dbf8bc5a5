"""The evaluation stages as Prefect flows (deployment entry points): `evaluate` (every model of
evaluate.models, or the one of `evaluate.only`) and `evaluate_report` (the report over their results)."""

from flows.stages import stage_flow

evaluate = stage_flow("evaluate")
evaluate_report = stage_flow("evaluate_report")
