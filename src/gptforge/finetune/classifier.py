"""The text classifier: a causal backbone (our GPT or a Hugging Face causal LM) and a linear head
on the final hidden state of each text's last real token; its folder (the backbone beside
`classifier.safetensors` and `classifier.json`) written and read; texts classified with it.
`gptforge finetune classify` trains it; `gptforge classify`, `gptforge serve` and the registry's
pyfunc load it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file as _load_safetensors
from safetensors.torch import save as _safetensors_bytes

from gptforge.errors import BadInput
from gptforge.finetune.classify_data import encode, predict
from gptforge.finetune.common import model_positions
from gptforge.finetune.hf_models import save_hf_model
from gptforge.io import atomic_file, write_json
from gptforge.modeling.gpt import GPT
from gptforge.modeling.hf_causal import HFTokenizer, hf_source, load_causal_lm
from gptforge.modeling.weights import load_model, save_model
from gptforge.training.runtime import Runtime

HEAD_FILE = "classifier.safetensors"
HEAD_CONFIG = "classifier.json"
BINARY_LABELS = ["ham", "spam"]  # data/classify's labels 0 and 1


# ---------------------------------------------------------------------------------------------
# The model


class LastTokenClassifier(nn.Module):
    """A causal backbone and a linear head on the final hidden state of each row's last real token.

    `forward(idx, lengths)`: idx (B, T) token ids right-padded to T, lengths (B,) the real
    token counts (>= 1) -> logits (B, n_classes). The index comes from the lengths, not from
    looking for the padding id, which a text may contain. Subclasses hold the backbone (as
    `backbone`) and say how to read its hidden states (`hidden_states(idx)` -> (B, T, C), after
    the final norm); `tokenizer` is the tokenizer the classifier must be used with when it
    brings its own (a Hugging Face model's `HFTokenizer`), None when the caller's is the one.
    """

    tokenizer: Any = None

    def _add_head(self, hidden_size: int, n_classes: int, labels: Sequence[str] | None, max_length: int) -> None:
        self.head = nn.Linear(hidden_size, n_classes)
        self.n_classes = n_classes
        self.labels = list(labels) if labels is not None else default_labels(n_classes)
        self.max_length = max_length

    @property
    def backbone(self) -> nn.Module:
        raise NotImplementedError

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden_states(idx)  # (B, T, C)
        last = hidden[torch.arange(idx.size(0), device=idx.device), lengths.to(idx.device) - 1]
        # The head only ever sees B vectors, never B*T: a (B, T, n_classes) output would be
        # wasted work for every position but one. A bf16 backbone (LoRA on CUDA) still feeds
        # the float32 head outside autocast.
        return self.head(last.to(self.head.weight.dtype))


class GPTClassifier(LastTokenClassifier):
    """The classifier on our own GPT (`self.gpt`). The backbone's own `lm_head` stays (tied to
    the embedding, unused here) so the backbone remains a plain GPT that `save_model` writes and
    `load_model` reads."""

    def __init__(self, gpt: GPT, n_classes: int, labels: Sequence[str] | None = None, max_length: int | None = None):
        super().__init__()
        self.gpt = gpt
        self._add_head(
            gpt.config.n_embd, n_classes, labels, max_length if max_length is not None else gpt.config.block_size
        )

    @property
    def backbone(self) -> nn.Module:
        return self.gpt

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt.hidden_states(idx)


class HFClassifier(LastTokenClassifier):
    """The classifier on a Hugging Face causal LM (`self.lm`: LlamaForCausalLM, Qwen2ForCausalLM,
    ...), with the model's own tokenizer (`tokenizer`, an `HFTokenizer`). The hidden states come
    from its decoder (`get_decoder()`: the LlamaModel inside, whose `last_hidden_state` is after
    the final norm), so the vocabulary logits are never computed; the LM head stays, unused, so
    the backbone is saved as an ordinary causal LM."""

    def __init__(
        self,
        lm: nn.Module,
        n_classes: int,
        labels: Sequence[str] | None = None,
        max_length: int | None = None,
        tokenizer: HFTokenizer | None = None,
    ):
        super().__init__()
        self.lm = lm
        self._add_head(
            lm.config.hidden_size, n_classes, labels, max_length if max_length is not None else model_positions(lm)
        )
        self.tokenizer = tokenizer

    @property
    def backbone(self) -> nn.Module:
        return self.lm

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        # Right padding needs no attention mask (causal); no cache in a classifier.
        return self.lm.get_decoder()(input_ids=idx, use_cache=False).last_hidden_state


def default_labels(n_classes: int) -> list[str]:
    return list(BINARY_LABELS) if n_classes == 2 else [str(i) for i in range(n_classes)]


# ---------------------------------------------------------------------------------------------
# Saving and loading the result


def save_classifier(
    classifier: LastTokenClassifier, folder: str | os.PathLike, extra: dict[str, Any] | None = None
) -> Path:
    """Write the backbone and the head (classifier.safetensors + classifier.json) into `folder`.
    Our GPT's backbone as `save_model` writes it (model.safetensors + config.json); a Hugging
    Face backbone as an ordinary Hugging Face folder of the causal LM and its tokenizer
    (`save_hf_model`: safetensors, config.json, generation_config.json, tokenizer files)."""
    folder = Path(folder)
    if isinstance(classifier, HFClassifier):
        save_hf_model(classifier.lm, classifier.tokenizer.tokenizer, folder)
        backbone = "hf"
    else:
        save_model(classifier.gpt, folder)
        backbone = "gpt"
    head = {k: v.detach().contiguous().cpu() for k, v in classifier.head.state_dict().items()}
    with atomic_file(folder / HEAD_FILE, "wb") as f:
        f.write(_safetensors_bytes(head, metadata={"format": "pt"}))
    write_json(
        folder / HEAD_CONFIG,
        {
            "n_classes": classifier.n_classes,
            "labels": classifier.labels,
            "max_length": classifier.max_length,
            "backbone": backbone,
            **(extra or {}),
        },
    )
    return folder


def load_classifier(folder: str | os.PathLike, map_location="cpu") -> LastTokenClassifier:
    """The classifier in a folder written by the recipe (eval mode): a GPTClassifier, or an
    HFClassifier (float32, with the folder's own tokenizer as `tokenizer`) when the folder is a
    Hugging Face causal-LM folder (`hf_source`). Any problem is a one-line BadInput naming the
    file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"classifier folder not found: {folder} (run `gptforge finetune classify` first)")
    meta_path, head_path = folder / HEAD_CONFIG, folder / HEAD_FILE
    for path in (meta_path, head_path):
        if not path.is_file():
            raise BadInput(
                f"{path}: not found (a classifier folder holds {HEAD_FILE} and {HEAD_CONFIG} beside the model)"
            )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        n_classes, labels, max_length = int(meta["n_classes"]), list(meta["labels"]), int(meta["max_length"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{meta_path}: not a classifier description ({type(e).__name__}: {e})") from None
    if len(labels) != n_classes:
        raise BadInput(f"{meta_path}: {len(labels)} labels for {n_classes} classes")
    if hf_source(str(folder)) is not None:
        # float32 whatever the saved dtype (transformers 5 loads the saved one by default):
        # classify_texts runs without autocast, where exact probabilities matter.
        lm, tokenizer = load_causal_lm(str(folder), param="classifier", dtype=torch.float32)
        classifier: LastTokenClassifier = HFClassifier(
            lm, n_classes, labels, max_length, tokenizer=HFTokenizer(tokenizer)
        )
    else:
        if meta.get("backbone", "gpt") != "gpt":
            raise BadInput(
                f"{meta_path}: the backbone is a {meta['backbone']!r} model, but {folder / 'config.json'} "
                "is not a Hugging Face causal LM's config"
            )
        classifier = GPTClassifier(load_model(folder, map_location=map_location), n_classes, labels, max_length)
    positions = model_positions(classifier.backbone)
    if max_length > positions:
        raise BadInput(f"{meta_path}: max_length ({max_length}) is above the model's {positions} positions")
    classifier.to(map_location)
    try:
        head = _load_safetensors(str(head_path), device=str(map_location))
        classifier.head.load_state_dict(head, strict=True)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise BadInput(f"{head_path}: not this classifier's head ({' '.join(str(e).split())[:200]})") from None
    return classifier.eval()


@torch.no_grad()
@torch.no_grad()
def class_probabilities(
    classifier: LastTokenClassifier, texts: Sequence[str], enc, device="cpu", batch_size: int = 32
) -> torch.Tensor:
    """(N, n_classes) softmax probabilities of every class for each text, in order, in fp32 (a
    few texts, where exact probabilities matter more than speed); texts are cut to the
    classifier's max_length tokens as in training. A classifier that brings its own tokenizer
    (`classifier.tokenizer`: a Hugging Face backbone's) is used with it, and `enc` is ignored."""
    if getattr(classifier, "tokenizer", None) is not None:
        enc = classifier.tokenizer
    examples, _ = encode([{"text": t, "label": 0} for t in texts], enc, classifier.max_length)
    if not examples:
        return torch.zeros(0, classifier.n_classes)
    logits, _ = predict(classifier, examples, batch_size, enc.eot_token, Runtime(device=torch.device(device)))
    return logits.softmax(-1)


def classify_texts(
    classifier: LastTokenClassifier, texts: Sequence[str], enc, device, batch_size: int = 32
) -> list[tuple[int, float]]:
    """(label index, its softmax probability) for each text, in order (`class_probabilities`)."""
    probs = class_probabilities(classifier, texts, enc, device, batch_size)
    best = probs.argmax(-1)
    return [(int(i), float(probs[row, i])) for row, i in enumerate(best)]
