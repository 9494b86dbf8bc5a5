"""`gptforge plan`: how many bytes of training state each GPU holds under ddp, zero1 and fsdp,
and whether the run fits, before a GPU is rented.

The model is the config's main training stage's: `pretrain` (gptforge's GPT, its shape from the
`model` section), or `instruct` when the config fine-tunes a model other than its own pretrained
one (a Hugging Face causal LM: the local folder's `config.json`, or for a hub id not fetched yet,
a small table of known architectures below). Both are instantiated on PyTorch's meta device,
so parameters are counted exactly and nothing is downloaded or allocated.

Per GPU, with N GPUs and P trainable parameters (AdamW; its two moments in fp32):

    strategy  weights          gradients    optimizer states
    ddp       W                4·P          8·P
    zero1     W                4·P          8·P / N
    fsdp      W / N            4·P / N      8·P / N

W is the stored weights: fp32 (4 bytes a parameter) when training them; under LoRA with bf16
on CUDA the frozen base is bf16 (2 bytes) and only the adapters are fp32, as the instruct stage
loads them (gptforge.finetune.common.load_hf_base). These three columns are what
gptforge.training.sharding.state_bytes counts in a run, and the suite checks them against it.

"working" is an estimate, not a count: the activations kept for the backward of one
micro-batch (Korthikanti et al. 2022, about 34·B·T·d bytes a layer in 16-bit without the T x T
scores, which FlashAttention does not keep; 2·B·T·d a layer with activation checkpointing, plus
one layer recomputed), the fp32 logits and their gradient (8·B·T·V), and under fsdp two blocks'
gathered weights (the current one and the prefetched next). A GPU "fits" when the total stays
under 90% of its memory (CUDA's context, the allocator's fragmentation and the kernels'
workspaces take the rest).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from gptforge.config.schema import Config
from gptforge.errors import BadInput

STRATEGIES = ("ddp", "zero1", "fsdp")
PRETRAINED = "checkpoints/pretrain/final"  # the pretrain stage's model (dvc.yaml)
FIT_FRACTION = 0.9

# Hugging Face config.json fields of some hub models gptforge's configs name, for planning before
# they are fetched (the model cards' config.json; a fetched folder's own config.json wins).
KNOWN_ARCHITECTURES: dict[str, dict] = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
}


@dataclass
class Shape:
    """What the plan needs to know of a model and its micro-batch."""

    name: str
    params: int  # every parameter, a tied one once
    trainable: int
    weight_bytes: int  # the weights as stored during training
    block_params: int  # the largest transformer block's
    n_layer: int
    hidden: int
    vocab: int
    batch: int  # micro-batch rows
    seq_len: int
    activation_checkpointing: bool = False


@dataclass
class Row:
    strategy: str
    weights: int
    grads: int
    optimizer: int
    working: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.working


def state_rows(shape: Shape, gpus: int) -> list[Row]:
    """Bytes per GPU under each strategy (the formulas in this module's opening paragraph)."""
    w, g, o = shape.weight_bytes, 4 * shape.trainable, 8 * shape.trainable
    act = _activation_bytes(shape)
    gathered = 2 * 2 * shape.block_params  # two blocks' weights in bf16 (fsdp's all-gather buffers)
    split = lambda b: -(-b // gpus)  # noqa: E731 - ceil: an uneven split puts the extra row on some GPUs
    return [
        Row("ddp", w, g, o, act),
        Row("zero1", w, g, split(o), act),
        Row("fsdp", split(w), split(g), split(o), act + (gathered if gpus > 1 else 0)),
    ]


def _activation_bytes(s: Shape) -> int:
    btd = s.batch * s.seq_len * s.hidden
    if s.activation_checkpointing:
        layers = 2 * btd * s.n_layer + 34 * btd
    else:
        layers = 34 * btd * s.n_layer
    return layers + 8 * s.batch * s.seq_len * s.vocab


# ---------------------------------------------------------------------------------------------
# The model of the config's main training stage


def main_stage(cfg: Config) -> str:
    """`pretrain`, unless instruct starts from something other than the pretrained model."""
    return "pretrain" if Path(cfg.instruct.init_from) == Path(PRETRAINED) else "instruct"


def gpt_shape(cfg: Config) -> Shape:
    import torch

    from gptforge.modeling.gpt import GPT, GPTConfig

    m, p = cfg.model, cfg.pretrain
    with torch.device("meta"):
        model = GPT(GPTConfig.from_model_config(m, m.vocab_size))
    params = sum(t.numel() for t in model.parameters())
    block = max(sum(t.numel() for t in b.parameters()) for b in model.transformer.h)
    return Shape(
        f"gptforge GPT ({m.arch}, {m.n_layer} layers, d={m.n_embd}, vocab {m.vocab_size})",
        params,
        params,
        4 * params,
        block,
        m.n_layer,
        m.n_embd,
        m.vocab_size,
        p.batch_size,
        m.block_size,
        p.activation_checkpointing,
    )


def hf_config(cfg: Config) -> tuple[dict, str]:
    """(config.json fields, where they came from) of instruct.init_from, offline."""
    source = cfg.instruct.init_from
    folder = Path(source)
    hub_id = source
    m = re.fullmatch(r"checkpoints/base/([^/]+)", folder.as_posix())
    if m and m.group(1) in cfg.base.models:
        hub_id = cfg.base.models[m.group(1)]
    for candidate in (folder, Path(hub_id)):
        path = candidate / "config.json"
        if path.is_file():
            try:
                return json.loads(path.read_text(encoding="utf-8")), str(path)
            except (OSError, ValueError) as e:
                raise BadInput(f"plan: {path} is not readable JSON ({e})") from None
    if hub_id in KNOWN_ARCHITECTURES:
        return KNOWN_ARCHITECTURES[hub_id], f"{hub_id} (gptforge's table of known architectures)"
    raise BadInput(
        f"plan: instruct.init_from {source} has no config.json here and {hub_id} is not among the "
        f"known architectures ({', '.join(KNOWN_ARCHITECTURES)}): fetch it first (gptforge prepare base)"
    )


def hf_shape(cfg: Config, gpus: int = 1) -> Shape:
    """The instruct stage's model and its micro-batch on each of `gpus` processes (instruct.batch_size
    is the whole batch, split between them)."""
    import torch
    import torch.nn as nn
    from transformers import AutoConfig, AutoModelForCausalLM

    fields, origin = hf_config(cfg)
    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise BadInput(f"plan: {origin} has no model_type: not a Hugging Face model config")
    try:
        hf_cfg = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as e:
        raise BadInput(f"plan: {origin}: {e}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    params = sum(t.numel() for t in model.parameters())
    from gptforge.modeling.hf_causal import block_linear_names, find_blocks

    blocks, _ = find_blocks(model)
    block = max(sum(t.numel() for t in b.parameters()) for b in blocks)
    c = cfg.instruct
    if c.method == "lora":
        targets = set(block_linear_names(model) if c.lora.target_modules == "auto" else c.lora.target_modules)
        trainable = sum(
            c.lora.r * (mod.in_features + mod.out_features)
            for name, mod in blocks.named_modules()
            if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in targets
        )
        base_bytes = 2 if c.precision in ("auto", "bf16") else 4  # on a GPU, auto is bf16
        weight_bytes = base_bytes * params + 4 * trainable
    else:
        trainable, weight_bytes = params, 4 * params
    text = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    # instruct.max_length null means the model's whole context (as the stage itself reads it).
    seq_len = c.max_length or getattr(text, "max_position_embeddings", None) or 2048
    return Shape(
        f"{model_type} from {origin}" + (f", LoRA r={c.lora.r}" if c.method == "lora" else ""),
        params,
        trainable,
        weight_bytes,
        block,
        text.num_hidden_layers,
        text.hidden_size,
        text.vocab_size,
        -(-c.batch_size // gpus),
        seq_len,
        c.gradient_checkpointing,
    )


def parse_memory(text: str) -> int:
    """'80GB', '80 GiB', '24g', '81920MB' -> bytes (GB and GiB both as 2**30: what GPU makers mean)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise BadInput(f"--gpu-memory: expected a size such as 80GB or 24GiB, got {text!r}")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def render(shape: Shape, rows: list[Row], gpus: int, gpu_memory: int) -> str:
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    limit = FIT_FRACTION * gpu_memory
    lines = [
        f"model: {shape.name}: {shape.params / 1e6:,.1f}M parameters, {shape.trainable / 1e6:,.1f}M trained; "
        f"micro-batch {shape.batch} x {shape.seq_len}"
        + (", activation checkpointing" if shape.activation_checkpointing else ""),
        f"per GPU, {gpus} GPU{'s' if gpus > 1 else ''} of {gib(gpu_memory)} GiB each (fits: total under "
        f"{FIT_FRACTION:.0%} of it), GiB:",
        "",
        f"{'strategy':<9} {'weights':>9} {'grads':>9} {'optimizer':>10} {'working*':>9} {'total':>9}  fits",
    ]
    for r in rows:
        lines.append(
            f"{r.strategy:<9} {gib(r.weights):>9} {gib(r.grads):>9} {gib(r.optimizer):>10} "
            f"{gib(r.working):>9} {gib(r.total):>9}  {'yes' if r.total <= limit else 'no'}"
        )
    lines += [
        "",
        "* working: activations of one micro-batch, logits, fsdp's gathered blocks: an estimate "
        "(docs/multi-node.md#the-memory-plan)",
    ]
    return "\n".join(lines)
