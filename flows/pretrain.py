"""The pretraining stage as a Prefect flow (deployment entry point)."""

from flows.stages import stage_flow

pretrain = stage_flow("pretrain")
