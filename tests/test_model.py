"""The GPT model: config, parity with Hugging Face's GPT-2, loss over the real vocabulary, init,
optimizer groups, weights I/O. Small random models only; nothing touches the network."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from gptforge.config.schema import ModelConfig
from gptforge.errors import BadInput, SourceUnreachable
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.hf_convert import from_hf, from_pretrained, hf_state_dict, to_hf
from gptforge.modeling.weights import load_model, save_model
from gptforge.training.optim import adamw

SMALL = dict(n_layer=2, n_head=2, n_embd=64, block_size=32)


def small(n_vocab=100, **kw) -> GPTConfig:
    return GPTConfig(**{**SMALL, "vocab_size": -(-n_vocab // 64) * 64, "n_vocab": n_vocab, **kw})


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Move every parameter away from its structured init (zero biases, unit LayerNorm gains),
    so that a transposed or swapped tensor cannot hide behind a symmetric value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


def hf_model(vocab: int = 100, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=vocab, bos_token_id=None, eos_token_id=None
    )
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    randomize(hf, seed)
    return hf


# ---------------------------------------------------------------------------------------------
# Config


def test_config_round_trip_and_bad_keys():
    cfg = small(attention="math", bias=False)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(BadInput, match="unknown keys n_layers"):
        GPTConfig.from_dict({**cfg.to_dict(), "n_layers": 3})
    d = cfg.to_dict()
    del d["n_vocab"]
    with pytest.raises(BadInput, match="missing keys n_vocab"):
        GPTConfig.from_dict(d)
    with pytest.raises(BadInput, match="n_head"):
        GPTConfig(n_embd=100, n_head=3)


def test_from_model_config():
    cfg = GPTConfig.from_model_config(ModelConfig(attention="math", block_size=128), n_vocab=50257)
    assert (cfg.n_layer, cfg.block_size, cfg.vocab_size, cfg.n_vocab, cfg.attention) == (4, 128, 50304, 50257, "math")
    with pytest.raises(BadInput, match="vocab_size"):
        GPTConfig.from_model_config(ModelConfig(vocab_size=1000), n_vocab=50257)


# ---------------------------------------------------------------------------------------------
# Parity with transformers' GPT-2


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_from_hf_matches_hf_logits(attention):
    hf = hf_model()
    ours = from_hf(hf, attention=attention).eval()
    assert ours.config.vocab_size == 128 and ours.config.n_vocab == 100
    assert torch.all(ours.transformer.wte.weight[100:] == 0)  # import pads with zero rows
    idx = torch.randint(0, 100, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(idx).logits
        got, _ = ours(idx)
    assert got.shape == (3, 32, 128)
    torch.testing.assert_close(got[..., :100], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["math", "sdpa"])
@pytest.mark.parametrize("bias", [True, False])
def test_to_hf_matches_our_logits(attention, bias):
    torch.manual_seed(0)
    ours = GPT(small(n_vocab=1000, attention=attention, bias=bias)).eval()
    randomize(ours)
    hf = to_hf(ours)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    idx = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, _ = ours(idx)
        got = hf(idx).logits
    assert got.shape == (2, 32, 1000)
    torch.testing.assert_close(got, want[..., :1000], atol=1e-5, rtol=1e-5)


def test_hf_state_dict_layout():
    ours = GPT(small(bias=False))
    sd = hf_state_dict(ours)
    # Conv1D weights are (in, out): the transpose of nn.Linear's (out, in).
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)
    torch.testing.assert_close(
        sd["transformer.h.1.mlp.c_proj.weight"], ours.transformer.h[1].mlp.c_proj.weight.t(), rtol=0, atol=0
    )
    assert sd["transformer.wte.weight"].shape == (100, 64)  # padding trimmed
    assert torch.all(sd["transformer.h.0.ln_1.bias"] == 0)  # bias=False exports zero biases
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]


def test_math_and_sdpa_agree():
    torch.manual_seed(0)
    a = GPT(small(attention="math")).eval()
    randomize(a)
    b = GPT(small(attention="sdpa")).eval()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 100, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(a(idx)[0], b(idx)[0], atol=1e-5, rtol=1e-5)


def test_attention_is_causal():
    torch.manual_seed(0)
    for attention in ("math", "sdpa"):
        m = GPT(small(attention=attention)).eval()
        idx = torch.randint(0, 100, (1, 20))
        changed = idx.clone()
        changed[0, 10:] = (changed[0, 10:] + 1) % 100
        with torch.no_grad():
            a, b = m(idx)[0], m(changed)[0]
        torch.testing.assert_close(a[:, :10], b[:, :10], atol=0, rtol=0)
        assert not torch.allclose(a[:, 10:], b[:, 10:])


# ---------------------------------------------------------------------------------------------
# Logits and loss over the real vocabulary


def test_loss_is_cross_entropy_over_real_vocab():
    torch.manual_seed(0)
    m = GPT(small(n_vocab=100))
    randomize(m)
    idx = torch.randint(0, 100, (4, 32))
    targets = torch.randint(0, 100, (4, 32))
    targets[0, :5] = -100
    targets[3, 20:] = -100
    logits, loss = m(idx, targets)
    assert logits.shape == (4, 32, 128)
    assert torch.all(logits[..., 100:] == float("-inf"))
    assert torch.isfinite(logits[..., :100]).all()
    want = F.cross_entropy(logits[..., :100].detach().double().reshape(-1, 100), targets.reshape(-1), ignore_index=-100)
    assert abs(loss.item() - want.item()) < 1e-5
    # ignore_index is honoured: counting the ignored positions as class 0 changes the value
    wrong = F.cross_entropy(logits[..., :100].detach().double().reshape(-1, 100), targets.clamp(min=0).reshape(-1))
    assert abs(loss.item() - wrong.item()) > 1e-3

    loss.backward()
    grad = m.transformer.wte.weight.grad
    assert torch.all(grad[100:] == 0)  # the padded rows never train
    assert grad[:100].abs().sum() > 0


def test_last_only_and_too_long():
    torch.manual_seed(0)
    m = GPT(small()).eval()
    idx = torch.randint(0, 100, (2, 10))
    with torch.no_grad():
        full, _ = m(idx)
        last, loss = m(idx, last_only=True)
    assert last.shape == (2, 1, 128) and loss is None
    torch.testing.assert_close(last[:, 0], full[:, -1], atol=1e-6, rtol=1e-6)
    with pytest.raises(BadInput, match="sequence of 33 tokens is longer than model.block_size=32"):
        m(torch.zeros(1, 33, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Init, tying, sizes, optimizer


def test_init_statistics():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=8, n_head=8, n_embd=512, block_size=16, vocab_size=128, n_vocab=100)
    m = GPT(cfg)
    h = m.transformer.h[3]
    resid = 0.02 / math.sqrt(2 * 8)
    for w in (h.mlp.c_proj.weight, h.attn.c_proj.weight):
        assert abs(w.std().item() - resid) / resid < 0.02
    for w in (h.mlp.c_fc.weight, h.attn.c_attn.weight):
        assert abs(w.std().item() - 0.02) / 0.02 < 0.02
    assert abs(m.transformer.wpe.weight.std().item() - 0.02) < 0.002
    assert torch.all(h.attn.c_attn.bias == 0) and torch.all(h.mlp.c_proj.bias == 0)
    assert torch.all(h.ln_1.weight == 1) and torch.all(h.ln_1.bias == 0)
    assert h.ln_1.eps == 1e-5


def test_weight_tying_and_param_counts():
    cfg = small()
    m = GPT(cfg)
    assert m.lm_head.weight is m.transformer.wte.weight
    assert m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr()
    total = sum(p.numel() for p in m.parameters())
    C, L = 64, 2
    per_layer = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    assert total == 128 * C + 32 * C + L * per_layer + 2 * C
    assert m.num_params(non_embedding=False) == total
    assert m.num_params() == total - 32 * C  # position embeddings only, as nanoGPT
    assert m.flops_per_token(32) == 6 * m.num_params() + 12 * L * 2 * 32 * 32


def test_optimizer_groups():
    m = GPT(small(bias=True))
    opt = adamw(m.parameters(), weight_decay=0.1, lr=1e-3, betas=(0.9, 0.95), device_type="cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == m.num_params(non_embedding=False)
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(m.transformer.ln_f.bias) in ids and len(ids) == len(list(m.parameters()))
    # The fused kernel wherever this torch has it for the device: the CPU too since torch 2.4.
    from gptforge.training.optim import fused_adamw_supported

    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["fused"] is fused_adamw_supported("cpu") is True
    assert fused_adamw_supported("cuda") is torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# Weights I/O


def test_save_load_round_trip_bit_exact(tmp_path):
    torch.manual_seed(0)
    m = GPT(small(attention="math", bias=False))
    randomize(m)
    save_model(m, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["format"] == "gptforge-gpt2" and cfg["version"] == 1 and cfg["attention"] == "math"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: saved once
    back = load_model(tmp_path / "ckpt")
    assert back.config == m.config
    assert back.lm_head.weight is back.transformer.wte.weight
    a, b = m.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    idx = torch.randint(0, 100, (1, 16))
    with torch.no_grad():
        assert torch.equal(m.eval()(idx)[0], back.eval()(idx)[0])


@pytest.fixture
def saved(tmp_path):
    folder = tmp_path / "ckpt"
    save_model(GPT(small()), folder)
    return folder


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_load_truncated_file(saved):
    path = saved / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(BadInput) as e:
        load_model(saved)
    assert str(path) in one_line(e)


def test_load_garbage_file(saved):
    path = saved / "model.safetensors"
    path.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(BadInput) as e:
        load_model(saved)
    assert str(path) in one_line(e)


def test_load_missing_config_and_folder(saved, tmp_path):
    (saved / "config.json").unlink()
    with pytest.raises(BadInput) as e:
        load_model(saved)
    assert str(saved / "config.json") in one_line(e)
    with pytest.raises(BadInput, match="not found"):
        load_model(tmp_path / "nowhere")
    (saved / "config.json").write_text("{not json")
    with pytest.raises(BadInput, match="config.json"):
        load_model(saved)


def test_load_wrong_shapes_and_names(saved, tmp_path):
    # A checkpoint of another size under this folder's config: shapes differ.
    other = tmp_path / "other"
    save_model(GPT(small(n_embd=32, n_head=2)), other)
    (saved / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(BadInput) as e:
        load_model(saved)
    msg = one_line(e)
    assert str(saved / "model.safetensors") in msg and "shape" in msg
    # Wrong tensor names
    from safetensors.torch import save_file

    save_file({"not.a.weight": torch.zeros(2)}, str(saved / "model.safetensors"))
    with pytest.raises(BadInput) as e:
        load_model(saved)
    msg = one_line(e)
    assert str(saved / "model.safetensors") in msg and "missing tensors" in msg and "not.a.weight" in msg


def test_save_is_atomic_on_failure(saved, monkeypatch):
    before = (saved / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("gptforge.modeling.weights.write_json", boom)
    with pytest.raises(OSError):
        save_model(GPT(small()), saved)
    # the weights were replaced as a whole or not at all, and no temporary file is left
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors"]
    assert (saved / "model.safetensors").read_bytes() != before  # new weights, complete
    load_config_ok = json.loads((saved / "config.json").read_text())
    assert load_config_ok["format"] == "gptforge-gpt2"


# ---------------------------------------------------------------------------------------------
# Pretrained weights


def test_from_pretrained_offline_is_source_unreachable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceUnreachable) as e:
        from_pretrained("gpt2-xl")
    msg = one_line(e)
    assert msg.endswith("; set pretrain.init_from to a checkpoint folder")
    with pytest.raises(BadInput, match="gpt2-small"):
        from_pretrained("gpt2-small")


def test_model_module_imports_no_transformers():
    """The model, decoding and weights I/O run on a bare GPU machine: transformers only inside
    the conversion functions."""
    import subprocess
    import sys

    code = (
        "import sys, gptforge.modeling.gpt, gptforge.modeling.decoding, gptforge.modeling.weights, "
        "gptforge.modeling.hf_convert, gptforge.modeling.export; "
        "bad = [m for m in ('transformers', 'pydantic', 'yaml', 'mlflow', 'prefect') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
