"""The model and its formats: the GPT-2 model (`gpt`), KV-cache decoding, the checkpoint format's
weights I/O, Hugging Face conversion and causal LMs, the tokenizer, FLOPs and the export.

Imports only torch, numpy, tiktoken (and transformers where a Hugging Face model is asked for),
so it runs on a bare GPU machine; nothing here knows about stages, tracking or Prefect.
"""
