"""export_hf: a folder that transformers' Auto classes load, with our model's logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from gptforge.errors import BadInput, SourceUnreachable
from gptforge.modeling.export import export_hf
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.weights import save_model


def checkpoint(folder, n_vocab=50257, bias=True, seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=-(-n_vocab // 64) * 64, n_vocab=n_vocab, bias=bias
    )
    m = GPT(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    save_model(m, folder)
    return m


@pytest.mark.parametrize("bias", [True, False])
def test_export_loads_with_auto_classes(tmp_path, gpt2_tokenizer_dir, bias):
    m = checkpoint(tmp_path / "ckpt", bias=bias)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf", str(gpt2_tokenizer_dir))
    assert out == tmp_path / "hf"
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["activation_function"] == "gelu_new" and cfg["vocab_size"] == 50257 and cfg["n_positions"] == 16
    assert cfg["eos_token_id"] == 50256

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = m(idx)
        got = hf(idx).logits
    torch.testing.assert_close(got, want[..., :50257], atol=1e-5, rtol=1e-5)

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok.eos_token == tok.bos_token == tok.unk_token == "<|endoftext|>"
    assert tok.eos_token_id == 50256
    special = json.loads((out / "special_tokens_map.json").read_text())
    assert special == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    assert (out / "vocab.json").read_bytes() == (gpt2_tokenizer_dir / "encoder.json").read_bytes()


def test_export_without_tokenizer_offline_is_source_unreachable(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    checkpoint(tmp_path / "ckpt", n_vocab=100)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("previous export")
    with pytest.raises(SourceUnreachable) as e:
        export_hf(tmp_path / "ckpt", tmp_path / "hf", None)
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("; set tokenizer.path to a folder with encoder.json and vocab.bpe")
    # the failed export left the previous folder as it was, and no half-written sibling
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]


def test_export_bad_inputs(tmp_path, small_tokenizer):
    checkpoint(tmp_path / "ckpt", n_vocab=100)
    with pytest.raises(BadInput, match="model folder not found"):
        export_hf(tmp_path / "missing", tmp_path / "hf", None)
    with pytest.raises(BadInput, match="would replace the checkpoint"):
        export_hf(tmp_path / "ckpt", tmp_path, None)
    # a .tiktoken rank file is not enough to write vocab.json/merges.txt
    with pytest.raises(BadInput, match="encoder.json and vocab.bpe"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", str(small_tokenizer))
    assert not (tmp_path / "hf").exists()


def test_export_refuses_tokenizer_larger_than_model(tmp_path, gpt2_tokenizer_dir):
    checkpoint(tmp_path / "ckpt", n_vocab=100)
    with pytest.raises(BadInput, match="50257 tokens, more than the model's n_vocab=100"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", str(gpt2_tokenizer_dir))
