"""Hugging Face causal LMs used as they are: Qwen, Llama, SmolLM, Mistral, ... from a hub id or a
local folder, with their own tokenizer.

GPT-2 is the exception: a GPT-2 size or a Hugging Face GPT-2 folder is converted into our own
`GPT` (`hf_convert.load_pretrained`), which the training loop, the kernels and the evaluation
know inside out. Every other causal LM is loaded with transformers' Auto classes and stays a
transformers model; `hf_source` says which of the two a run's `init_from` is. This module holds
what both fine-tuning recipes, `gptforge generate` and the evaluate stage need of such a model:
loading it with one-line errors (`load_causal_lm`), its tokenizer behind the few tiktoken methods
our recipes call (`HFTokenizer`), the ids generation stops on (`stop_ids`), and where its
transformer blocks are (`find_blocks`). transformers is imported inside the functions only.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from gptforge.errors import BadInput

log = logging.getLogger("gptforge")

CONFIG_FILE = "config.json"
# owner/name, as the hub spells repository ids (one slash, no leading dot or slash).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
# GPT-2 sizes and Hugging Face GPT-2 folders become our own GPT (hf_convert.load_pretrained).
_OWN_MODEL_TYPES = ("gpt2",)
_CAUSAL_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")


def hf_source(init_from: str) -> str | None:
    """`init_from` when it names a Hugging Face causal LM to use as it is, else None.

    Yes for a folder whose config.json is a Hugging Face config of another model type than
    GPT-2, and for a hub id (`Qwen/Qwen2.5-0.5B-Instruct`) that is not a local path. No (None)
    for the GPT-2 sizes (`gpt2`, ... : hub names without an owner), gptforge checkpoints, Hugging
    Face GPT-2 folders, a folder without config.json and any other missing path:
    `hf_convert.load_pretrained` loads those or says what is wrong with them.
    """
    path = Path(init_from).expanduser()
    if path.is_dir():
        model_type = hf_model_type(path / CONFIG_FILE)
        return init_from if model_type is not None and model_type not in _OWN_MODEL_TYPES else None
    if path.exists() or not _HUB_ID.match(init_from):
        return None
    return init_from


def hf_config_dict(config_path: Path) -> dict | None:
    """A Hugging Face config.json as a dict; None when the file is missing, is not JSON, has no
    `model_type`, or is a gptforge model config (which has a `format` key)."""
    try:
        d = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(d, dict) or "format" in d or not isinstance(d.get("model_type"), str):
        return None
    return d


def hf_model_type(config_path: Path) -> str | None:
    """The `model_type` of a Hugging Face config.json (None: see `hf_config_dict`)."""
    d = hf_config_dict(config_path)
    return d["model_type"] if d is not None else None


def _reason(e: BaseException, limit: int = 200) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_causal_lm(
    source: str, *, param: str, dtype: Any = None, quantization_config: Any = None, device_map: Any = None
):
    """(model, tokenizer) for a hub id or local folder, both with transformers' Auto classes.

    `param` is the config key the errors name. One-line BadInput for: a folder without
    config.json, a model that is not a causal LM (a BERT folder: transformers has no causal-LM
    class for it), a folder without a tokenizer, and a hub id that cannot be fetched (no network,
    no such repository): the message names the id and says that a local folder works.
    `dtype` (a torch dtype; None: float32, whatever the folder was saved in: transformers would
    keep a bf16 folder in bf16, which CPUs without native bf16 run 15-36x slower), `quantization_config`
    (bitsandbytes) and `device_map` go to `from_pretrained` as they are.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(source).expanduser()
    local = path.is_dir()
    where = str(path) if local else source
    if local and not (path / CONFIG_FILE).is_file():
        raise BadInput(f"{param}: {path} is not a Hugging Face model folder (no {CONFIG_FILE})")
    try:
        config = AutoConfig.from_pretrained(where, local_files_only=local)
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, unreadable config: one line either way
        if local:
            raise BadInput(f"{param}: cannot read {path / CONFIG_FILE} ({_reason(e)})") from None
        raise BadInput(
            f"{param}: cannot fetch {source} from the Hugging Face hub ({_reason(e, 160)}); a local "
            f"folder works: download it where the hub is reachable and name the folder (there is no "
            f"folder {source} here)"
        ) from None
    archs = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    # BERT has a causal-LM class too (as a decoder), so a folder must also have been saved from
    # a language-model head (LlamaForCausalLM, GPT2LMHeadModel) when it says what it was saved from.
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
        archs and not any(a.endswith(_CAUSAL_ARCHITECTURES) for a in archs)
    ):
        what = ", ".join(archs) or config.model_type
        raise BadInput(
            f"{param}: {where} is a {what} model, not a causal language model "
            "(fine-tuning and generation need one: *ForCausalLM)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=local)
    except Exception as e:  # noqa: BLE001
        raise BadInput(f"{param}: {where} has no usable tokenizer ({_reason(e)})") from None
    import torch

    kwargs: dict[str, Any] = {"local_files_only": local, "dtype": torch.float32 if dtype is None else dtype}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model, info = AutoModelForCausalLM.from_pretrained(where, output_loading_info=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - damaged weights, shapes that disagree with config.json
        raise BadInput(f"{param}: cannot load the model in {where} ({_reason(e)})") from None
    # transformers fills tensors the files lack with random values and only logs it: refuse.
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    absent = sorted(set(info.get("missing_keys", ())) - tied)
    if absent:
        raise BadInput(f"{param}: {where} lacks tensors {', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''}")
    if tokenizer.pad_token_id is None:  # right padding is masked by position; any id will do
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


INFERENCE_DTYPES = ("auto", "float32", "bfloat16")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX-512 BF16 or AMX): there bf16 autocast runs
    about 2x fp32; on AVX2-only CPUs it runs 15-36x slower (measured on this project's machines)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return any(f" {flag}" in flags for flag in ("avx512_bf16", "amx_bf16"))


def resolved_precision(precision: str, device_type: str) -> str:
    """`precision` with its automatic forms resolved for a device type: auto is bf16 on CUDA and
    fp32 on the CPU; auto-bf16 is bf16 on CUDA and on CPUs with native bf16, else fp32."""
    if precision == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    if precision == "auto-bf16":
        return "bf16" if device_type == "cuda" or cpu_has_native_bf16() else "fp32"
    return precision


def inference_dtype(name: str, device_type: str, quantize: str | None = None):
    """The torch dtype a Hugging Face model is loaded in to answer (`gptforge generate` and
    `serve`'s --dtype): auto is bfloat16 on CUDA and float32 on the CPU (bf16 weights halve
    what each token reads, and CPUs with native bf16 decode faster with them, but AVX2-only
    CPUs run bf16 15-36x slower: there it is the user's choice, not a default). Under
    `quantize="int8"` or `"int4"` auto is bfloat16 on CPUs with native bf16 too: torch's int8
    and int4 kernels run float32 activations slower than float32 weights there (int4: 104 ms for
    SmolLM2's 210 linears against 4.4 ms with bf16 activations, on an AVX-512 BF16 EPYC)."""
    import torch

    if name not in INFERENCE_DTYPES:
        raise BadInput(f"--dtype must be one of {', '.join(INFERENCE_DTYPES)}, got {name!r}")
    if name == "auto" and quantize and device_type != "cuda":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass
class HFTokenizer:
    """A transformers tokenizer behind the tiktoken methods our recipes call (`encode`,
    `encode_ordinary`, `decode`, `eot_token`, `n_vocab`), so the templates, the classifier's
    encoding and the responses work for both kinds of model.

    Text is encoded without the model's added specials (no BOS) and with special-token strings
    inside it split into ordinary pieces, as tiktoken's `disallowed_special=()` does: a record
    that contains "<|im_end|>" cannot end a turn early. `eot_token` is the tokenizer's eos, or
    `eot_id` where given: pretraining's document separator (`<|endoftext|>` for SmolLM2, whose
    instruct eos ends a chat turn instead).
    """

    tokenizer: Any
    eot_id: int | None = None

    def __post_init__(self) -> None:
        if self.eot_id is None and self.tokenizer.eos_token_id is None:
            raise BadInput(
                f"{getattr(self.tokenizer, 'name_or_path', 'the tokenizer')}: no eos token "
                "(generation and the training targets need one)"
            )

    @property
    def eot_token(self) -> int:
        return int(self.eot_id if self.eot_id is not None else self.tokenizer.eos_token_id)

    @property
    def n_vocab(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, disallowed_special: Any = ()) -> list[int]:
        return self.encode_ordinary(text)

    def encode_ordinary(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_to_numpy(self, text: str, allowed_special=frozenset(), disallowed_special=()):
        """tiktoken's `encode_to_numpy` as `prepare pretrain` calls it: uint32 ids, where the special
        text it allows (only "<|endoftext|>", between documents) becomes `eot_token` and all other
        text is ordinary."""
        import re

        import numpy as np

        pieces = re.split("|".join(map(re.escape, allowed_special)), text) if allowed_special else [text]
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i:
                ids.append(self.eot_token)
            if piece:
                ids += self.encode_ordinary(piece)
        return np.asarray(ids, dtype=np.uint32)


def stop_ids(tokenizer, model=None) -> list[int]:
    """The ids that end a generated answer: the tokenizer's eos and every eos id of the model's
    generation config (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>; Llama 3: <|eot_id|> ...)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ids.update(int(i) for i in ([eos] if isinstance(eos, int) else (eos or [])))
    return sorted(ids)


def find_blocks(model):
    """(blocks, final_norm) of a causal LM or its backbone: the transformer blocks are the
    longest `nn.ModuleList` in the model (Llama/Qwen/Mistral `model.layers`, GPT-2
    `transformer.h`, ours `transformer.h`), the final norm the module named `norm`, `ln_f`,
    `final_layernorm` or `final_layer_norm` outside the blocks (None when there is none)."""
    import torch.nn as nn

    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"find_blocks: {type(model).__name__} has no list of blocks")
    block_name, blocks = max(lists, key=lambda nm: len(nm[1]))
    norm = None
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("norm", "ln_f", "final_layernorm", "final_layer_norm") and not name.startswith(block_name + "."):
            norm = m
    return blocks, norm


def block_linear_names(model) -> list[str]:
    """The distinct names of the nn.Linear layers inside the transformer blocks (Llama's q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2's c_attn, c_proj, c_fc): what
    `lora.target_modules: auto` adapts. The same set as peft's `all-linear` for a transformers
    model (which leaves the output head out), and for our GPT and the classifier too, whose new
    head is not inside a block."""
    import torch.nn as nn

    blocks, _ = find_blocks(model)
    # transformers' GPT-2 keeps its projections in Conv1D (a Linear with the weight transposed),
    # which peft adapts as well (fan_in_fan_out)
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in blocks.named_modules()
            if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
        }
    )
