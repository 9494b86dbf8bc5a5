"""FlashAttention-2 in Triton: forward and backward, causal or not, on (B, H, T, D) tensors.

Attention is softmax(Q K^T * scale) V. Materialising the T x T score matrix costs O(T^2) memory
and, worse, O(T^2) reads and writes of slow GPU memory. FlashAttention (Dao et al. 2022, and
FlashAttention-2, Dao 2023) never stores it:

forward   one program per block of BLOCK_M queries walks the keys/values in blocks of BLOCK_N,
          keeping a running row maximum m, a running softmax denominator l and an unnormalised
          output accumulator (the "online softmax"): when a new block raises the maximum, what
          was accumulated so far is rescaled by exp(m_old - m_new). At the end O = acc / l, and
          the row's log-sum-exp LSE = m + log(l) is saved: it is all the backward needs to
          recompute any probability as P_ij = exp(S_ij - LSE_i) without another softmax pass.
backward  with dO given, D_i = rowsum(dO_i * O_i) (= sum_j P_ij dP_ij) is computed first; then
          program j accumulates dK and dV of key block j over the query blocks, and dQ of query
          block j over the key blocks, recomputing each tile of P from Q, K and LSE. Computing dQ
          in its own loop costs one extra recomputation of P but needs no atomic adds, so the
          result is deterministic.

Exponentials are taken base 2 (`exp2`, one instruction on the GPU): the scores are multiplied by
scale * log2(e) once, so exp2(s * log2 e) = exp(s). The saved LSE is in natural-log units.

Matrix products run on the inputs' dtype (fp16/bf16 tensor cores; fp32 as TF32 when PyTorch
allows TF32 matmuls, exact otherwise) and accumulate in fp32; softmax statistics are fp32.
Sequence lengths need not be multiples of the block sizes: loads past T read zeros and scores
past T are -inf, so the tails are masked. Head dims are powers of two from 16 to 128.

`flash_attention(q, k, v, causal=True, sm_scale=None)` is the autograd entry point;
`attention_reference` in kernels/reference.py is the same math in plain PyTorch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import _runtime

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b with fp32 accumulation. UPCAST is set only under the interpreter for bf16,
    whose NumPy emulation multiplies bf16's raw bit patterns (stored as uint16) instead of the
    numbers; on the GPU the operands stay in their dtype for the tensor cores."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _head_offset(H, stride_b, stride_h):
    """Element offset of this program's (batch, head) slice; programs are laid out (block, B*H).
    int64: B*H*T*D passes 2^31 elements at long contexts."""
    bh = tl.program_id(1)
    return (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    sq_b,
    sq_h,
    sq_t,
    sk_b,
    sk_h,
    sk_t,
    sv_b,
    sv_h,
    sv_t,
    so_b,
    so_h,
    so_t,
    H,
    T,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    Q += _head_offset(H, sq_b, sq_h)
    K += _head_offset(H, sk_b, sk_h)
    V += _head_offset(H, sv_b, sv_h)
    O += _head_offset(H, so_b, so_h)
    LSE += _head_offset(H, H * T, T)  # LSE and DELTA are contiguous (B, H, T)

    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_in = rows < T
    q = tl.load(Q + rows[:, None] * sq_t + dims[None, :], mask=row_in[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Causal: keys after this block's last query contribute nothing, so stop there (about half
    # the work). Block 0 is always visited and key 0 is visible to every query, so m_i is finite
    # after the first block and the rescale factor exp2(m_i - m_new) is never exp2(-inf + inf).
    hi = tl.minimum(T, start_m + BLOCK_M) if CAUSAL else T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_in = cols < T
        k_t = tl.load(K + cols[None, :] * sk_t + dims[:, None], mask=col_in[None, :], other=0.0)  # (D, N)
        s = _dot(q, k_t, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, PRECISION) * qk_scale
        visible = col_in[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + cols[:, None] * sv_t + dims[None, :], mask=col_in[:, None], other=0.0)
        # P is rounded to V's dtype for the tensor-core product, as in FlashAttention itself.
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(O + rows[:, None] * so_t + dims[None, :], out.to(O.dtype.element_ty), mask=row_in[:, None])
    tl.store(LSE + rows, (m_i + tl.math.log2(l_i)) / 1.4426950408889634, mask=row_in)  # natural log


@triton.jit
def _bwd_delta_kernel(
    O, DO, DELTA, so_b, so_h, so_t, sd_b, sd_h, sd_t, H, T, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr
):
    """DELTA_i = sum_d O_id dO_id, which equals sum_j P_ij dP_ij: the term the softmax backward
    subtracts, dS = P * (dP - DELTA). Computed once here rather than in every key-block program."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_in = rows < T
    O += _head_offset(H, so_b, so_h)
    DO += _head_offset(H, sd_b, sd_h)
    o = tl.load(O + rows[:, None] * so_t + dims[None, :], mask=row_in[:, None], other=0.0)
    do = tl.load(DO + rows[:, None] * sd_t + dims[None, :], mask=row_in[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + _head_offset(H, H * T, T) + rows, delta, mask=row_in)


@triton.jit
def _bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    sq_t,
    sk_t,
    sv_t,
    sd_t,
    sdk_t,
    T,
    start_n,
    sm_scale,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """BLOCK_N keys from start_n: dV = P^T dO and dK = scale * dS^T Q, summed over query tiles of
    BLOCK_M. Works on transposed tiles (keys as rows) so that no accumulator needs transposing."""
    cols = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    col_in = cols < T
    k = tl.load(K + cols[:, None] * sk_t + dims[None, :], mask=col_in[:, None], other=0.0)
    v = tl.load(V + cols[:, None] * sv_t + dims[None, :], mask=col_in[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # Causal: queries before start_n cannot see these keys; start at the tile holding query start_n.
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, T, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_in = rows < T
        q_t = tl.load(Q + rows[None, :] * sq_t + dims[:, None], mask=row_in[None, :], other=0.0)  # (D, M)
        lse = tl.load(LSE + rows, mask=row_in, other=0.0)
        s_t = _dot(k, q_t, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST, PRECISION) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :] * 1.4426950408889634)  # P^T, recomputed from the LSE
        visible = row_in[None, :]
        if CAUSAL:
            visible = visible & (cols[:, None] <= rows[None, :])
        p_t = tl.where(visible, p_t, 0.0)
        do = tl.load(DO + rows[:, None] * sd_t + dims[None, :], mask=row_in[:, None], other=0.0)
        dv = _dot(p_t.to(do.dtype), do, dv, UPCAST, PRECISION)
        delta = tl.load(DELTA + rows, mask=row_in, other=0.0)
        dp_t = _dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])  # softmax backward, transposed
        dk = _dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk, UPCAST, PRECISION)
    dk *= sm_scale  # S = scale * Q K^T, so dK picks up the scale once, here
    tl.store(DK + cols[:, None] * sdk_t + dims[None, :], dk.to(DK.dtype.element_ty), mask=col_in[:, None])
    tl.store(DV + cols[:, None] * sdk_t + dims[None, :], dv.to(DV.dtype.element_ty), mask=col_in[:, None])


@triton.jit
def _bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    sq_t,
    sk_t,
    sv_t,
    sd_t,
    sdq_t,
    T,
    start_m,
    sm_scale,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """BLOCK_M queries from start_m: dQ = scale * dS K, summed over the key tiles of BLOCK_N they see."""
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_in = rows < T
    q = tl.load(Q + rows[:, None] * sq_t + dims[None, :], mask=row_in[:, None], other=0.0)
    do = tl.load(DO + rows[:, None] * sd_t + dims[None, :], mask=row_in[:, None], other=0.0)
    lse2 = tl.load(LSE + rows, mask=row_in, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + rows, mask=row_in, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = tl.minimum(T, start_m + BLOCK_M) if CAUSAL else T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_in = cols < T
        k_t = tl.load(K + cols[None, :] * sk_t + dims[:, None], mask=col_in[None, :], other=0.0)  # (D, N)
        v_t = tl.load(V + cols[None, :] * sv_t + dims[:, None], mask=col_in[None, :], other=0.0)
        s = _dot(q, k_t, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, PRECISION) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        visible = col_in[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        p = tl.where(visible, p, 0.0)
        dp = _dot(do, v_t, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k_t.dtype), tl.trans(k_t), dq, UPCAST, PRECISION)
    dq *= sm_scale
    tl.store(DQ + rows[:, None] * sdq_t + dims[None, :], dq.to(DQ.dtype.element_ty), mask=row_in[:, None])


@triton.jit
def _bwd_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    DK,
    DV,
    sq_b,
    sq_h,
    sq_t,
    sk_b,
    sk_h,
    sk_t,
    sv_b,
    sv_h,
    sv_t,
    sd_b,
    sd_h,
    sd_t,
    sg_b,
    sg_h,
    sg_t,
    H,
    T,
    sm_scale,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_OWN: tl.constexpr,
    BLOCK_ITER: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program j owns positions [j*BLOCK_OWN, (j+1)*BLOCK_OWN): as keys it writes their dK and
    dV, as queries their dQ (as the Triton tutorial does: one launch, no atomics). dQ, dK and dV
    are allocated alike (strides sg_*)."""
    start = tl.program_id(0) * BLOCK_OWN
    Q += _head_offset(H, sq_b, sq_h)
    K += _head_offset(H, sk_b, sk_h)
    V += _head_offset(H, sv_b, sv_h)
    DO += _head_offset(H, sd_b, sd_h)
    LSE += _head_offset(H, H * T, T)
    DELTA += _head_offset(H, H * T, T)
    grads = _head_offset(H, sg_b, sg_h)
    _bwd_dkdv(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DK + grads,
        DV + grads,
        sq_t,
        sk_t,
        sv_t,
        sd_t,
        sg_t,
        T,
        start,
        sm_scale,
        qk_scale,
        HEAD_DIM,
        BLOCK_OWN,
        BLOCK_ITER,
        CAUSAL,
        UPCAST,
        PRECISION,
    )
    _bwd_dq(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ + grads,
        sq_t,
        sk_t,
        sv_t,
        sd_t,
        sg_t,
        T,
        start,
        sm_scale,
        qk_scale,
        HEAD_DIM,
        BLOCK_OWN,
        BLOCK_ITER,
        CAUSAL,
        UPCAST,
        PRECISION,
    )


# ---------------------------------------------------------------------------------------------
# Launchers


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"flash_attention needs q, k, v of one shape (B, H, T, D); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise ValueError(
            f"flash_attention needs q, k, v of one dtype among fp32/fp16/bf16; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.size(-1) not in HEAD_DIMS:
        raise ValueError(f"flash_attention supports head dims {HEAD_DIMS}; got {q.size(-1)}")
    _runtime.check_runnable(_fwd_kernel, "flash_attention", q, k, v)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    # The kernels address the head dim with stride 1 (vectorised loads); (B, T, H, D) -> (B, H, T,
    # D) transposes such as the model's keep it, so this copies only unusual layouts.
    return t if t.stride(-1) == 1 else t.contiguous()


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands go through TF32 tensor cores only when PyTorch's own matmuls would.
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _blocks(head_dim: int, interpreted: bool) -> dict:
    """Tile sizes and warps. On the GPU: 128-query forward tiles (FlashAttention-2's choice, each
    K/V tile loaded once serves 128 queries), 64x64 backward tiles (the backward holds five tiles
    at once). In the interpreter the cost is per operation, not per element: big tiles are fast."""
    if interpreted:
        return dict(fwd=(64, 64), bwd=(64, 64), num_warps=4)
    return dict(fwd=(128, 64), bwd=(64, 64), num_warps=4 if head_dim <= 64 else 8)


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O (B, H, T, D) in q's dtype, LSE (B, H, T) fp32, natural log). Block sizes are for tests."""
    _check(q, k, v)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, H, T, D = q.shape
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    cfg = _blocks(D, _runtime.is_interpreted(_fwd_kernel))
    bm, bn = block_m or cfg["fwd"][0], block_n or cfg["fwd"][1]
    o = _runtime.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    lse = _runtime.empty((B, H, T), dtype=torch.float32, device=q.device)
    upcast = q.dtype == torch.bfloat16 and _runtime.is_interpreted(_fwd_kernel)
    _fwd_kernel[(triton.cdiv(T, bm), B * H)](
        q,
        k,
        v,
        o,
        lse,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *o.stride()[:3],
        H,
        T,
        sm_scale * LOG2E,
        HEAD_DIM=D,
        BLOCK_M=bm,
        BLOCK_N=bn,
        CAUSAL=bool(causal),
        UPCAST=upcast,
        PRECISION=_precision(q.dtype),
        num_warps=cfg["num_warps"],
        num_stages=3,
    )
    return o, lse


def flash_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in q's dtype from dO and the forward's O and LSE. For tests: block_m is the
    tile each program owns (its keys for dK/dV, its queries for dQ), block_n the tile it steps by."""
    _check(q, k, v)
    q, k, v, o, do = (_unit_last(t) for t in (q, k, v, o, do.to(q.dtype)))
    B, H, T, D = q.shape
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    interpreted = _runtime.is_interpreted(_bwd_kernel)
    cfg = _blocks(D, interpreted)
    own, step = block_m or cfg["bwd"][0], block_n or cfg["bwd"][1]
    delta = _runtime.empty((B, H, T), dtype=torch.float32, device=q.device)
    _bwd_delta_kernel[(triton.cdiv(T, own), B * H)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], H, T, HEAD_DIM=D, BLOCK_M=own
    )

    dq, dk, dv = (_runtime.empty((B, H, T, D), dtype=q.dtype, device=q.device) for _ in range(3))
    _bwd_kernel[(triton.cdiv(T, own), B * H)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        dk,
        dv,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *do.stride()[:3],
        *dq.stride()[:3],
        H,
        T,
        sm_scale,
        sm_scale * LOG2E,
        HEAD_DIM=D,
        BLOCK_OWN=own,
        BLOCK_ITER=step,
        CAUSAL=bool(causal),
        UPCAST=q.dtype == torch.bfloat16 and interpreted,
        PRECISION=_precision(q.dtype),
        num_warps=cfg["num_warps"],
    )
    return dq, dk, dv


# The autograd entry point is a torch.library custom op rather than an autograd.Function: under
# torch.compile Dynamo would trace into an autograd.Function and hand our Triton kernels to
# Inductor, which re-generates them; on an H100 with Triton 3.6 that re-generated forward failed
# to compile (docs/benchmarks/2026-11-26-nvidia-h100-80gb-hbm3.md). A compiled graph calls a
# custom op as it is, the kernels Triton compiled for eager mode included.
@torch.library.custom_op("gptforge::flash_attention_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention_forward(q, k, v, causal, sm_scale)


@_fwd_op.register_fake
def _(q, k, v, causal, sm_scale):
    B, H, T, D = q.shape
    return q.new_empty((B, H, T, D)), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("gptforge::flash_attention_bwd", mutates_args=())
def _bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attention_backward(do, q, k, v, o, lse, causal, sm_scale)


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, sm_scale):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, sm_scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)  # O(B·H·T·D) + O(B·H·T): no T x T matrix kept
    ctx.causal, ctx.sm_scale = causal, sm_scale


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _bwd_op(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale)
    return dq, dk, dv, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, sm_scale: float | None = None
) -> torch.Tensor:
    """softmax(q k^T * sm_scale [+ causal mask]) v for (B, H, T, D) tensors, differentiable.

    sm_scale defaults to 1/sqrt(D). q, k and v share shape and dtype (fp32, fp16 or bf16) and D is
    16, 32, 64 or 128. CUDA tensors, or CPU tensors when TRITON_INTERPRET=1 was set before this
    module was imported; anything else raises KernelUnavailable. Works inside torch.compile."""
    sm_scale = 1.0 / math.sqrt(q.size(-1)) if sm_scale is None else float(sm_scale)
    return _fwd_op(q, k, v, bool(causal), sm_scale)[0]
