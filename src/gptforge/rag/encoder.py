"""A text encoder for dense retrieval (`index.embedding_model`): a Hugging Face encoder folder
(a sentence-transformers model such as BAAI/bge-small-en-v1.5 or all-MiniLM-L6-v2 is one: its
`config.json`, weights and tokenizer) or a hub id in transformers' local cache, read offline.

Embeddings are the mean of the last hidden states over the real tokens, scaled to unit length,
which is what sentence-transformers computes for its mean-pooling models (most of them), so a
dot product is the cosine. Texts are cut to the encoder's positions (512 for BERT-sized ones).
transformers does the work; sentence-transformers is not needed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from gptforge.errors import BadInput


class Encoder:
    def __init__(self, model, tokenizer, name: str):
        self.model, self.tokenizer, self.name = model, tokenizer, name

    @classmethod
    def load(cls, name: str | os.PathLike, *, param: str = "index.embedding_model") -> "Encoder":
        """The encoder of a local folder, or of a hub id already in transformers' cache (nothing is
        fetched here). BadInput in one line when it is not there or is not an encoder."""
        from transformers import AutoModel, AutoTokenizer

        name = str(name)
        local = Path(name).exists()
        if not local and (name.startswith((".", "/")) or name.count("/") != 1):
            raise BadInput(f"{param}: {name} not found (a local encoder folder, or a hub id in the local cache)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
            model = AutoModel.from_pretrained(name, local_files_only=True).eval()
        except (OSError, ValueError) as e:
            where = name if local else f"{name} (not in the local Hugging Face cache: this machine is offline)"
            raise BadInput(f"{param}: cannot load an encoder from {where}: {' '.join(str(e).split())[:160]}") from None
        if tokenizer.pad_token is None:  # padding is masked out of the mean: any token will do
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if getattr(model.config, "is_decoder", False) or "CausalLM" in type(model).__name__:
            raise BadInput(f"{param}: {name} is a {type(model).__name__}, not a text encoder")
        return cls(model, tokenizer, name)

    def encode(self, texts: Sequence[str], *, batch_size: int = 32, progress: bool = False):
        """(len(texts), hidden) float32 numpy array of unit-length embeddings."""
        import numpy as np
        import torch
        from tqdm.auto import tqdm

        out = []
        starts = range(0, len(texts), batch_size)
        for start in tqdm(starts, desc="embedding chunks", unit="batch", disable=not progress, leave=False):
            batch = self.tokenizer(
                list(texts[start : start + batch_size]),
                padding=True,
                truncation=True,
                max_length=_positions(self.model, self.tokenizer),
                return_tensors="pt",
            )
            with torch.no_grad():
                hidden = self.model(**batch).last_hidden_state.float()
            mask = batch["attention_mask"].unsqueeze(-1).float()
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            out.append(torch.nn.functional.normalize(mean, dim=-1).numpy())
        return np.concatenate(out).astype(np.float32) if out else np.zeros((0, 0), np.float32)


def _positions(model, tokenizer) -> int:
    positions = getattr(model.config, "max_position_embeddings", None) or 512
    limit = getattr(tokenizer, "model_max_length", None) or positions
    return int(min(positions, limit))
