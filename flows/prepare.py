"""The data-preparation stages (and the base-model fetch) as Prefect flows (deployment entry points)."""

from flows.stages import stage_flow

prepare_pretrain = stage_flow("prepare_pretrain")
prepare_classify = stage_flow("prepare_classify")
prepare_instruct = stage_flow("prepare_instruct")
prepare_base = stage_flow("prepare_base")
prepare_preference = stage_flow("prepare_preference")
