"""The gptforge checkpoint format: a folder with the weights (`model.safetensors`, never pickle)
and the model config (`config.json`, tagged with FORMAT and FORMAT_VERSION), written atomically
by `save_model` and read back, with one-line errors naming the file, by `load_model`, which also
reads the weights of a sharded training checkpoint (`dcp/`, pretrain.strategy fsdp). It imports
`gptforge.modeling.gpt`, `gptforge.io` and `gptforge.errors`; `gptforge.modeling.hf_convert` builds on its
public helpers (`empty_model`, `load_checked`, `few`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as _load_safetensors
from safetensors.torch import save as _safetensors_bytes

from gptforge.errors import BadInput
from gptforge.io import atomic_file, read_json, write_json
from gptforge.modeling.gpt import GPT, GPTConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SHARDS_DIR = "dcp"  # a sharded training checkpoint's weights and optimizer state (training.sharding)
FORMAT = "gptforge-gpt2"
FORMAT_VERSION = 1


def empty_model(config: GPTConfig, device="cpu") -> GPT:
    """A GPT with uninitialized storage, for loading weights into: random init of a large model
    is seconds of CPU time that the loaded weights overwrite anyway."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    tie(model)  # to_empty made new storage
    return model


def tie(model: GPT) -> None:
    """Make lm_head's weight the token embedding again, when the config ties them."""
    if model.config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight


def _tied_head(model: GPT) -> set[str]:
    """{"lm_head.weight"} when it is wte's weight (saved once, under the embedding's name)."""
    return {"lm_head.weight"} if model.config.tie_embeddings else set()


def _own_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    tied = _tied_head(model)
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in tied}


def save_model(model: GPT, folder: str | Path) -> Path:
    """Write `model.safetensors` and `config.json` into `folder`, each atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = _safetensors_bytes(_own_state_dict(model), metadata={"format": "pt"})
    with atomic_file(folder / WEIGHTS_FILE, "wb") as f:
        f.write(data)
    return write_model_config(model, folder)


def write_model_config(model: GPT, folder: str | Path) -> Path:
    """`config.json` alone: beside the weights, or beside the shards of a sharded checkpoint."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / CONFIG_FILE, {**model.config.to_dict(), "format": FORMAT, "version": FORMAT_VERSION})
    return folder


def load_config(folder: str | Path) -> GPTConfig:
    path = Path(folder) / CONFIG_FILE
    d = read_json(path, missing=f": not found (a model folder holds {WEIGHTS_FILE} and {CONFIG_FILE})")
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise BadInput(f'{path}: not a gptforge model config (expected "format": "{FORMAT}")')
    if d.get("version") != FORMAT_VERSION:
        raise BadInput(f"{path}: format version {d.get('version')!r} is not supported (expected {FORMAT_VERSION})")
    d = {k: v for k, v in d.items() if k not in ("format", "version")}
    try:
        return GPTConfig.from_dict(d)
    except BadInput as e:
        raise BadInput(f"{path}: {e}") from None
    except TypeError as e:
        raise BadInput(f"{path}: {e}") from None


def load_model(folder: str | Path, map_location="cpu") -> GPT:
    """Read a folder written by save_model. Any problem is a one-line BadInput naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"model folder not found: {folder}")
    config = load_config(folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file() and (folder / SHARDS_DIR).is_dir():
        return _load_shards(folder / SHARDS_DIR, config, map_location)
    if not path.is_file():
        raise BadInput(f"{path}: not found")
    try:
        state = _load_safetensors(str(path), device=str(map_location))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise BadInput(f"{path}: not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None
    model = empty_model(config, map_location)
    load_checked(model, state, path)
    return model


def _load_shards(shards: Path, config: GPTConfig, map_location) -> GPT:
    """The whole model from the shards a `pretrain.strategy: fsdp` checkpoint holds (written by
    any number of processes; torch.distributed.checkpoint reassembles them here, in this process)."""
    import torch.distributed.checkpoint as dcp

    model = empty_model(config, map_location)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(shards))
    except Exception as e:  # DCP raises CheckpointException (wrapping each rank's error) and others
        raise BadInput(f"{shards}: not a readable sharded checkpoint ({' '.join(str(e).split())[:200]})") from None
    model.load_state_dict(state["model"], strict=True)
    tie(model)
    return model


def load_checked(model: GPT, state: dict[str, torch.Tensor], origin) -> None:
    """Load `state` (our names, lm_head left out when it is tied to wte) into `model`; missing,
    unexpected or misshapen tensors are a one-line BadInput that starts with `origin`."""
    tied = _tied_head(model)
    expected = {k: v.shape for k, v in model.state_dict().items() if k not in tied}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = ([f"missing tensors {few(missing)}"] if missing else []) + (
            [f"unexpected tensors {few(unexpected)}"] if unexpected else []
        )
        raise BadInput(f"{origin}: {'; '.join(parts)} for a model with config {model.config.to_dict()}")
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(s)})" for k, s in expected.items() if state[k].shape != s]
    if wrong:
        raise BadInput(f"{origin}: wrong tensor shapes: {few(wrong)}")
    head = {"lm_head.weight": state["transformer.wte.weight"]} if tied else {}
    with torch.no_grad():
        model.load_state_dict({**state, **head}, strict=True)


def few(items: list[str], n: int = 3) -> str:
    """The first `n` of `items` for a message, and how many more there are."""
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")
