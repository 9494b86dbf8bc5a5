"""`modeling.cpu_gemv`: the context that sends one- and two-row bf16 products on the CPU to
ATen's matrix-vector kernels computes the same products (against float64), restores the flag
it changes, even on an exception, and leaves float32, many rows and other devices alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptforge.modeling.cpu_gemv import GEMV_ROWS, gemv_kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2])
def test_few_rows_match_float64(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1000, 576, generator=g).to(dtype)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    exact = x.double() @ w.double().t()
    with gemv_kernels(rows, dtype, "cpu"):
        assert not torch.backends.mkldnn.enabled
        fast = F.linear(x, w)
    assert fast.dtype == dtype
    # float32 accumulation, then one rounding to the output dtype: within its half-ulp of the exact sum
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert torch.allclose(fast.double(), exact, rtol=ulp, atol=1e-3 * exact.abs().max().item())
    assert torch.backends.mkldnn.enabled


def test_flag_restored_after_an_exception_and_nested():
    before = torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError):
        with gemv_kernels(1, torch.bfloat16, "cpu"):
            with gemv_kernels(1, torch.bfloat16, "cpu"):
                pass
            assert not torch.backends.mkldnn.enabled  # the inner one restored what it found
            raise RuntimeError("boom")
    assert torch.backends.mkldnn.enabled == before


@pytest.mark.parametrize(
    "rows,dtype,device",
    [(1, torch.float32, "cpu"), (GEMV_ROWS + 1, torch.bfloat16, "cpu"), (1, torch.bfloat16, "meta")],
)
def test_elsewhere_nothing_changes(rows, dtype, device):
    with gemv_kernels(rows, dtype, device):
        assert torch.backends.mkldnn.enabled
