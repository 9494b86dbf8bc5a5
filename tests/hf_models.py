"""Tiny random Hugging Face causal LMs for tests: no hub, a real tokenizer.

`make_tiny_causal_lm(folder, arch)` writes what `save_pretrained` writes for a Llama or Qwen2
model of a few hundred thousand parameters (hidden 64, 2 layers) with the GPT-2 BPE tokenizer
(the package's embedded copy of OpenAI's encoder.json + vocab.bpe, as transformers'
vocab.json + merges.txt) and a ChatML chat template whose turns end in `<|endoftext|>`, the
tokenizer's eos: the shape of Qwen's and SmolLM's templates on a vocabulary we have here.
`make_tiny_encoder(folder)` writes a BERT folder: a model that is not a causal LM.
`tiny_llama_config(vocab)` is the config of a tiny in-memory Llama with grouped-query attention.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gptforge.samples import resolve

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(folder: Path, chat_template: str | None = CHATML):
    """The GPT-2 tokenizer as a transformers tokenizer saved in `folder` (and returned). It is
    built in a folder of its own, where a GPT-2 config.json makes AutoTokenizer pick GPT-2's
    class (in a Llama folder it would look for Llama's sentencepiece files)."""
    import tempfile

    from transformers import AutoTokenizer

    src = Path(resolve("sample://gpt2_tokenizer"))
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(src / "encoder.json", Path(tmp) / "vocab.json")
        shutil.copy(src / "vocab.bpe", Path(tmp) / "merges.txt")
        (Path(tmp) / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        tok = AutoTokenizer.from_pretrained(tmp)
    if chat_template is not None:
        tok.chat_template = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    return tok


def tiny_llama_config(vocab: int, attn: str = "sdpa", **changes):
    """A tiny Llama config with grouped-query attention (4 heads, 2 key/value heads, hidden 64,
    2 layers, 256 positions) over `vocab` tokens."""
    from transformers import LlamaConfig

    shape = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaConfig(**{**shape, **changes}, attn_implementation=attn)


def make_tiny_causal_lm(
    folder: Path, arch: str = "llama", *, seed: int = 0, chat_template: str | None = CHATML, max_positions: int = 256
) -> Path:
    """A random `arch` (llama | qwen2) causal LM with the GPT-2 tokenizer in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        vocab_size=50257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=50256,
        eos_token_id=50256,
        tie_word_embeddings=False,
    )
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**shape))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    make_tokenizer(folder, chat_template)
    return folder


def make_tiny_encoder(folder: Path) -> Path:
    """A random BERT (an encoder, not a causal LM) saved in `folder`."""
    from transformers import BertConfig, BertModel

    BertModel(
        BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(str(folder))
    return folder
