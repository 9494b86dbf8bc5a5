"""Hugging Face interop: our GPT to and from transformers' GPT2LMHeadModel (`to_hf`, `from_hf`),
OpenAI's GPT-2 weights from the hub (`from_pretrained`), and `load_pretrained`, which resolves
a run's `init_from` (a hub size, a gptforge checkpoint or a Hugging Face GPT-2 folder) to a GPT.
It imports `gptforge.modeling.gpt` and `gptforge.modeling.weights` (whose public helpers load the converted
tensors); `transformers` is imported only inside the functions that need it, so importing this
module loads none of it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gptforge.errors import BadInput, SourceUnreachable
from gptforge.modeling.gpt import EOT_ID, GPT, GPTConfig, padded_vocab
from gptforge.modeling.weights import CONFIG_FILE, empty_model, few, load_checked, load_model

HF_PRETRAINED = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")

# HF's GPT-2 uses Conv1D, whose weight is (in, out): the transpose of our nn.Linear's (out, in).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_config(config: GPTConfig):
    from transformers import GPT2Config

    eot = EOT_ID if config.n_vocab > EOT_ID else None
    return GPT2Config(
        vocab_size=config.n_vocab,
        n_positions=config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_inner=None,
        activation_function="gelu_new",
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        layer_norm_epsilon=1e-5,
        bos_token_id=eot,
        eos_token_id=eot,
        tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
    )


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights in the layout of transformers' GPT2LMHeadModel: Conv1D weights transposed,
    vocabulary trimmed to n_vocab rows, zero biases where the model has none (bias=False)."""
    cfg = model.config
    ours = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    wte = ours["transformer.wte.weight"][: cfg.n_vocab].detach().clone()
    out["transformer.wte.weight"] = wte
    out["transformer.wpe.weight"] = ours["transformer.wpe.weight"].detach().clone()
    dims = {
        "ln_1": cfg.n_embd,
        "attn.c_attn": 3 * cfg.n_embd,
        "attn.c_proj": cfg.n_embd,
        "ln_2": cfg.n_embd,
        "mlp.c_fc": 4 * cfg.n_embd,
        "mlp.c_proj": cfg.n_embd,
    }
    layers = [f"transformer.h.{i}." for i in range(cfg.n_layer)]
    for prefix in layers:
        for part, dim in dims.items():
            w = ours[f"{prefix}{part}.weight"].detach()
            out[f"{prefix}{part}.weight"] = w.t().contiguous() if f"{part}.weight" in _CONV1D else w.clone()
            b = ours.get(f"{prefix}{part}.bias")
            out[f"{prefix}{part}.bias"] = b.detach().clone() if b is not None else w.new_zeros(dim)
    out["transformer.ln_f.weight"] = ours["transformer.ln_f.weight"].detach().clone()
    b = ours.get("transformer.ln_f.bias")
    out["transformer.ln_f.bias"] = b.detach().clone() if b is not None else wte.new_zeros(cfg.n_embd)
    out["lm_head.weight"] = wte  # tied: the same tensor
    return out


def to_hf(model: GPT):
    """A transformers GPT2LMHeadModel (arch gpt2) or LlamaForCausalLM (arch llama, `hf_llama`) with
    our weights (eval mode, same device and dtype)."""
    if model.config.arch == "llama":
        from transformers import LlamaForCausalLM

        from gptforge.modeling.hf_llama import llama_hf_config, llama_hf_state_dict

        kind, hf, state = "Llama", LlamaForCausalLM(llama_hf_config(model.config)), llama_hf_state_dict(model)
    else:
        from transformers import GPT2LMHeadModel

        kind, hf, state = "GPT-2", GPT2LMHeadModel(hf_config(model.config)), hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"transformers' {kind} layout changed: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    p = model.transformer.wte.weight
    return hf.to(device=p.device, dtype=p.dtype).eval()


def from_hf(hf_model, attention: str = "sdpa") -> GPT:
    """Our GPT from a transformers GPT2LMHeadModel (vocabulary padded with zero rows to a
    multiple of 64; the padding is masked out of the logits anyway), or from a LlamaForCausalLM
    (`hf_llama.llama_from_hf`, arch llama)."""
    c = hf_model.config
    if c.model_type == "llama":
        from gptforge.modeling.hf_llama import llama_from_hf

        return llama_from_hf(hf_model, attention=attention)
    if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise BadInput(f"Hugging Face model uses activation {c.activation_function!r}; GPT-2's tanh GELU is needed")
    if abs(c.layer_norm_epsilon - 1e-5) > 1e-12:
        raise BadInput(f"Hugging Face model uses layer_norm_epsilon={c.layer_norm_epsilon}; 1e-5 is needed")
    if c.n_inner not in (None, 4 * c.n_embd) or getattr(c, "scale_attn_by_inverse_layer_idx", False):
        raise BadInput("Hugging Face model differs from GPT-2's architecture (n_inner or attention scaling)")
    config = GPTConfig(
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_embd=c.n_embd,
        block_size=c.n_positions,
        vocab_size=padded_vocab(c.vocab_size),
        n_vocab=c.vocab_size,
        dropout=0.0,
        bias=True,
        attention=attention,
    )
    hf_state = hf_model.state_dict()
    state = {}
    for k in empty_model(config, "meta").state_dict():
        if k == "lm_head.weight":
            continue
        if k not in hf_state:
            raise BadInput(f"Hugging Face model has no tensor {k}")
        t = hf_state[k].detach().to(torch.float32) if hf_state[k].is_floating_point() else hf_state[k]
        state[k] = t.t().contiguous() if k.endswith(_CONV1D) else t.clone()
    wte = state["transformer.wte.weight"]
    pad = config.vocab_size - config.n_vocab
    if pad:
        state["transformer.wte.weight"] = torch.cat([wte, wte.new_zeros(pad, config.n_embd)])
    device = hf_model.transformer.wte.weight.device
    model = empty_model(config, device)
    load_checked(model, state, "Hugging Face model")
    return model


def from_pretrained(name: str, attention: str = "sdpa", *, param: str = "pretrain.init_from") -> GPT:
    """OpenAI's GPT-2 weights from the Hugging Face hub ("gpt2" ... "gpt2-xl"); `param` is the
    config key the offline message tells the user to change."""
    if name not in HF_PRETRAINED:
        raise BadInput(f"unknown pretrained model {name!r}; choose one of {', '.join(HF_PRETRAINED)}")
    try:
        from transformers import GPT2LMHeadModel

        hf = GPT2LMHeadModel.from_pretrained(name)
    except Exception as e:  # offline, hub errors, missing cache: all the same to the user
        raise SourceUnreachable(
            f"cannot load {name} from the Hugging Face hub ({_reason(e, 160)}); set {param} to a checkpoint folder"
        ) from None
    return from_hf(hf, attention=attention)


def _reason(e: Exception, limit: int) -> str:
    """An exception from transformers as one line of at most `limit` characters."""
    reason = " ".join(f"{type(e).__name__}: {e}".split())
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Where a run's weights start: pretrain.init_from, classify.init_from, instruct.init_from

# What save_pretrained writes (one file, or shards and their index), newest format first.
HF_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def load_pretrained(init_from: str, *, param: str, attention: str = "sdpa", missing: str = "") -> tuple[GPT, str]:
    """The GPT that `init_from` names, and a few words saying what it is ("checkpoint DIR"), for
    messages and logs. `init_from` is, in this order:

    - a GPT-2 size on the Hugging Face hub: exactly one of HF_PRETRAINED (transformers' download
      cache). Membership, not a prefix: a folder named `gpt2-run` is a folder, and `./gpt2`
      names a folder called `gpt2`;
    - a folder whose config.json is a gptforge model config (`save_model` output): `load_model`;
    - a folder whose config.json is a Hugging Face one with `"model_type": "gpt2"` or `"llama"`
      (`save_pretrained` output, a hub snapshot such as SmolLM2's, `gptforge export` output): read
      with transformers' GPT2LMHeadModel / LlamaForCausalLM and converted with `from_hf` (a llama
      folder becomes an `arch: llama` GPT, in float32). Other Hugging Face architectures are
      refused with a one-line BadInput: they cannot become our GPT (the fine-tuning stages keep
      them as transformers models: `gptforge.modeling.hf_causal`).

    `param` is the config key (`pretrain.init_from`) that every error names; `missing` is advice
    put first in the message for a folder that does not exist ("run `gptforge pretrain` first,
    or "). `attention` is the backend of a converted hub / Hugging Face model; a gptforge
    checkpoint keeps the one it was saved with. Raises BadInput (SourceUnreachable when the
    hub cannot be reached).
    """
    if init_from in HF_PRETRAINED:
        return from_pretrained(init_from, attention=attention, param=param), f"hub weights {init_from}"
    folder = Path(init_from)
    if not folder.is_dir():
        raise BadInput(
            f"{param}: checkpoint folder {folder} not found; {missing}name a GPT-2 size "
            f"({', '.join(HF_PRETRAINED)}), a gptforge checkpoint folder or a Hugging Face GPT-2 folder"
        )
    hf_type = _hf_model_type(folder / CONFIG_FILE)
    if hf_type is None:
        try:
            return load_model(folder), f"checkpoint {folder}"
        except BadInput as e:
            raise BadInput(f"{param}: {e}") from None
    kind = "Llama" if hf_type[0] == "llama" else "GPT-2"
    return _load_hf_gpt2(folder, hf_type, param=param, attention=attention), f"Hugging Face {kind} folder {folder}"


def _hf_model_type(path: Path) -> tuple[str, str] | None:
    """(model_type, what to call it) when `path` is a Hugging Face config.json; None for anything
    else (a gptforge config, no file, not JSON: load_model names the file and its problem)."""
    from gptforge.modeling.hf_causal import hf_config_dict

    d = hf_config_dict(path)
    if d is None:
        return None
    archs = d.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    return d["model_type"], ", ".join(archs) or d["model_type"]


def _load_hf_gpt2(folder: Path, hf_type: tuple[str, str], *, param: str, attention: str) -> GPT:
    model_type, arch = hf_type
    config = folder / CONFIG_FILE
    if model_type not in ("gpt2", "llama"):
        raise BadInput(
            f"{param}: {config} is a Hugging Face {arch} config (model_type {model_type!r}); gptforge's GPT "
            "starts only from GPT-2 and Llama folders (model_type 'gpt2', 'llama'); the fine-tuning stages "
            "take any causal LM"
        )
    if not any((folder / name).is_file() for name in HF_WEIGHT_FILES):
        raise BadInput(
            f"{param}: {config} is a Hugging Face {arch} config, but {folder} holds no weights "
            f"({' or '.join(HF_WEIGHT_FILES[::2])})"
        )
    kind = "Llama" if model_type == "llama" else "GPT-2"
    try:
        from transformers import GPT2LMHeadModel, LlamaForCausalLM

        cls = LlamaForCausalLM if model_type == "llama" else GPT2LMHeadModel
        # local_files_only: a folder never reaches for the hub, even for a missing file. float32:
        # training keeps master weights in float32 (a bf16 folder is widened exactly).
        hf, info = cls.from_pretrained(
            str(folder), local_files_only=True, output_loading_info=True, dtype=torch.float32
        )
    except Exception as e:  # damaged weights, shapes that disagree with config.json, ...
        raise BadInput(f"{param}: cannot read the Hugging Face {kind} folder {folder} ({_reason(e, 200)})") from None
    # transformers fills tensors the files lack with random values and only logs it: refuse instead.
    tied = {"lm_head.weight"} if hf.config.tie_word_embeddings else set()
    absent = sorted(k for k in info.get("missing_keys", ()) if k not in tied)
    if absent:
        raise BadInput(f"{param}: the Hugging Face {kind} folder {folder} lacks tensors {few(absent)}")
    try:
        return from_hf(hf, attention=attention)
    except BadInput as e:
        raise BadInput(f"{param}: {folder}: {e}") from None
