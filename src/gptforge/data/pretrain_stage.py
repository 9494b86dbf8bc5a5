"""The `prepare_pretrain` stage: the corpus found (or downloaded), tokenized by datatrove tasks
(`data.pretrain_pipeline`) into the shards of `data/pretrain/` (written whole or not at all), its
manifest, metrics and MLflow artifact. The readers, the tokenizer loop and the shard layout are
`data.pretrain`'s.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gptforge
from gptforge.config.schema import Config
from gptforge.data.pretrain import find_corpus
from gptforge.data.pretrain_pipeline import tokenize_with_datatrove
from gptforge.io import atomic_dir, write_json
from gptforge.modeling.tokenizer import check_fits_uint16, describe, load_tokenizer
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics

log = logging.getLogger("gptforge")


def prepare_pretrain(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run=NullRun(),
    out_dir: str | os.PathLike = "data/pretrain",
    metrics_path: str | os.PathLike = "metrics/prepare_pretrain.json",
    raw_dir: str | os.PathLike = "data/raw",
) -> dict:
    d = cfg.data.pretrain
    enc = load_tokenizer(cfg.tokenizer.path)
    check_fits_uint16(enc, cfg.tokenizer.path)
    source = d.source
    if source.startswith("https://"):
        from gptforge.data.sources import materialize

        source = str(
            materialize(
                source,
                param="data.pretrain.source",
                sha256=d.sha256,
                download=cfg.data.download,
                steps=steps,
                raw_dir=raw_dir,
            )
        )
    corpus = steps(
        find_corpus, source, name=d.name, split=d.split, text_field=d.text_field, param="data.pretrain.source"
    )
    with atomic_dir(out_dir) as tmp:
        stats = steps(
            tokenize_with_datatrove,
            corpus,
            tmp,
            d,
            tokenizer_path=cfg.tokenizer.path,
            eot=enc.eot_token,
            work_root=Path(out_dir).absolute().parent / f".{Path(out_dir).name}.work",
        )
        manifest = {
            "source": d.source,
            "name": d.name if d.source.startswith("hf://") else None,
            "tokenizer": {"name": describe(cfg.tokenizer.path), "n_vocab": enc.n_vocab, "eot": enc.eot_token},
            "dtype": "uint16",
            "documents": stats.documents,
            "tokens": stats.tokens,
            "truncated_at_max_tokens": stats.truncated,
            "tokens_per_sec": stats.total_tokens / stats.seconds,
            "seconds": stats.seconds,
            "shards": stats.shards,
            "executor": {"kind": d.executor, "tasks": d.cluster.tasks},
            "gptforge_version": gptforge.__version__,
        }
        write_json(Path(tmp) / "manifest.json", manifest)
    metrics = {
        "tokens": stats.total_tokens,
        "train_tokens": stats.tokens["train"],
        "val_tokens": stats.tokens["val"],
        "documents": stats.documents["train"] + stats.documents["val"],
        "tokens_per_sec": manifest["tokens_per_sec"],
    }
    log.info(
        "wrote %d shards, %d tokens (%.2fM tokens/s) to %s",
        len(stats.shards),
        stats.total_tokens,
        manifest["tokens_per_sec"] / 1e6,
        out_dir,
    )
    publish_metrics(run, metrics, metrics_path)
    run.log_artifact(Path(out_dir) / "manifest.json")
    return metrics
