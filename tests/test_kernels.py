"""The Triton kernels against their plain-PyTorch references: on CUDA when there is a GPU, else
on the CPU through Triton's interpreter.

`TRITON_INTERPRET=1` must be in the environment before `triton` is first imported (its own
standard library, `tl.zeros` and friends, is decorated at that import), so without a GPU this
module sets it at import, during collection. It stays set for the rest of the pytest process,
which is harmless on a machine where Triton can only run interpreted anyway. If something imported
triton earlier (a plugin, `-p triton`), the in-process kernel tests skip and `test_in_a_fresh_process`,
defined only then, runs them in a subprocess with the variable set, where every one must pass.

Accuracy: each result is compared with the reference computed in float64 from the same (rounded)
inputs, as a relative error ||x - ref|| / ||ref||, bounded in units of the dtype's machine epsilon
(TOL below). The bounds were fitted by measuring 3 seeds x {causal, not} x {T=37 D=32, T=65 D=64,
T=20 D=128} x every dtype in the interpreter: the worst kernel errors were fp32 5.0 eps (dQ), fp16
0.40 eps, bf16 0.92 eps; plain PyTorch running the same math in that dtype reaches 3.1 / 0.61 / 0.64
eps. The bounds are 2-3x the worst measured: 16 eps for fp32 (whose error grows with T and D through
the fp32 accumulations), 2 eps for fp16 and bf16 (bf16 is worse than PyTorch in the interpreter,
which rounds fp32 -> bf16 toward zero where the GPU rounds to nearest). Softmax statistics (LSE) and
the cross-entropy loss are fp32 whatever the input: 16 fp32 eps.

Every kernel output is allocated through kernels._runtime.empty, which these tests replace by a
NaN-filled allocation, so an element a kernel does not write fails the comparison.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything below imports triton

import pytest  # noqa: E402

from gptforge.errors import BadInput  # noqa: E402
from gptforge.modeling.decoding import generate  # noqa: E402
from gptforge.modeling.gpt import GPT, GPTConfig, KVCache  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
EPS32 = torch.finfo(torch.float32).eps
TOL = {
    torch.float32: 16 * EPS32,
    torch.float16: 2 * torch.finfo(torch.float16).eps,
    torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps,
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _kernels_usable() -> bool:
    from kernels import _runtime, flash_attention

    return ON_GPU or _runtime.is_interpreted(flash_attention._fwd_kernel)


KERNELS_HERE = _kernels_usable()  # at collection, so that the fresh-process test exists only when needed


@pytest.fixture(scope="module")
def kern():
    if not KERNELS_HERE:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; test_in_a_fresh_process runs these")
    from kernels import cross_entropy, flash_attention, reference

    return type("Kernels", (), dict(fa=flash_attention, ce=cross_entropy, ref=reference))


if not KERNELS_HERE:

    def test_in_a_fresh_process(request):
        """The kernel tests this session selected (skipped here) run in a fresh process: all pass, none skip."""
        ids = [
            item.nodeid for item in request.session.items if item.path == request.path and "kern" in item.fixturenames
        ]
        assert ids, "no kernel test selected beside this one: nothing to run in a fresh process"
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids]
        # This whole file takes about 25 s in the interpreter on 2 idle cores, 3-10x that beside
        # other CPU-bound tests; the limit only turns a hang into a failure.
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=900)
        summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        outcomes = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary) if not word.startswith("warning")}
        assert r.returncode == 0 and outcomes == {"passed": len(ids)}, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    import kernels._runtime as rt

    def nan_empty(shape, *, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(rt, "empty", nan_empty)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert not torch.isnan(x).any(), f"{name}: NaN left in the output (an element never written)"
    err = rel_err(x, ref)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


# ---------------------------------------------------------------------------------------------
# FlashAttention


def check_attention(kern, dtype, causal, T, D, block_m=None, block_n=None, B=1, H=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).to(DEVICE, dtype) for _ in range(4))
    o, lse = kern.fa.flash_attention_forward(q, k, v, causal, block_m=block_m, block_n=block_n)
    dq, dk, dv = kern.fa.flash_attention_backward(do, q, k, v, o, lse, causal, block_m=block_m, block_n=block_n)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = kern.ref.attention_reference(q64, k64, v64, causal)
    ref_o.backward(do.double())
    assert o.dtype == dq.dtype == dtype and lse.dtype == torch.float32
    tol = TOL[dtype]
    assert_close("O", o, ref_o, tol)
    assert_close("LSE", lse, ref_lse, 16 * EPS32)
    assert_close("dQ", dq, q64.grad, tol)
    assert_close("dK", dk, k64.grad, tol)
    assert_close("dV", dv, v64.grad, tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_each_dtype(kern, dtype, causal):
    # T = 37 with 16-query and 32-key tiles: three query blocks, two key blocks, ragged tails of
    # both, and (causal) tiles cut by the diagonal.
    check_attention(kern, dtype, causal, T=37, D=32, block_m=16, block_n=32)


@pytest.mark.parametrize(
    "D, dtype, causal",
    [(64, torch.float16, True), (128, torch.bfloat16, False)],
    ids=["d64-fp16-causal", "d128-bf16-full"],
)
def test_attention_other_head_dims(kern, D, dtype, causal):
    check_attention(kern, dtype, causal, T=21, D=D, block_m=16, block_n=16)


def test_attention_default_tiles_and_batch(kern):
    check_attention(kern, torch.float32, True, T=65, D=32, B=2, H=3)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_attention_full_matrix(kern, dtype, causal, D):
    check_attention(kern, dtype, causal, T=65, D=D, block_m=32, block_n=16, seed=D)


def test_attention_autograd_and_strided_inputs(kern):
    # The model's q, k, v are (B, T, H, D) slices of one qkv tensor, transposed: not contiguous.
    g = torch.Generator().manual_seed(1)
    B, T, H, D = 2, 19, 2, 32
    qkv = torch.randn(B, T, 3 * H * D, generator=g).to(DEVICE)
    do = torch.randn(B, H, T, D, generator=g).to(DEVICE).transpose(1, 2).contiguous().transpose(1, 2)  # strided too
    leaf = qkv.clone().requires_grad_()
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in leaf.split(H * D, dim=2))
    assert not q.is_contiguous()
    o = kern.fa.flash_attention(q, k, v, causal=True, sm_scale=0.3)
    o.backward(do)

    ref_leaf = qkv.double().requires_grad_()
    rq, rk, rv = (t.view(B, T, H, D).transpose(1, 2) for t in ref_leaf.split(H * D, dim=2))
    ref_o, _ = kern.ref.attention_reference(rq, rk, rv, causal=True, sm_scale=0.3)
    ref_o.backward(do.double())
    assert_close("O", o, ref_o, TOL[torch.float32])
    assert_close("d qkv", leaf.grad, ref_leaf.grad, TOL[torch.float32])


def test_attention_rejects_bad_inputs(kern):
    x = torch.randn(1, 2, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="head dims"):
        y = torch.randn(1, 2, 8, 48, device=DEVICE)
        kern.fa.flash_attention(y, y, y)
    with pytest.raises(ValueError, match="one dtype"):
        kern.fa.flash_attention(x, x.half(), x)
    with pytest.raises(ValueError, match="one shape"):
        kern.fa.flash_attention(x, x[:, :, :4], x)


@pytest.mark.slow
def test_without_the_interpreter_cpu_tensors_get_a_clear_error():
    code = """if True:
        import torch
        from kernels._runtime import KernelUnavailable
        from kernels.cross_entropy import fused_cross_entropy
        from kernels.flash_attention import flash_attention
        from gptforge.errors import BadInput
        from gptforge.modeling.gpt import GPT, GPTConfig
        x = torch.randn(1, 1, 8, 32)
        for call in (lambda: flash_attention(x, x, x),
                     lambda: fused_cross_entropy(torch.randn(4, 10), torch.zeros(4, dtype=torch.long))):
            try:
                call()
                raise SystemExit("no error")
            except KernelUnavailable as e:
                assert "TRITON_INTERPRET=1" in str(e), e
        model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=32, block_size=8, vocab_size=64, n_vocab=64,
                              attention="triton"))
        try:
            model(torch.zeros(1, 8, dtype=torch.long))
            raise SystemExit("no error")
        except BadInput as e:
            assert "CUDA" in str(e), e
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=Path(__file__).parents[1]
    )
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# Fused cross-entropy


def ce_inputs(dtype, N=37, V=1017, n_vocab=1000, seed=0):
    """Logits like the model's: a padded tail of -inf columns, some rows ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(N, V, generator=g)).to(DEVICE, dtype)
    logits[:, n_vocab:] = float("-inf")
    targets = torch.randint(0, n_vocab, (N,), generator=g).to(DEVICE)
    targets[::5] = -100
    return logits, targets


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_loss_and_gradient(kern, dtype):
    logits, targets = ce_inputs(dtype)
    x = logits.clone().requires_grad_()
    loss = kern.ce.fused_cross_entropy(x, targets)
    (2.5 * loss).backward()  # the backward scales the saved gradient by the incoming one

    x64 = logits.double().requires_grad_()
    ref = kern.ref.cross_entropy_reference(x64, targets)
    (2.5 * ref).backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert x.grad.dtype == dtype  # written in the logits' dtype: no float32 (N, V) buffer
    assert_close("loss", loss, ref, 16 * EPS32)
    assert_close("dlogits", x.grad, x64.grad, TOL[dtype])
    assert (x.grad[targets == -100] == 0).all() and (x.grad[:, 1000:] == 0).all()


def test_cross_entropy_chunks_and_row_stride(kern):
    # 256-wide chunks over V = 1017: four chunks, the last ragged. Rows taken from a wider tensor
    # (row stride != V) as a view, not copied.
    wide, targets = ce_inputs(torch.float32, V=1100, n_vocab=1017, seed=3)
    logits = wide[:, :1017]
    loss, grad = kern.ce.cross_entropy_forward(logits, targets, block_v=256)
    x64 = logits.double().requires_grad_()
    ref = kern.ref.cross_entropy_reference(x64, targets)
    ref.backward()
    assert_close("loss", loss, ref, 16 * EPS32)
    assert_close("dlogits", grad, x64.grad, TOL[torch.float32])


def test_cross_entropy_custom_ignore_index_and_all_ignored(kern):
    logits, targets = ce_inputs(torch.float32, N=9, V=50, n_vocab=50)
    targets = torch.where(targets == -100, 7, targets)
    targets[0] = 7
    loss, grad = kern.ce.cross_entropy_forward(logits, targets, ignore_index=7)
    x64 = logits.double().requires_grad_()
    ref = kern.ref.cross_entropy_reference(x64, targets, ignore_index=7)
    ref.backward()
    assert_close("loss", loss, ref, 16 * EPS32)
    assert_close("dlogits", grad, x64.grad, TOL[torch.float32])

    # No row counts: NaN loss, as F.cross_entropy, and an all-zero gradient.
    loss, grad = kern.ce.cross_entropy_forward(logits, torch.full((9,), -100, device=DEVICE))
    assert torch.isnan(loss) and torch.isnan(
        torch.nn.functional.cross_entropy(logits, torch.full((9,), -100, device=DEVICE))
    )
    assert (grad == 0).all()


def test_cross_entropy_without_grad_and_single_backward(kern):
    logits, targets = ce_inputs(torch.float16, N=8, V=100, n_vocab=100)
    with torch.no_grad():
        loss = kern.ce.fused_cross_entropy(logits, targets)
    assert torch.isclose(loss, torch.nn.functional.cross_entropy(logits.float(), targets), rtol=1e-5)
    x = logits.clone().requires_grad_()
    loss = kern.ce.fused_cross_entropy(x, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


# ---------------------------------------------------------------------------------------------
# The model's `triton` attention backend


def tiny(attention: str, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(n_layer=2, n_head=2, n_embd=64, block_size=48, vocab_size=128, n_vocab=100)
    return GPT(GPTConfig(**cfg, attention=attention, **kw)).to(DEVICE)


def _assert_triton_model_matches_math(wrap, seed: int, loss_rtol: float) -> None:
    """The Triton-attention model, run through `wrap` (itself, or compiled), against the eager math
    model with the same weights: logits, loss and every parameter's gradient."""
    math_model, triton_model = tiny("math"), tiny("triton")
    triton_model.load_state_dict(math_model.state_dict())
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 100, (2, 37), generator=g).to(DEVICE)
    targets = torch.randint(0, 100, (2, 37), generator=g).to(DEVICE)
    logits_m, loss_m = math_model(idx, targets)
    logits_t, loss_t = wrap(triton_model)(idx, targets)
    loss_m.backward()
    loss_t.backward()
    real = slice(0, 100)  # the padded columns are -inf in both
    torch.testing.assert_close(logits_t[..., real], logits_m[..., real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_t, loss_m, rtol=loss_rtol, atol=1e-6)
    grads_m = dict(math_model.named_parameters())
    for name, p in triton_model.named_parameters():
        torch.testing.assert_close(p.grad, grads_m[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_model_triton_attention_matches_math(kern):
    _assert_triton_model_matches_math(lambda m: m, seed=0, loss_rtol=1e-6)


def test_model_triton_attention_under_torch_compile(kern):
    # torch.compile must call the kernel as the custom op it is, not trace into it: on an H100
    # (Triton 3.6) Inductor's re-generated copy of the forward kernel failed to compile.
    _assert_triton_model_matches_math(torch.compile, seed=3, loss_rtol=1e-5)


def test_model_triton_generates_through_sdpa(kern):
    triton_model, sdpa_model = tiny("triton"), tiny("sdpa")
    sdpa_model.load_state_dict(triton_model.state_dict())
    idx = torch.tensor([[1, 2, 3, 4]], device=DEVICE)
    out = generate(triton_model, idx, 6, temperature=0)
    assert torch.equal(out, generate(sdpa_model, idx, 6, temperature=0))
    assert all(m.backend == "triton" for m in triton_model.modules() if hasattr(m, "backend"))
    with pytest.raises(BadInput, match="KV cache"):
        triton_model.next_token_logits(idx, KVCache(triton_model.config, 1, device=DEVICE))


def test_triton_attention_config():
    with pytest.raises(BadInput, match="dropout"):
        GPTConfig(attention="triton", dropout=0.1)
    with pytest.raises(BadInput, match="'triton'"):
        GPTConfig(attention="flash")
