"""gptforge: a GPT-2 language model from raw text to an evaluated, registered model."""

__version__ = "0.1.0"
