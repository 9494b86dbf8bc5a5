"""init_from: a local Hugging Face GPT-2 folder is a starting point for pretraining and
fine-tuning (converted as the hub's sizes are), a folder named like a hub size is still a
folder, and other architectures are refused in one line naming the config key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.finetune.common import load_base
from gptforge.modeling.export import export_hf
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.hf_convert import load_pretrained
from gptforge.modeling.weights import save_model
from gptforge.training.loop import build_model

N_VOCAB, BLOCK = 50257, 32


def _perturb(module: torch.nn.Module) -> None:
    # Nonzero biases and non-unit LayerNorm gains: a tensor dropped or transposed shows in the logits.
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape) * 0.1)


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, BLOCK), generator=torch.Generator().manual_seed(1))


def _logits(model: GPT, idx: torch.Tensor, vocab: int) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(idx)[0][..., :vocab]


@pytest.fixture(scope="module")
def original(tmp_path_factory, gpt2_tokenizer_dir) -> tuple[GPT, Path]:
    """A tiny GPT, saved with save_model and exported with `gptforge export`'s function."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=BLOCK, vocab_size=50304, n_vocab=N_VOCAB))
    _perturb(model)
    root = tmp_path_factory.mktemp("init_from")
    save_model(model, root / "ckpt")
    return model.eval(), export_hf(root / "ckpt", root / "export", str(gpt2_tokenizer_dir))


def test_pretrain_starts_from_an_export_with_the_same_logits(original):
    model, export = original
    cfg = load_config(None, [f"model.block_size={BLOCK}", f"pretrain.init_from={export}"])
    loaded = build_model(cfg, N_VOCAB)
    assert loaded.config.n_vocab == N_VOCAB and loaded.config.vocab_size == 50304
    idx = _tokens(N_VOCAB)
    torch.testing.assert_close(_logits(loaded, idx, N_VOCAB), _logits(model, idx, N_VOCAB))

    again, source = load_pretrained(str(export), param="pretrain.init_from")
    assert source == f"Hugging Face GPT-2 folder {export}"
    torch.testing.assert_close(_logits(again, idx, N_VOCAB), _logits(model, idx, N_VOCAB))


def test_finetuning_starts_from_an_export_with_the_same_logits(original):
    model, export = original
    base = load_base(str(export), N_VOCAB, param="classify.init_from")
    assert base.training  # load_base hands over a model ready to train
    idx = _tokens(N_VOCAB)
    torch.testing.assert_close(_logits(base, idx, N_VOCAB), _logits(model, idx, N_VOCAB))


def test_a_folder_named_like_a_hub_size_is_a_folder(original, tmp_path, monkeypatch):
    model, export = original
    shutil.copytree(export, tmp_path / "gpt2-local")
    monkeypatch.chdir(tmp_path)  # a relative name that begins with "gpt2", as a user would type it
    cfg = load_config(None, [f"model.block_size={BLOCK}", "pretrain.init_from=gpt2-local"])
    loaded = build_model(cfg, N_VOCAB)
    idx = _tokens(N_VOCAB)
    torch.testing.assert_close(_logits(loaded, idx, N_VOCAB), _logits(model, idx, N_VOCAB))
    # and a name that is neither a hub size nor a folder is a missing folder, not a hub download
    cfg = load_config(None, ["pretrain.init_from=gpt2-small"])
    with pytest.raises(
        BadInput,
        match=r"^pretrain\.init_from: checkpoint folder gpt2-small not found; "
        r"name a GPT-2 size \(gpt2, gpt2-medium, gpt2-large, gpt2-xl\)",
    ):
        build_model(cfg, N_VOCAB)


def test_save_pretrained_gpt2_folder_gives_the_hf_models_logits(tmp_path):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=BLOCK, vocab_size=320)
    ).eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path / "hf")
    ours, source = load_pretrained(str(tmp_path / "hf"), param="instruct.init_from")
    assert source.startswith("Hugging Face GPT-2 folder")
    assert (ours.config.n_layer, ours.config.n_embd, ours.config.block_size, ours.config.n_vocab) == (2, 64, BLOCK, 320)
    idx = _tokens(320)
    with torch.no_grad():
        want = hf(idx).logits
    torch.testing.assert_close(_logits(ours, idx, 320), want)


def test_other_architectures_are_refused_in_one_line(tmp_path):
    # (Llama folders were refused here until the llama arch: now they load, tests/test_llama_arch.py.)
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=BLOCK,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "qwen2")
    with pytest.raises(BadInput) as err:
        load_base(str(tmp_path / "qwen2"), 320, param="instruct.init_from")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"instruct.init_from: {tmp_path / 'qwen2' / 'config.json'} is a Hugging Face "
        "Qwen2ForCausalLM config (model_type 'qwen2'); gptforge's GPT starts only from GPT-2 and Llama"
    )


def test_hf_gpt2_config_without_weights_names_what_is_missing(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    cfg = load_config(None, [f"pretrain.init_from={tmp_path / 'hf'}"])
    with pytest.raises(
        BadInput,
        match=r"^pretrain\.init_from: .*hf/config\.json is a Hugging Face gpt2 config, "
        r"but .*hf holds no weights \(model\.safetensors or pytorch_model\.bin\)$",
    ):
        build_model(cfg, N_VOCAB)


def test_hf_gpt2_weights_missing_tensors_are_refused_not_filled_at_random(tmp_path):
    from safetensors.torch import save_file

    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=BLOCK, vocab_size=320)
    )
    hf.save_pretrained(tmp_path / "hf")
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if ".h.1." not in k and k != "lm_head.weight"}
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        BadInput,
        match=r"^classify\.init_from: the Hugging Face GPT-2 folder .*hf lacks tensors "
        r"transformer\.h\.1\.attn\.c_attn\.bias, .* \(\+\d+ more\)$",
    ):
        load_base(str(tmp_path / "hf"), 320, param="classify.init_from")
