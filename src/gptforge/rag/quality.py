"""How well an index finds the chunk a question was made from: recall@1/5/10 and MRR.

Every pair synthesize kept records its source chunk (`chunk`), so the synthesized questions are
a retrieval test set that costs nothing. recall@k is the share of questions whose source chunk
is among the top k; MRR the mean of 1/rank of the source chunk within the top 10 (0 when it is
not there: MRR@10, as MS MARCO reports it). Names without `@`, which MLflow refuses.
"""

from __future__ import annotations

from typing import Iterable, Mapping

DEPTH = 10


def retrieval_quality(index, pairs: Iterable[Mapping], prefix: str = "") -> dict[str, float]:
    """{prefix}recall_at_1, _at_5, _at_10, mrr and questions over the pairs that name their chunk
    (`instruction` the question, `chunk` the source chunk's id)."""
    ranks = []
    for pair in pairs:
        if not pair.get("chunk") or not pair.get("instruction"):
            continue
        ids = [hit.chunk.id for hit in index.search(pair["instruction"], DEPTH)]
        ranks.append(ids.index(pair["chunk"]) + 1 if pair["chunk"] in ids else None)
    n = len(ranks)
    if n == 0:
        return {f"{prefix}questions": 0}
    found = lambda k: sum(1 for r in ranks if r is not None and r <= k) / n  # noqa: E731
    return {
        f"{prefix}recall_at_1": found(1),
        f"{prefix}recall_at_5": found(5),
        f"{prefix}recall_at_10": found(10),
        f"{prefix}mrr": sum(1.0 / r for r in ranks if r is not None) / n,
        f"{prefix}questions": n,
    }
