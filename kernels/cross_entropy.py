"""Fused cross-entropy over the LM head's logits: loss and gradient from one kernel launch.

`F.cross_entropy(logits, targets)` on (N, V) bf16 logits upcasts them to a float32 (N, V) copy,
writes a float32 log-softmax of the same size, and in the backward another (N, V) gradient: at
GPT-2's V = 50304 and N = 16k tokens that is 3 GB per float32 copy. Here one program per row:

pass 1  walks the row in chunks of BLOCK_V, converting each chunk to fp32 in registers only,
        and keeps a running maximum m and sum-exp d (online softmax: when the maximum grows, the
        sum so far is rescaled by exp(m_old - m_new)); loss = m + log d - logit[target].
pass 2  walks the row again and writes the gradient of the *mean* loss,
        (softmax - onehot(target)) / n_valid, in the logits' dtype.

The backward is then a multiplication of the saved gradient by the incoming scalar. Rows whose
target is `ignore_index` get loss 0 and gradient 0; the mean is over the other rows (NaN when
there are none, as in F.cross_entropy). -inf logits (the model's padded vocabulary columns) get
probability 0 and gradient 0. Targets must lie in [0, V): they are not range-checked on the
device, where checking would cost a synchronisation.

`cross_entropy_reference` in kernels/reference.py is the same math in plain PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _runtime


@triton.jit
def _ce_kernel(
    LOGITS,
    stride_row,
    TARGETS,
    LOSS,
    GRAD,
    stride_grad_row,
    N_VALID,
    V,
    ignore_index,
    BLOCK_V: tl.constexpr,
    WITH_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: N * V passes 2^31 at GPT-2 sizes
    LOGITS += row * stride_row
    GRAD += row * stride_grad_row
    target = tl.load(TARGETS + row)
    offs = tl.arange(0, BLOCK_V)
    if target != ignore_index:
        m = float("-inf")  # running max (fp32)
        d = 0.0  # running sum of exp(x - m)
        for start in range(0, V, BLOCK_V):
            x = tl.load(LOGITS + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            # While every logit seen is -inf, shift by 0 instead: exp(-inf - -inf) would be NaN.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
            m = m_new
        lse = m + tl.log(d)
        tl.store(LOSS + row, lse - tl.load(LOGITS + target).to(tl.float32))
        if WITH_GRAD:
            # The mean's 1/n_valid is folded in here; n_valid is read from device memory so the
            # host never waits for the count. max(., 1): with no valid rows nothing is scaled.
            inv_n = 1.0 / tl.maximum(tl.load(N_VALID).to(tl.float32), 1.0)
            for start in range(0, V, BLOCK_V):
                cols = start + offs
                x = tl.load(LOGITS + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                g = tl.exp(x - lse)
                g = tl.where(cols == target, g - 1.0, g) * inv_n
                tl.store(GRAD + cols, g.to(GRAD.dtype.element_ty), mask=cols < V)
    else:
        tl.store(LOSS + row, 0.0)
        if WITH_GRAD:
            for start in range(0, V, BLOCK_V):
                cols = start + offs
                tl.store(GRAD + cols, tl.zeros([BLOCK_V], GRAD.dtype.element_ty), mask=cols < V)


def cross_entropy_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    *,
    with_grad: bool = True,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean loss as a float32 scalar, d loss / d logits in the logits' dtype or None)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"fused_cross_entropy needs logits (N, V) and targets (N,); got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if not logits.is_floating_point() or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"fused_cross_entropy needs float logits and integer targets; got {logits.dtype}, {targets.dtype}"
        )
    _runtime.check_runnable(_ce_kernel, "fused_cross_entropy", logits, targets)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    N, V = logits.shape
    # 8192 fp32 values per chunk: large enough that a 50k vocabulary is 7 chunks, small enough to
    # stay in registers with 8 warps. The interpreter's cost is per operation: take whole rows.
    interpreted = _runtime.is_interpreted(_ce_kernel)
    block_v = block_v or min(triton.next_power_of_2(V), 65536 if interpreted else 8192)
    n_valid = (targets != ignore_index).sum()
    losses = _runtime.empty((N,), dtype=torch.float32, device=logits.device)
    grad = _runtime.empty((N, V), dtype=logits.dtype, device=logits.device) if with_grad else None
    _ce_kernel[(N,)](
        logits,
        logits.stride(0),
        targets,
        losses,
        grad if with_grad else logits,
        grad.stride(0) if with_grad else 0,
        n_valid,
        V,
        ignore_index,
        BLOCK_V=block_v,
        WITH_GRAD=with_grad,
        num_warps=8,
    )
    return losses.sum() / n_valid, grad


class FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        loss, grad = cross_entropy_forward(logits, targets, ignore_index, with_grad=ctx.needs_input_grad[0])
        ctx.save_for_backward(grad)
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.used:  # the saved gradient is scaled in place below: a second use would be wrong
            raise RuntimeError("fused_cross_entropy's backward ran twice (retain_graph); run the forward again")
        ctx.used = True
        (grad,) = ctx.saved_tensors
        # In place: one more (N, V) buffer is what this kernel exists to avoid.
        return grad.mul_(grad_output), None, None


def fused_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of (N, V) logits against (N,) targets, ignoring `ignore_index` rows;
    a float32 scalar, differentiable in `logits`. The gradient is computed in the forward (in the
    logits' dtype, no float32 copy of the logits) and kept until the backward."""
    return FusedCrossEntropy.apply(logits, targets, ignore_index)
