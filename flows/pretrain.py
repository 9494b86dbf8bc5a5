"""The pretraining stage as a Prefect flow (deployment entry point)."""

from flows import stage_flow

pretrain = stage_flow("pretrain")
