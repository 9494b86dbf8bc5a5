"""The fine-tuning stages as Prefect flows (deployment entry points)."""

from flows.stages import stage_flow

finetune_classify = stage_flow("finetune_classify")
finetune_instruct = stage_flow("finetune_instruct")
finetune_instruct_variant = stage_flow("finetune_instruct_variant")
finetune_preference = stage_flow("finetune_preference")
train_reward = stage_flow("train_reward")
finetune_rl = stage_flow("finetune_rl")
