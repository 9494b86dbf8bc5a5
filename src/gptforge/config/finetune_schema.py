"""The fine-tuning stages' sections of `params.yaml`: `classify`, `instruct`, `preference`, and
what they share (the starting model, the device, the batches, LoRA, the processes and strategy).

`gptforge.config.schema.Config` holds them; the fields are documented where they are declared.
"""

from __future__ import annotations

import difflib
from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from gptforge.config.section import Section

# trl 1.16's DPOTrainer loss types (DPOConfig.loss_type); sigmoid is DPO's own.
DPO_LOSSES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)


class LoraConfig(Section):
    r: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # auto: every nn.Linear inside the transformer blocks (GPT-2's c_attn, c_proj, c_fc; Llama's
    # and Qwen's q/k/v/o_proj, gate/up/down_proj: peft's all-linear), or a list of module names.
    target_modules: Union[Literal["auto"], list[str]] = "auto"


class FinetuneCommon(Section):
    # a gptforge checkpoint folder, gpt2 / gpt2-medium / ... (converted to gptforge's GPT), or any
    # Hugging Face causal LM: a local folder or a hub id (Qwen/Qwen2.5-0.5B-Instruct), kept as it is
    init_from: str = "checkpoints/pretrain/final"
    device: str = "auto"
    # auto: bf16 on CUDA, fp32 on the CPU; auto-bf16: bf16 on CUDA and on CPUs with native bf16
    # (AVX-512 BF16 or AMX: about 2x fp32 there), fp32 on other CPUs (bf16 is 15-36x slower on AVX2)
    precision: Literal["auto", "auto-bf16", "fp32", "bf16", "fp16"] = "auto"
    seed: int = 123
    batch_size: int = Field(8, gt=0)
    epochs: int = Field(3, gt=0)
    lr: float = Field(5e-5, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    eval_interval: int = Field(50, gt=0, description="optimizer steps between evaluations")
    max_length: Optional[int] = Field(None, gt=1, description="null: the model's block_size")
    lora: LoraConfig = LoraConfig()
    # recompute each block's activations in the backward pass: less memory, ~1/3 more compute
    gradient_checkpointing: bool = False
    # Above 1 process in all (x distributed.nnodes) the stage launches itself under torchrun; each
    # process reads its own part of every batch (batch_size is the whole batch), process 0 writes.
    nproc_per_node: int = Field(1, gt=0, description="training processes on each node (one per GPU)")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: a whole copy per process | fsdp: weights, grads and AdamW states split (FSDP2)"
    )


def ddp_only(section: FinetuneCommon, name: str, what: str) -> FinetuneCommon:
    """The trl stages run their processes through accelerate's DDP here: fsdp is refused, not ignored."""
    if section.strategy == "fsdp":
        raise ValueError(
            f"{name}.strategy: fsdp is not available for {what}: trl's trainer runs the processes "
            "through accelerate's DDP here (a whole copy each); use ddp"
        )
    return section


class ClassifyConfig(FinetuneCommon):
    # head: the new head only; last_block: + last transformer block and final LayerNorm
    # (LLMs-from-scratch ch. 6); all: every weight; lora: LoRA adapters + the head.
    trainable: Literal["head", "last_block", "all", "lora"] = "all"
    eval_batches: int = Field(5, gt=0, description="validation batches per evaluation")
    n_classes: int = Field(2, ge=2)
    epochs: int = Field(5, gt=0)


class JudgeConfig(Section):
    # An OpenAI-compatible endpoint (Ollama http://127.0.0.1:11434/v1, vLLM, gptforge serve) and
    # its model: scores each test response 0-100 (LLMs-from-scratch ch. 7). Unset: no judge.
    # The API key, if the server needs one, comes from the environment: GPTFORGE_JUDGE_API_KEY.
    url: Optional[str] = None
    model: Optional[str] = None


class InstructConfig(FinetuneCommon):
    # alpaca | phi3 (any model) | chat (the tokenizer's own chat template: Hugging Face models)
    template: Literal["alpaca", "phi3", "chat"] = "alpaca"
    method: Literal["full", "lora"] = "full"
    eval_batches: int = Field(5, gt=0, description="validation batches per evaluation")
    # 4bit: QLoRA (bitsandbytes NF4 weights, bf16 compute; method lora, CUDA only)
    quantize: Optional[Literal["4bit"]] = None
    # batches of similar lengths (shuffled in groups of 50 batches), so little compute goes to padding
    group_by_length: bool = True
    judge: JudgeConfig = JudgeConfig()
    max_samples: Optional[int] = Field(None, gt=0, description="training records used (the split's first N); null: all")
    # the starting model's test loss and answer scores too (metrics *_before, responses side by side)
    score_before: bool = False

    @model_validator(mode="after")
    def _check(self):
        if self.quantize is not None and self.strategy == "fsdp":
            raise ValueError(
                f"instruct.quantize: {self.quantize} (QLoRA) keeps the base in bitsandbytes' 4-bit "
                "tensors, which FSDP does not shard here: use instruct.strategy: ddp"
            )
        if self.quantize is not None and self.method != "lora":
            raise ValueError(
                f"instruct.quantize: {self.quantize} (QLoRA) trains LoRA adapters on frozen quantized "
                f"weights: it needs instruct.method: lora, not {self.method}"
            )
        if (self.judge.url is None) != (self.judge.model is None):
            raise ValueError("instruct.judge.url and instruct.judge.model go together: set both, or neither")
        if self.judge.url is not None and not self.judge.url.startswith(("http://", "https://")):
            raise ValueError(f"instruct.judge.url must be an http:// or https:// URL, got {self.judge.url!r}")
        return self

    mask_prompt: bool = False
    epochs: int = Field(2, gt=0)
    n_responses: Optional[int] = Field(20, gt=0, description="test examples answered at the end; null: all")
    max_new_tokens: int = Field(64, gt=0)


class PreferenceConfig(FinetuneCommon):
    # The model to align (default: the instruct stage's) and the frozen reference the rewards are
    # measured against: null = the same model as init_from (full: a frozen copy; lora: the
    # policy with its adapter disabled, peft's way, no second copy in memory).
    init_from: str = "checkpoints/instruct/final"
    reference: Optional[str] = None
    template: Optional[Literal["alpaca", "phi3", "chat"]] = None  # null: instruct.template (the SFT's)
    method: Literal["full", "lora"] = "full"
    beta: float = Field(0.1, gt=0)  # LLMs-from-scratch ch. 7, and trl's default
    loss_type: str = "sigmoid"  # trl's DPOConfig.loss_type: sigmoid is DPO; ipo, hinge, ... (DPO_LOSSES)
    lr: float = Field(5e-6, gt=0)
    epochs: int = Field(1, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    max_samples: Optional[int] = Field(None, gt=0, description="training pairs used (the split's first N); null: all")
    # batches of pairs of similar lengths (transformers' LengthGroupedSampler): less padding to score
    group_by_length: bool = True
    n_responses: Optional[int] = Field(5, gt=0, description="test prompts answered by both models; null: all")
    max_new_tokens: int = Field(64, gt=0)

    @model_validator(mode="after")
    def _strategy(self):
        return ddp_only(self, "preference", "DPO")

    @field_validator("loss_type")
    @classmethod
    def _loss(cls, value: str) -> str:
        if value not in DPO_LOSSES:
            close = difflib.get_close_matches(value, DPO_LOSSES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"unknown loss {value!r}{hint}; trl's DPO losses are {', '.join(DPO_LOSSES)}")
        return value


class RewardConfig(FinetuneCommon):
    # Stage train_reward (`gptforge finetune reward`): trl's RewardTrainer on the preference pairs,
    # a scalar head on the SFT model (our GPT through its Hugging Face form) or on reward.init_from
    # (any Hugging Face causal LM or sequence-classification folder with its tokenizer).
    init_from: str = "checkpoints/instruct/final"
    template: Optional[Literal["alpaca", "phi3", "chat"]] = None  # null: instruct.template (the SFT's)
    method: Literal["full", "lora"] = "full"
    lr: float = Field(1e-4, gt=0)
    epochs: int = Field(1, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_samples: Optional[int] = Field(None, gt=0, description="training pairs used (the split's first N); null: all")
    group_by_length: bool = True  # batches of pairs of similar lengths: less padding scored
    center_rewards_coefficient: Optional[float] = Field(
        None, ge=0, description="trl's auxiliary loss pulling rewards toward 0 (Eisenstein et al. 2023); null: off"
    )

    @model_validator(mode="after")
    def _strategy(self):
        return ddp_only(self, "reward", "the reward model")


# The reward functions the RL stage can weigh (rl.rewards: NAME -> weight): the reward model's
# score, a length rule, a format rule, the judge endpoint (instruct.judge).
RL_REWARDS = ("reward_model", "length", "format", "judge")


class RLConfig(FinetuneCommon):
    # Stage finetune_rl (`gptforge finetune rl`): online RL on the instruction prompts through trl
    # (GRPO, or RLOO), rewards a weighted sum of rl.rewards, KL to the frozen starting model.
    init_from: str = "checkpoints/instruct/final"  # or checkpoints/preference/final: RL after DPO
    template: Optional[Literal["alpaca", "phi3", "chat"]] = None  # null: instruct.template (the SFT's)
    algorithm: Literal["grpo", "rloo"] = "grpo"
    method: Literal["full", "lora"] = "full"
    num_generations: int = Field(4, gt=0, description="answers sampled per prompt (a group)")
    beta: float = Field(0.04, ge=0, description="KL penalty to the starting model (trl's GRPO default 0 skips it)")
    rewards: dict[str, float] = {"reward_model": 1.0}
    reward_model: str = "checkpoints/reward/final"  # for the reward_model reward
    length_target: int = Field(32, gt=0, description="the length reward: tokens an answer should have")
    max_completion_length: int = Field(32, gt=0, description="new tokens per sampled answer")
    temperature: float = Field(1.0, gt=0)
    lr: float = Field(1e-5, gt=0)
    epochs: int = Field(1, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_prompts: Optional[int] = Field(256, gt=0, description="training prompts used (the split's first N); null: all")
    max_heldout: Optional[int] = Field(
        None, gt=0, description="held-out prompts answered before and after (the test split's first N); null: all"
    )
    n_responses: Optional[int] = Field(5, gt=0, description="held-out prompts answered by SFT, DPO and RL; null: all")
    max_new_tokens: int = Field(64, gt=0)

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError(f"rl.rewards is empty: give at least one of {', '.join(RL_REWARDS)} a weight")
        for name in value:
            if name not in RL_REWARDS:
                close = difflib.get_close_matches(name, RL_REWARDS, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(f"unknown reward {name!r}{hint}; the rewards are {', '.join(RL_REWARDS)}")
        return value

    @model_validator(mode="after")
    def _check(self):
        ddp_only(self, "rl", self.algorithm.upper())
        if self.algorithm in ("grpo", "rloo") and self.num_generations < 2:
            raise ValueError(
                f"rl.num_generations must be at least 2 for {self.algorithm} (got {self.num_generations}): "
                "the advantage of an answer is measured against the others of its group"
            )
        if self.batch_size % self.num_generations:
            raise ValueError(
                f"rl.batch_size ({self.batch_size}) must be a multiple of rl.num_generations "
                f"({self.num_generations}): a batch holds whole groups of answers"
            )
        return self
