"""GGUF out: a model gptforge trained or fine-tuned, as one file llama.cpp and Ollama run.

`export_gguf` writes the folders gptforge makes: Hugging Face Llama, Mistral and Qwen2 causal LMs
(SmolLM2 fine-tuned, LoRA merged) and gptforge's own GPT (through its Hugging Face export, GGUF's
`gpt2` architecture). Everything goes through the `gguf` package, llama.cpp's own Python
library: its writer, its tensor name maps (`get_tensor_name_map`), its quantizers
(`gguf.quants`) and its reader of a folder's special tokens and chat template (`SpecialVocab`);
what is ours is the short list of what llama.cpp's conversion script does per architecture
(the llama rotary permutation of q and k, GPT-2's transposed Conv1D weights, a tied output
left out) and the tokenizer's GGUF fields.

The tokenizer goes in whole: every token by id with its type (special added tokens CONTROL,
other added ones USER_DEFINED, ids past the tokenizer UNUSED), the BPE merges, the
pre-tokenizer's name as llama.cpp knows it (read from tokenizer.json's pre-tokenizer: GPT-2's
regex, SmolLM's digits split, Qwen2's or Llama 3's split), bos/eos/pad and the chat template.
Beside the file, an Ollama `Modelfile` (FROM the file, the template in Ollama's form, the stop
tokens), so `ollama create NAME -f Modelfile` is the one step left.

Quantizations: f32, f16, bf16 and the block formats gguf.quants writes (q8_0, q5_1, q5_0, q4_1,
q4_0); as llama.cpp's script does, 1-D tensors (norms, biases) stay f32 and a matrix whose rows
do not split into blocks falls back to f16. The file appears at once (written beside, then
renamed); bad input is one line (`BadInput`) before anything is written. Imports torch,
transformers and gguf inside the functions.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Sequence

from gptforge.errors import BadInput
from gptforge.io import atomic_file, publish_mode

log = logging.getLogger("gptforge")

# --quant -> (the file's LlamaFileType, the matrices' GGMLQuantizationType), by their gguf names.
QUANT_TYPES = {
    "f32": ("ALL_F32", "F32"),
    "f16": ("MOSTLY_F16", "F16"),
    "bf16": ("MOSTLY_BF16", "BF16"),
    "q8_0": ("MOSTLY_Q8_0", "Q8_0"),
    "q5_1": ("MOSTLY_Q5_1", "Q5_1"),
    "q5_0": ("MOSTLY_Q5_0", "Q5_0"),
    "q4_1": ("MOSTLY_Q4_1", "Q4_1"),
    "q4_0": ("MOSTLY_Q4_0", "Q4_0"),
}
QUANTS = tuple(QUANT_TYPES)
# Hugging Face model_type -> GGUF architecture (Mistral is llama to llama.cpp's converter).
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gpt2": "gpt2"}
# Ollama's template for ChatML models (SmolLM2, Qwen2): the Go template Ollama ships for them.
CHATML_TEMPLATE = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)


def export_gguf(
    checkpoint: str | Path,
    out: str | Path,
    quant: str = "f16",
    tokenizer_path: str | None = None,
    prompt: tuple[str, Sequence[str]] | None = None,
) -> Path:
    """Write `out` (a .gguf file) and `Modelfile` beside it from a checkpoint folder; the path.
    `prompt` is the Modelfile's (TEMPLATE, stops) for a model without a chat template: the
    instruction template it was tuned with (`finetune.templates.ollama_template`); None: none."""
    checkpoint, out = Path(checkpoint), Path(out)
    if quant not in QUANTS:
        raise BadInput(f"--quant {quant!r} is not a GGUF type gptforge writes; choose one of {', '.join(QUANTS)}")
    if out.suffix != ".gguf":
        raise BadInput(f"--out {out} must end in .gguf")
    if (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "config.json").is_file():
        raise BadInput(f"--checkpoint {checkpoint} is a LoRA adapter: export the merged folder written beside it")
    if not (checkpoint / "config.json").is_file():
        raise BadInput(f"--checkpoint {checkpoint} has no config.json: not a model folder gptforge wrote")
    if checkpoint.resolve() in out.resolve().parents:
        raise BadInput(f"--out {out} is inside the checkpoint {checkpoint}: write the GGUF file elsewhere")
    config = json.loads((checkpoint / "config.json").read_text())
    if "model_type" not in config:  # gptforge's own GPT: its Hugging Face export is a GPT-2 folder
        from gptforge.modeling.export import export_hf

        with tempfile.TemporaryDirectory(prefix="gptforge-gguf-") as tmp:
            folder = export_hf(checkpoint, Path(tmp) / "hf", tokenizer_path)
            return _write(folder, out, quant, checkpoint, prompt)
    return _write(checkpoint, out, quant, checkpoint, prompt)


def _check_folder(folder: Path, config: dict) -> str:
    """The GGUF architecture of a Hugging Face folder, or BadInput saying why it has none."""
    archs = config.get("architectures") or []
    if any(not a.endswith("ForCausalLM") and not a.endswith("LMHeadModel") for a in archs):
        raise BadInput(
            f"{folder} holds a {', '.join(archs)}: GGUF holds causal language models, not classifiers or reward models"
        )
    model_type = config.get("model_type")
    if model_type not in ARCHS:
        raise BadInput(
            f"{folder} is a {model_type!r} model; gptforge writes GGUF for {', '.join(sorted(ARCHS))} "
            "(llama.cpp's convert_hf_to_gguf.py converts the others)"
        )
    return ARCHS[model_type]


def _write(folder: Path, out: Path, quant: str, source: Path, prompt) -> Path:
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    arch = _check_folder(folder, config)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pre = pre_tokenizer_name(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    state = {k: v for k, v in model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    publish_mode(tmp)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        writer.add_name(source.name if source.name not in ("final", "merged", "") else source.parent.name)
        _add_hparams(writer, arch, cfg)
        writer.add_file_type(gguf.LlamaFileType[QUANT_TYPES[quant][0]])
        _add_tokenizer(writer, gguf, folder, tokenizer, pre, cfg.vocab_size)
        _add_tensors(writer, gguf, arch, cfg, state, quant)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=True)
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    modelfile = out.parent / "Modelfile"
    with atomic_file(modelfile) as f:
        f.write(ollama_modelfile(out.name, tokenizer, prompt))
    log.info("export: %s (%s, %s) and %s", out, arch, quant, modelfile)
    return out


def pre_tokenizer_name(folder: Path) -> str:
    """llama.cpp's name for the folder's pre-tokenizer (tokenizer.ggml.pre), read from
    tokenizer.json: how text is split before the BPE merges, which llama.cpp must do alike."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise BadInput(f"{folder} has no tokenizer.json: GGUF needs the fast tokenizer's vocabulary and merges")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise BadInput(f"{path}: a {model.get('type')} tokenizer; gptforge writes GGUF for byte-level BPE ones")
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds[:1] == ["Split"] and kinds[-1:] == ["ByteLevel"]:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as qwen2

        regex = (parts[0].get("pattern") or {}).get("Regex", "")
        if regex == qwen2:
            return "qwen2"
        if regex.startswith("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"):
            return "llama-bpe"
    raise BadInput(f"{path}: a pre-tokenizer ({kinds}) that gptforge cannot name for llama.cpp")


def _add_hparams(writer, arch: str, cfg) -> None:
    if arch == "gpt2":
        writer.add_context_length(cfg.n_positions)
        writer.add_embedding_length(cfg.n_embd)
        writer.add_block_count(cfg.n_layer)
        writer.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        writer.add_head_count(cfg.n_head)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
        return
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    from gptforge.modeling.hf_llama import rope_theta

    writer.add_rope_freq_base(rope_theta(cfg))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)


def _add_tokenizer(writer, gguf, folder: Path, tokenizer, pre: str, n_vocab: int) -> None:
    """Every id up to the model's vocabulary, its type, the merges and the special tokens."""
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise BadInput(f"{folder}/tokenizer.json has no BPE merges")
    special.add_to_gguf(writer, quiet=True)


def _add_tensors(writer, gguf, arch: str, cfg, state: dict, quant: str) -> None:
    import numpy as np
    import torch

    n_layer = cfg.n_layer if arch == "gpt2" else cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layer)
    tied = getattr(cfg, "tie_word_embeddings", arch == "gpt2")
    for name, tensor in state.items():
        if name == "lm_head.weight" and tied:
            continue  # llama.cpp reads the output from token_embd when `output` is absent
        if name.endswith("rotary_emb.inv_freq"):
            continue
        data = tensor.detach().to(torch.float32).numpy()
        if arch == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            data = data.T  # Conv1D keeps (in, out); GGUF keeps (out, in) as nn.Linear does
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            data = _permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        if arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            data = _permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise BadInput(f"tensor {name} has no GGUF name for the {arch} architecture")
        data, qtype = _encode(gguf, np.ascontiguousarray(data), quant)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)


def _permute(weights, n_head: int, n_head_kv: int):
    """llama.cpp's order of the rotary halves in q and k (convert_hf_to_gguf's LlamaModel.permute)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _encode(gguf, data, quant: str):
    """The tensor's bytes in `quant` (1-D ones in f32, as llama.cpp keeps norms and biases)."""
    import numpy as np

    Q = gguf.GGMLQuantizationType
    qtype = Q[QUANT_TYPES[quant][1]]
    if data.ndim <= 1 or qtype == Q.F32:
        return data.astype(np.float32), Q.F32
    if qtype == Q.F16:
        return data.astype(np.float16), Q.F16
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % block:
        return data.astype(np.float16), Q.F16
    return gguf.quants.quantize(data.astype(np.float32), qtype), qtype


def ollama_modelfile(file_name: str, tokenizer, prompt: tuple[str, Sequence[str]] | None = None) -> str:
    """An Ollama Modelfile for the exported file: FROM it, the prompt template, the stop tokens.
    A ChatML chat template becomes Ollama's ChatML template; a model without a chat template
    (gptforge's GPT, a base model tuned with alpaca or phi3) gets `prompt`, (TEMPLATE, stops)."""
    chat = tokenizer.chat_template or ""
    lines = [f"FROM ./{file_name}"]
    stops = []
    if "<|im_start|>" in chat:
        lines.append(f'TEMPLATE """{CHATML_TEMPLATE}"""')
        stops = ["<|im_start|>", "<|im_end|>"]
    elif not chat and prompt is not None:
        lines.append(f'TEMPLATE """{prompt[0]}"""')
        stops = list(prompt[1])
    if tokenizer.eos_token and tokenizer.eos_token not in stops:
        stops.append(tokenizer.eos_token)
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n"
