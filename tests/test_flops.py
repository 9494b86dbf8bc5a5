"""MFU: the PaLM FLOP formula, the table of device peaks, overrides."""

from __future__ import annotations

import pytest
import torch

from gptforge.errors import BadInput
from gptforge.modeling import flops


def gpt2_small_non_embedding_params(n_layer=12, d=768) -> int:
    """Counted weight by weight from GPT-2's architecture (biases and LayerNorms included)."""
    ln = 2 * d
    attn = d * 3 * d + 3 * d + d * d + d  # c_attn, c_proj
    mlp = d * 4 * d + 4 * d + 4 * d * d + d  # c_fc, c_proj
    return n_layer * (ln + attn + ln + mlp) + ln  # + ln_f


def test_flops_per_token_gpt2_small():
    n = gpt2_small_non_embedding_params()
    assert n == 85_056_000
    # 6N = 510,336,000; attention 12 * 12 layers * 12 heads * 64 * 1024 = 113,246,208.
    assert flops.flops_per_token(n, 12, 12, 64, 1024) == 623_582_208
    # nanoGPT's N: every parameter but wpe (the tied wte is the lm_head): 124,439,808 - 786,432.
    assert flops.flops_per_token(124_439_808 - 1024 * 768, 12, 12, 64, 1024) == 6 * 123_653_376 + 113_246_208


def test_mfu_arithmetic():
    assert flops.mfu(1000.0, 6e9, 1e13) == pytest.approx(0.6)
    assert flops.mfu(1000.0, 6e9, None) is None
    assert flops.mfu(0.0, 6e9, 1e13) == 0.0


@pytest.mark.parametrize(
    "name, precision, tf32, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989e12),
        ("NVIDIA H100 80GB HBM3", "fp16", False, 989e12),
        ("NVIDIA H100 80GB HBM3", "fp32", True, 494.7e12),
        ("NVIDIA H100 80GB HBM3", "fp32", False, 66.9e12),
        ("NVIDIA H100 PCIe", "bf16", False, 756e12),
        ("NVIDIA H100 NVL", "bf16", False, 835.5e12),
        ("NVIDIA H200", "bf16", False, 989.5e12),
        ("NVIDIA GH200 480GB", "bf16", False, 989.5e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", False, 312e12),
        ("NVIDIA A100-SXM4-40GB", "fp32", True, 156e12),
        ("NVIDIA A100 80GB PCIe", "fp32", False, 19.5e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", False, 156e12),
        ("NVIDIA A10G", "bf16", False, 70e12),
        ("NVIDIA A10", "bf16", False, 125e12),
        ("NVIDIA L4", "bf16", False, 121e12),
        ("NVIDIA L40S", "bf16", False, 366e12),
        ("NVIDIA GeForce RTX 4090", "bf16", False, 165.2e12),
        ("Tesla V100-SXM2-16GB", "fp16", False, 125e12),
        ("Tesla V100-PCIE-32GB", "fp16", False, 112e12),
        ("Tesla V100S-PCIE-32GB", "fp32", True, 16.4e12),  # no TF32 tensor cores: CUDA-core fp32
        ("Tesla T4", "fp16", False, 65e12),
        ("Tesla T4", "float32", False, 8.1e12),
    ],
)
def test_table_lookup(name, precision, tf32, expected):
    assert flops.lookup_peak(name, precision, tf32=tf32) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize(
    "name, precision",
    [
        ("Tesla V100-SXM2-16GB", "bf16"),  # no bf16 tensor cores
        ("Tesla T4", "bf16"),
        ("NVIDIA RTX A1000 Laptop GPU", "bf16"),  # not an A100
        ("NVIDIA L40", "bf16"),  # not an L4
        ("AMD Instinct MI300X", "bf16"),
    ],
)
def test_table_has_no_peak(name, precision):
    assert flops.lookup_peak(name, precision) is None


def test_table_entries_are_ordered_sensibly():
    for key, entry in flops.PEAK_FLOPS.items():
        assert entry["fp32"] > 1e12, key
        if "tf32" in entry:
            assert entry["half"] >= entry["tf32"] >= entry["fp32"] * 0.99, key
        assert set(entry) <= {"half", "fp16", "tf32", "fp32"}, key


def test_override_wins_and_is_checked():
    assert flops.peak_flops("cpu", "fp32", 1.5e12) == 1.5e12
    assert flops.peak_flops(torch.device("cuda"), "bf16", 2e14) == 2e14
    with pytest.raises(BadInput, match="pretrain.peak_flops"):
        flops.peak_flops("cpu", "fp32", 0.0)
    with pytest.raises(BadInput, match="pretrain.peak_flops"):
        flops.peak_flops("cpu", "fp32", -1.0)


def test_cpu_is_unknown():
    assert flops.peak_flops("cpu", "fp32", None) is None
    assert flops.peak_flops(torch.device("cpu"), "bf16", None) is None


def test_unknown_precision():
    with pytest.raises(BadInput, match="precision"):
        flops.peak_flops("cpu", "int8", None)


def test_cuda_lookup_by_device_name(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(flops, "_tf32_enabled", lambda: True)
    assert flops.peak_flops("cuda", "bf16", None) == pytest.approx(989e12, rel=1e-3)
    assert flops.peak_flops("cuda:0", "fp32", None) == pytest.approx(494.7e12, rel=1e-3)
    monkeypatch.setattr(flops, "_tf32_enabled", lambda: False)
    assert flops.peak_flops("cuda", "fp32", None) == pytest.approx(66.9e12, rel=1e-3)

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU 9000")
    with caplog.at_level("WARNING", logger="gptforge.modeling.flops"):
        assert flops.peak_flops("cuda", "bf16", None) is None
    assert "Mystery GPU 9000" in caplog.text and "pretrain.peak_flops" in caplog.text


def test_tf32_follows_the_matmul_precision():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert flops._tf32_enabled() == bool(torch.backends.cuda.matmul.allow_tf32)
        torch.set_float32_matmul_precision("high")
        assert flops._tf32_enabled()
    finally:
        torch.set_float32_matmul_precision(before)
