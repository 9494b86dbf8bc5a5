"""Triton kernels, each with a PyTorch autograd wrapper and its reference math.

- `kernels.flash_attention.flash_attention(q, k, v, causal=True, sm_scale=None)`: FlashAttention-2
  forward and backward on (B, H, T, D) tensors; `model.attention: triton` selects it.
- `kernels.cross_entropy.fused_cross_entropy(logits, targets, ignore_index=-100)`: mean
  cross-entropy whose gradient is computed in the same launch, without a float32 copy of the logits.
- `kernels.reference`: the same math in plain PyTorch, for the tests.

They run on CUDA tensors, or on the CPU through Triton's interpreter when `TRITON_INTERPRET=1` is
in the environment before triton is first imported (slow: for tests). Anything else raises
`kernels._runtime.KernelUnavailable`. Importing this package imports nothing heavy; the kernel
modules import triton.
"""
