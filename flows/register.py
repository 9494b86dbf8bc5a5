"""The registry stage as a Prefect flow (deployment entry point). Its Prefect artifacts: the
metrics, and reports/register.md, which says which version each model got and whether it passed
the promotion gate, and why."""

from flows.stages import stage_flow

register = stage_flow("register")  # every model of registry.names, or the one of registry.only
register_report = stage_flow("register_report")  # the report over the per-model outcomes
