"""gptforge's `arch: llama` GPT to and from transformers' LlamaForCausalLM: `llama_hf_config`,
`llama_hf_state_dict` (our fused q/k/v and gate/up matrices split into transformers' projections,
the vocabulary trimmed to the tokenizer's) and `llama_from_hf` (the reverse, the vocabulary padded to
a multiple of 64). So a model pretrained here exports as a folder every outside tool reads (serve's
Hugging Face path, the GGUF export, llama.cpp's converter, vLLM), and a LlamaForCausalLM folder of
that shape (SmolLM2's) continues pretraining in our loop (`pretrain.init_from`). `hf_convert`
dispatches here by architecture; transformers is imported inside the functions.
"""

from __future__ import annotations

import torch

from gptforge.errors import BadInput
from gptforge.modeling.gpt import EOT_ID, GPT, GPTConfig, padded_vocab
from gptforge.modeling.weights import empty_model, load_checked


def rope_theta(cfg) -> float:
    """A transformers config's rotary base (`rope_parameters` in transformers 5, `rope_theta`
    before); a scaled rotary embedding (YaRN, Llama 3's) is refused: ours is the plain one."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if (params.get("rope_type") or "default") != "default":
        raise BadInput(f"rope scaling {params.get('rope_type')!r}: gptforge runs plain rotary embeddings only")
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def llama_hf_config(config: GPTConfig):
    from transformers import LlamaConfig

    eot = EOT_ID if config.n_vocab > EOT_ID else None  # the GPT-2 tokenizer's <|endoftext|>
    return LlamaConfig(
        vocab_size=config.n_vocab,
        hidden_size=config.n_embd,
        intermediate_size=config.ffn_hidden,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head,
        head_dim=config.head_dim,
        max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=config.bias,
        mlp_bias=config.bias,
        attention_dropout=config.dropout,
        hidden_act="silu",
        bos_token_id=eot,
        eos_token_id=eot,
        architectures=["LlamaForCausalLM"],
    )


def _layer_names(i: int) -> dict[str, list[str]]:
    """Our tensor (without .weight/.bias) -> the transformers tensors it holds, in row order."""
    ours, hf = f"transformer.h.{i}.", f"model.layers.{i}."
    return {
        f"{ours}ln_1": [f"{hf}input_layernorm"],
        f"{ours}attn.c_attn": [f"{hf}self_attn.{p}_proj" for p in "qkv"],
        f"{ours}attn.c_proj": [f"{hf}self_attn.o_proj"],
        f"{ours}ln_2": [f"{hf}post_attention_layernorm"],
        f"{ours}mlp.c_fc": [f"{hf}mlp.gate_proj", f"{hf}mlp.up_proj"],
        f"{ours}mlp.c_proj": [f"{hf}mlp.down_proj"],
    }


def _splits(config: GPTConfig, name: str) -> list[int]:
    kv = config.n_kv_head * config.head_dim
    if name.endswith("c_attn"):
        return [config.n_embd, kv, kv]
    if name.endswith("c_fc"):
        return [config.ffn_hidden, config.ffn_hidden]
    return []


def llama_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under LlamaForCausalLM's names and shapes (copies; lm_head only when untied)."""
    cfg = model.config
    ours = model.state_dict()
    out = {
        "model.embed_tokens.weight": ours["transformer.wte.weight"][: cfg.n_vocab].detach().clone(),
        "model.norm.weight": ours["transformer.ln_f.weight"].detach().clone(),
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ours["lm_head.weight"][: cfg.n_vocab].detach().clone()
    for i in range(cfg.n_layer):
        for name, targets in _layer_names(i).items():
            for suffix in (".weight", ".bias"):
                t = ours.get(name + suffix)
                if t is None:
                    continue
                parts = t.detach().split(_splits(cfg, name)) if len(targets) > 1 else [t.detach()]
                out.update({target + suffix: p.clone() for target, p in zip(targets, parts)})
    return out


def llama_from_hf(hf_model, attention: str = "sdpa") -> GPT:
    """Our `arch: llama` GPT from a transformers LlamaForCausalLM (float32 weights); a config our
    model would compute differently (another activation, scaled rotary, biases on some projections
    only, a head size that is not hidden/heads) is a one-line BadInput."""
    c = hf_model.config
    if c.model_type != "llama":
        raise BadInput(f"model_type {c.model_type!r}: gptforge's llama arch reads LlamaForCausalLM folders")
    if c.hidden_act != "silu":
        raise BadInput(f"activation {c.hidden_act!r}: the llama arch's SwiGLU uses silu")
    if bool(getattr(c, "attention_bias", False)) != bool(getattr(c, "mlp_bias", False)):
        raise BadInput("attention_bias and mlp_bias differ: the llama arch has biases on every linear or on none")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise BadInput(f"head_dim {head_dim} x {c.num_attention_heads} heads is not hidden_size {c.hidden_size}")
    if getattr(c, "pretraining_tp", 1) != 1:
        raise BadInput(f"pretraining_tp {c.pretraining_tp}: only 1 is supported")
    config = GPTConfig(
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        n_embd=c.hidden_size,
        block_size=c.max_position_embeddings,
        vocab_size=padded_vocab(c.vocab_size),
        n_vocab=c.vocab_size,
        dropout=0.0,
        bias=bool(getattr(c, "attention_bias", False)),
        attention=attention,
        arch="llama",
        n_kv_head=c.num_key_value_heads or c.num_attention_heads,
        rope_theta=rope_theta(c),
        ffn_hidden=c.intermediate_size,
        norm_eps=c.rms_norm_eps,
        tie_embeddings=bool(c.tie_word_embeddings),
    )
    hf_state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    pad = config.vocab_size - config.n_vocab
    state: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise BadInput(f"Hugging Face model has no tensor {name}")
        return hf_state[name].to(torch.float32)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, t.size(1))]) if pad else t.clone()

    state["transformer.wte.weight"] = padded(take("model.embed_tokens.weight"))
    state["transformer.ln_f.weight"] = take("model.norm.weight").clone()
    if not config.tie_embeddings:
        state["lm_head.weight"] = padded(take("lm_head.weight"))
    for i in range(config.n_layer):
        for name, sources in _layer_names(i).items():
            state[name + ".weight"] = torch.cat([take(s + ".weight") for s in sources])
            if config.bias and not name.endswith(("ln_1", "ln_2")):
                state[name + ".bias"] = torch.cat([take(s + ".bias") for s in sources])
    model = empty_model(config, hf_model.model.embed_tokens.weight.device)
    load_checked(model, state, "Hugging Face model")
    return model
