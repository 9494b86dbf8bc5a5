"""`gptforge index`: the retrieval index of one entry of `synthesize.documents` (DVC stage
index@NAME, `-S synthesize.only=NAME`), over the chunks stage synthesize@NAME wrote.

Reads `data/synthetic/NAME/chunks.jsonl` and `qa.jsonl`; writes `data/index/NAME/` (rag/index.py)
and `metrics/index_NAME.json`: the index's size and build time, and its retrieval quality on the
synthesized questions (rag/quality.py: recall_at_1, recall_at_5, recall_at_10, mrr), plus the same
over the held-out split alone (`heldout_recall_at_5`, ...) when prepare_instruct reads these
pairs (`data.instruct.source: synthetic://NAME`, its test split in `data/instruct/test.jsonl`).

A set synthesized without an endpoint has chunks and no `qa.jsonl`: the index is built all the
same, and its metrics say `questions` 0 (retrieval is then measured by evaluate_qa, on the
user's questions that name their source file).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from gptforge.errors import BadInput
from gptforge.io import write_json
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun

log = logging.getLogger("gptforge")

OUT_ROOT = Path("data/index")


def index_path(name: str, root: str | os.PathLike = OUT_ROOT) -> Path:
    return Path(root) / name


def index(
    cfg,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    synthetic_root: str | os.PathLike = "data/synthetic",
    out_root: str | os.PathLike = OUT_ROOT,
    instruct_dir: str | os.PathLike = "data/instruct",
    metrics_dir: str | os.PathLike = "metrics",
) -> dict:
    """Index `synthesize.documents[synthesize.only]` (every entry when `only` is null)."""
    from gptforge.synthesize.stage import selected_documents

    names = selected_documents(cfg.synthesize)
    metrics: dict[str, float] = {}
    for name in names:
        got = steps(
            index_one,
            cfg,
            name,
            synthetic_root=synthetic_root,
            out_root=out_root,
            instruct_dir=instruct_dir,
            metrics_dir=metrics_dir,
        )
        metrics.update({f"{name}.{k}": v for k, v in got.items()} if len(names) > 1 else got)
        run.log_artifact(Path(metrics_dir) / f"index_{name}.json")
    run.log_metrics(metrics)
    return metrics


def index_one(cfg, name: str, *, synthetic_root, out_root, instruct_dir, metrics_dir) -> dict:
    from gptforge.rag.index import build, file_sha256
    from gptforge.rag.quality import retrieval_quality
    from gptforge.synthesize.chunks import read_chunks

    folder = Path(synthetic_root) / name
    chunks_file = folder / "chunks.jsonl"
    if not chunks_file.is_file():
        raise BadInput(
            f"index {name}: {chunks_file} not found: run `gptforge synthesize -S synthesize.only={name}` "
            "first (stage synthesize@NAME)"
        )
    chunks = read_chunks(chunks_file)
    c = cfg.index
    t0 = time.perf_counter()
    idx = build(
        chunks,
        index_path(name, out_root),
        name=name,
        chunks_sha256=file_sha256(chunks_file),
        embedding_model=c.embedding_model,
        k1=c.k1,
        b=c.b,
    )
    seconds = time.perf_counter() - t0
    metrics: dict[str, float] = {"chunks": len(chunks), "build_seconds": seconds}
    pairs = _records(folder / "qa.jsonl")
    if not (folder / "qa.jsonl").is_file():
        log.info(
            "index %s: %s holds chunks only (no synthesized questions): retrieval quality not measured here",
            name,
            folder,
        )
    metrics.update(retrieval_quality(idx, pairs))
    if cfg.data.instruct.source == f"synthetic://{name}":
        metrics.update(retrieval_quality(idx, _records(Path(instruct_dir) / "test.jsonl"), prefix="heldout_"))
    write_json(Path(metrics_dir) / f"index_{name}.json", metrics)
    log.info(
        "index %s: %d chunks (%s) in %.2f s; recall@1 %.3f, @5 %.3f, @10 %.3f, MRR %.3f over %d questions",
        name,
        len(chunks),
        idx.method,
        seconds,
        metrics.get("recall_at_1", 0.0),
        metrics.get("recall_at_5", 0.0),
        metrics.get("recall_at_10", 0.0),
        metrics.get("mrr", 0.0),
        metrics.get("questions", 0),
    )
    return metrics


def _records(path: Path) -> list[dict]:
    """The jsonl records of `path` that are objects; [] when it is not there."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            if isinstance(rec, dict):
                out.append(rec)
    return out
