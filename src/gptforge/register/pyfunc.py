"""The spam classifier as an MLflow pyfunc model: `log_classifier` logs a classifier folder
(`checkpoints/classify/final`) into the active run, and `mlflow.pyfunc.load_model(uri).predict`
then takes texts (a list, a pandas Series, or a DataFrame with a `text` column) and returns a
DataFrame of `label` and `spam_probability` (the softmax probability of label index 1, "spam").
The model's artifacts are the classifier folder and, for our GPT, its tiktoken tokenizer (a
folder or a `.tiktoken` file; none when the tokenizer is tiktoken's download, or when a Hugging
Face backbone brings its own). Loading it needs gptforge installed, which is not on PyPI: the
pip requirements name only the installed mlflow, torch, tiktoken and safetensors (and
transformers for a Hugging Face backbone), pinned, so MLflow does not infer them in a subprocess.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.models import infer_signature
from mlflow.pyfunc import PythonModel, PythonModelContext

from gptforge.errors import BadInput
from gptforge.finetune.classifier import HEAD_CONFIG, class_probabilities, load_classifier
from gptforge.finetune.classify_data import POSITIVE
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.runtime.run_context import pinned_requirements

INPUT_EXAMPLE = {"text": ["WINNER!! Claim your free prize now", "See you at lunch?"]}


def input_texts(model_input: Any) -> list[str]:
    """The texts of a list/tuple of strings, a Series, or a DataFrame's `text` (or only) column."""
    if isinstance(model_input, pd.DataFrame):
        if "text" in model_input.columns:
            model_input = model_input["text"]
        elif len(model_input.columns) == 1:
            model_input = model_input.iloc[:, 0]
        else:
            raise BadInput(f"spam classifier: a DataFrame needs a `text` column, got {list(model_input.columns)}")
    if isinstance(model_input, str):
        model_input = [model_input]
    texts = list(model_input)
    bad = [type(t).__name__ for t in texts if not isinstance(t, str)]
    if bad:
        raise BadInput(f"spam classifier: expected texts, got {bad[0]} values")
    return texts


class SpamClassifierModel(PythonModel):
    """A gptforge text classifier behind MLflow's pyfunc interface (see the module docstring)."""

    def load_context(self, context) -> None:
        self.classifier = load_classifier(context.artifacts["classifier"])
        # A Hugging Face backbone brings its own tokenizer; our GPT uses the logged one, or
        # tiktoken's gpt2 download when none was logged.
        self.enc = None if self.classifier.tokenizer is not None else load_tokenizer(context.artifacts.get("tokenizer"))

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        """`label` and `spam_probability` per text. MLflow hands a DataFrame (from a list, a
        Series or a DataFrame); called directly, lists and Series work too (`input_texts`)."""
        texts = input_texts(model_input)
        probs = class_probabilities(self.classifier, texts, self.enc)
        labels = [self.classifier.labels[i] for i in probs.argmax(-1).tolist()]
        return pd.DataFrame(
            {"label": pd.Series(labels, dtype=object), "spam_probability": probs[:, POSITIVE].double().numpy()}
        )


def log_classifier(folder: str | os.PathLike, *, tokenizer_path: str | os.PathLike | None, name: str = "model"):
    """Log the classifier in `folder` as pyfunc model `name` of the active MLflow run (the caller
    starts it) and return MLflow's ModelInfo. `tokenizer_path` (a folder or `.tiktoken` file) is
    logged beside it for our GPT; None means tiktoken's download, and a Hugging Face backbone
    ignores it. The signature's output comes from the model's own output on INPUT_EXAMPLE."""
    folder = Path(folder)
    try:
        hf = json.loads((folder / HEAD_CONFIG).read_text(encoding="utf-8")).get("backbone") == "hf"
    except (OSError, ValueError, AttributeError):
        hf = False  # load_classifier below names the problem
    artifacts = {"classifier": str(folder)}
    if tokenizer_path is not None and not hf:
        artifacts["tokenizer"] = str(tokenizer_path)
    loaded = SpamClassifierModel()  # for the signature; what is logged is a fresh one, without weights
    loaded.load_context(PythonModelContext(artifacts=artifacts, model_config={}))
    example = pd.DataFrame(INPUT_EXAMPLE)
    # The signature's input is one unnamed string column, inferred from the texts as a list: a
    # column named `text` (what the DataFrame gives) makes MLflow refuse lists and Series.
    signature = infer_signature(INPUT_EXAMPLE["text"], loaded.predict(None, example))
    packages = ("mlflow", "torch", "tiktoken", "safetensors") + (("transformers",) if hf else ())
    return mlflow.pyfunc.log_model(
        name=name,
        python_model=SpamClassifierModel(),
        artifacts=artifacts,
        signature=signature,
        input_example=example,
        pip_requirements=pinned_requirements(*packages),
    )
