"""The retrieval index of one document set: `data/index/NAME/`, built from synthesize's chunks.

`build(chunks, folder, ...)` indexes the chunks (`data/synthetic/NAME/chunks.jsonl`: the one
chunker, no second chunking) and writes the folder atomically; `Index.load(folder)` reads it;
`index.search(query, k)` returns the top `k` chunks as `Hit`s, best first.

- BM25 (always): bm25s (Lucene's BM25 variant, a sparse matrix of precomputed term scores, so a
  query is a sum of a few rows) over `terms.terms` (words; Chinese, Japanese and Korean as
  character bigrams). Its files are bm25s' own, under `bm25/`.
- Dense (with `index.embedding_model`): every chunk embedded once by the encoder
  (`encoder.Encoder`: mean-pooled, unit-length), `embeddings.npy`; a query is one encoder pass
  and a matrix-vector product.
- Hybrid, when both are there: reciprocal rank fusion (Cormack et al. 2009: score = sum over the
  two rankings of 1 / (60 + rank)), which needs no calibration between BM25 scores and cosines.

`index.json` records what the index was built from and how: the document set's name, the
sha256 of its chunks file, the format and the term version. A folder built from another document
set, by another format, or half-written, is refused in one line when it is loaded for that set.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from gptforge.errors import BadInput
from gptforge.io import atomic_dir
from gptforge.rag import terms as T
from gptforge.synthesize.chunks import Chunk, read_chunks, write_chunks

log = logging.getLogger("gptforge")

FORMAT = 1  # of this folder; another is refused on load ("rebuild it")
MANIFEST = "index.json"
RRF_K = 60  # reciprocal rank fusion's constant (the paper's, and the usual default)


@dataclass(frozen=True)
class Hit:
    chunk: Chunk
    score: float  # BM25 score, cosine, or fused RRF score (method says which)
    rank: int  # 1 = best


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(
    chunks: Sequence[Chunk],
    folder: str | os.PathLike,
    *,
    name: str,
    chunks_sha256: str,
    embedding_model: str | None = None,
    k1: float = 1.5,
    b: float = 0.75,
) -> "Index":
    """Index `chunks` into `folder` (whole or absent) and return it loaded."""
    import bm25s

    if not chunks:
        raise BadInput(f"index {name}: no chunks to index")
    tokens = [T.terms(f"{' '.join(c.headings)} {c.text}") for c in chunks]  # the headings say what a chunk is about
    with atomic_dir(folder) as tmp:
        bm25 = bm25s.BM25(k1=k1, b=b)
        bm25.index(tokens, show_progress=False)
        bm25.save(str(Path(tmp) / "bm25"))
        write_chunks(chunks, Path(tmp) / "chunks.jsonl")
        methods = ["bm25"]
        if embedding_model is not None:
            import numpy as np

            from gptforge.rag.encoder import Encoder

            encoder = Encoder.load(embedding_model)
            np.save(Path(tmp) / "embeddings.npy", encoder.encode([c.text for c in chunks], progress=True))
            methods.append("dense")
        manifest = {
            "format": FORMAT,
            "name": name,
            "chunks_sha256": chunks_sha256,
            "chunks": len(chunks),
            "methods": methods,
            "terms": T.VERSION,
            "k1": k1,
            "b": b,
            "embedding_model": embedding_model,
        }
        (Path(tmp) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return Index.load(folder)


class Index:
    def __init__(self, folder: Path, manifest: dict, chunks: list[Chunk], bm25, embeddings=None, encoder=None):
        self.folder, self.manifest, self.chunks = folder, manifest, chunks
        self._bm25, self._embeddings, self._encoder = bm25, embeddings, encoder

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def method(self) -> str:
        return "hybrid" if self._embeddings is not None else "bm25"

    @classmethod
    def load(
        cls,
        folder: str | os.PathLike,
        *,
        name: str | None = None,
        chunks_sha256: str | None = None,
        param: str = "index",
    ) -> "Index":
        """Read an index folder; BadInput (one line) when it is missing, of another format or term
        version, built from another document set (`name`) or other chunks (`chunks_sha256`), or
        its encoder is not there."""
        import bm25s

        folder = Path(folder)
        path = folder / MANIFEST
        if not path.is_file():
            raise BadInput(
                f"{param}: {folder} is not a gptforge index (no {MANIFEST}): build it with "
                "`gptforge index` (stage index@NAME)"
            )
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise BadInput(f"{param}: {path} is not JSON ({e})") from None
        if manifest.get("format") != FORMAT or manifest.get("terms") != T.VERSION:
            raise BadInput(
                f"{param}: {folder} was built by another version of gptforge (index format "
                f"{manifest.get('format')}, terms {manifest.get('terms')}; this one reads {FORMAT}, "
                f"{T.VERSION}): rebuild it with `gptforge index`"
            )
        if name is not None and manifest.get("name") != name:
            raise BadInput(f"{param}: {folder} indexes the document set {manifest.get('name')!r}, not {name!r}")
        if chunks_sha256 is not None and manifest.get("chunks_sha256") != chunks_sha256:
            raise BadInput(
                f"{param}: {folder} was built from other chunks than the document set {name!r} has now: "
                "rebuild it with `gptforge index`"
            )
        chunks = read_chunks(folder / "chunks.jsonl")
        bm25 = bm25s.BM25.load(str(folder / "bm25"))
        embeddings = encoder = None
        if "dense" in manifest.get("methods", ()):
            import numpy as np

            from gptforge.rag.encoder import Encoder

            embeddings = np.load(folder / "embeddings.npy")
            encoder = Encoder.load(manifest["embedding_model"], param=f"{param} (its embedding_model)")
        if len(chunks) != manifest.get("chunks") or (embeddings is not None and len(embeddings) != len(chunks)):
            raise BadInput(
                f"{param}: {folder} is incomplete ({len(chunks)} chunks, manifest says "
                f"{manifest.get('chunks')}): rebuild it with `gptforge index`"
            )
        return cls(folder, manifest, chunks, bm25, embeddings, encoder)

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The `k` best chunks for `query`, best first (fewer when the index is smaller)."""
        k = min(k, len(self.chunks))
        if k <= 0:
            return []
        bm25 = self._bm25_ranking(query, k if self._embeddings is None else min(len(self.chunks), 10 * k))
        if self._embeddings is None:
            return [Hit(self.chunks[i], s, r) for r, (i, s) in enumerate(bm25, 1)]
        dense = self._dense_ranking(query, min(len(self.chunks), 10 * k))
        fused: dict[int, float] = {}
        for ranking in (bm25, dense):
            for rank, (i, _) in enumerate(ranking, 1):
                fused[i] = fused.get(i, 0.0) + 1.0 / (RRF_K + rank)
        best = sorted(fused.items(), key=lambda item: (-item[1], item[0]))[:k]
        return [Hit(self.chunks[i], s, r) for r, (i, s) in enumerate(best, 1)]

    def _bm25_ranking(self, query: str, k: int) -> list[tuple[int, float]]:
        words = T.terms(query)
        if not words:
            return []
        ids, scores = self._bm25.retrieve([words], k=k, show_progress=False, n_threads=0)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]

    def _dense_ranking(self, query: str, k: int) -> list[tuple[int, float]]:
        import numpy as np

        q = self._encoder.encode([query])[0]
        sims = self._embeddings @ q
        top = np.argpartition(-sims, k - 1)[:k] if k < len(sims) else np.arange(len(sims))
        top = top[np.argsort(-sims[top], kind="stable")]
        return [(int(i), float(sims[i])) for i in top]
