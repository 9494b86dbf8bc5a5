"""The registry stage as a Prefect flow (deployment entry point)."""

from flows import stage_flow

register = stage_flow("register")
