"""generate(): the KV cache changes nothing but the speed; sampling is seeded and honours top-k;
eot stops a sequence."""

from __future__ import annotations

import re

import pytest
import torch
from cli_support import REPO

from gptforge.errors import BadInput
from gptforge.modeling.decoding import generate
from gptforge.modeling.gpt import GPT, GPTConfig, KVCache


def model(attention="sdpa", block_size=24, n_vocab=100, seed=0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=block_size, vocab_size=128, n_vocab=n_vocab, attention=attention
    )
    m = GPT(cfg).eval()
    # Larger weights than the init: sharper, more varied predictions than a near-uniform
    # fresh model, so that a wrong cache position would change the argmax.
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape) * 0.3)
    return m


def prompt(B=1, T=5, seed=1, n_vocab=100):
    return torch.randint(0, n_vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_cached_greedy_equals_uncached(attention):
    m = model(attention)
    idx = prompt()
    # 30 new tokens from 5: crosses block_size (24), where generation falls back to cropping.
    a = generate(m, idx, 30, temperature=0)
    b = generate(m, idx, 30, temperature=0, use_cache=False)
    assert a.shape == (1, 35)
    assert torch.equal(a[:, :5], idx)
    assert torch.equal(a, b)
    assert len(set(a[0, 5:].tolist())) > 3  # not a degenerate repetition of one token
    assert int(a.max()) < 100  # padded ids are never produced


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_cache_chunk_after_prefix_matches_full_forward(attention):
    """A multi-token chunk after a cached prefix needs a right-aligned causal mask."""
    m = model(attention)
    idx = prompt(B=2, T=20)
    with torch.no_grad():
        full, _ = m(idx)
        cache = KVCache(m.config, batch_size=2)
        first, _ = m(idx[:, :8], kv_cache=cache)
        second, _ = m(idx[:, 8:17], kv_cache=cache)
        third, _ = m(idx[:, 17:18], kv_cache=cache)
    assert cache.pos == 18
    torch.testing.assert_close(
        torch.cat([first, second, third], 1)[..., :100], full[:, :18, :100], atol=1e-5, rtol=1e-5
    )
    with pytest.raises(BadInput, match="block_size"):
        m(torch.zeros(2, 7, dtype=torch.long), kv_cache=cache)


def test_greedy_is_argmax_of_forward():
    m = model()
    idx = prompt()
    out = generate(m, idx, 3, temperature=0)
    with torch.no_grad():
        for i in range(3):
            logits, _ = m(out[:, : 5 + i])
            assert int(logits[0, -1].argmax()) == int(out[0, 5 + i])


def test_sampling_is_reproducible_and_respects_top_k():
    m = model()
    idx = prompt()
    a = generate(m, idx, 40, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(7))
    b = generate(m, idx, 40, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(7))
    c = generate(m, idx, 40, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # every sampled token is among the 3 most likely at its step
    with torch.no_grad():
        for i in range(5, a.size(1)):
            logits, _ = m(a[:, max(0, i - m.config.block_size) : i])
            top3 = logits[0, -1].topk(3).indices.tolist()
            assert int(a[0, i]) in top3, i
    # top_k=1 is greedy
    g = generate(m, idx, 10, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(7))
    assert torch.equal(g, generate(m, idx, 10, temperature=0))


def test_sampling_cached_equals_uncached():
    m = model()
    idx = prompt()
    kw = dict(temperature=0.8, top_k=20)
    a = generate(m, idx, 30, generator=torch.Generator().manual_seed(3), **kw)
    b = generate(m, idx, 30, generator=torch.Generator().manual_seed(3), use_cache=False, **kw)
    assert torch.equal(a, b)


def test_eot_stops_batch_of_one():
    m = model()
    idx = prompt()
    free = generate(m, idx, 20, temperature=0)
    eot = int(free[0, 8])  # the 4th new token
    first = (free[0, 5:] == eot).nonzero()[0].item()
    out = generate(m, idx, 20, temperature=0, eot_id=eot)
    assert out.shape == (1, 5 + first + 1)  # the eot is kept, nothing after it
    assert int(out[0, -1]) == eot
    assert torch.equal(out, free[:, : out.size(1)])


def test_batch_cache_and_eot_padding():
    m = model()
    idx = prompt(B=3, T=6)
    a = generate(m, idx, 25, temperature=0)
    b = generate(m, idx, 25, temperature=0, use_cache=False)
    assert torch.equal(a, b)
    for r in range(3):  # each row as if it were alone
        assert torch.equal(generate(m, idx[r : r + 1], 25, temperature=0), a[r : r + 1])
    # a row that reaches eot is filled with eot afterwards; the others go on
    eot = int(a[0, 6])
    out = generate(m, idx, 25, temperature=0, eot_id=eot)
    row0 = out[0, 6:]
    assert torch.all(row0 == eot)
    for r in (1, 2):
        hits = (a[r, 6:] == eot).nonzero()
        end = 6 + hits[0].item() + 1 if len(hits) else out.size(1)
        assert torch.equal(out[r, :end], a[r, :end])
        assert torch.all(out[r, end:] == eot)


def test_long_prompt_is_cropped_and_bad_arguments():
    m = model()
    idx = prompt(T=40)  # longer than block_size: only the last 24 tokens are the context
    out = generate(m, idx, 3, temperature=0)
    assert out.shape == (1, 43) and torch.equal(out[:, :40], idx)
    assert torch.equal(out[:, 16:], generate(m, idx[:, 16:], 3, temperature=0))
    with pytest.raises(BadInput):
        generate(m, idx, 3, temperature=-1)
    with pytest.raises(BadInput):
        generate(m, idx, 3, top_k=0)
    assert torch.equal(generate(m, idx, 0), idx)


def test_generate_restores_training_mode():
    m = model()
    m.train()
    generate(m, prompt(), 2, temperature=0)
    assert m.training


# -- the decode fast path ---------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["math", "sdpa"])
@pytest.mark.parametrize("B, bias", [(1, True), (2, False)])
def test_decoder_step_equals_the_module_path_bitwise(attention, B, bias):
    """Decoder is the same operations as GPT.hidden_states without the module calls: the hidden
    states and the cache contents it leaves must be identical, not merely close."""
    from gptforge.modeling.decoding import Decoder

    torch.manual_seed(3)
    cfg = GPTConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=24, vocab_size=128, n_vocab=100, attention=attention, bias=bias
    )
    m = GPT(cfg).eval()
    idx = prompt(B=B, T=9)
    with torch.inference_mode():
        c1, c2 = KVCache(cfg, B), KVCache(cfg, B)
        m.hidden_states(idx[:, :5], c1)
        m.hidden_states(idx[:, :5], c2)
        step = Decoder(m, c2)
        for t in range(5, 9):
            ref = m.hidden_states(idx[:, t : t + 1], c1)[:, -1, :]
            got = step(idx[:, t])
            assert torch.equal(got, ref)
        assert c1.pos == c2.pos == 9
        for layer in range(cfg.n_layer):
            assert torch.equal(c1.kv[layer], c2.kv[layer])
        step.cache.pos = c2.max_len
        with pytest.raises(BadInput, match="KV cache holds 24 positions"):
            step(idx[:, 0])


def _reference_argmax(W: torch.Tensor, x: torch.Tensor) -> int:
    return int(torch.argmax(W.double() @ x.double()))


def _int8_op_runs() -> bool:
    """Whether torch has, for the CPU, the int8 kernel the greedy screen reads through: the
    platform's part. Whether the screen then trusts the kernel is the code's, and asserted."""
    op = getattr(torch, "_weight_int8pack_mm", None)
    if op is None:
        return False
    try:
        op(
            torch.zeros(1, 64, dtype=torch.bfloat16),
            torch.zeros(8, 64, dtype=torch.int8),
            torch.ones(8, dtype=torch.bfloat16),
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


INT8_OP = _int8_op_runs()
needs_int8_op = pytest.mark.skipif(not INT8_OP, reason="this torch build has no _weight_int8pack_mm for the CPU")
TORCH_PIN = re.search(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)


@pytest.mark.skipif(
    torch.__version__.split("+")[0] != TORCH_PIN, reason=f"the int8 op is asserted on the pinned torch {TORCH_PIN} only"
)
def test_the_pinned_torch_has_the_int8_screen():
    """The pinned torch's CPU build has the int8 kernel, so here the screen is on for a float32
    model: a bug that turned it off fails this test instead of showing as the skips below."""
    from gptforge.modeling.decoding import GreedyHead

    assert INT8_OP
    m = model(block_size=64)
    assert GreedyHead.usable(m.transformer.wte.weight)
    assert GreedyHead.for_model(m) is not None  # the probe trusts the kernel's rounding


@needs_int8_op
def test_greedy_head_screen_finds_the_float64_argmax():
    """The int8 screen must return exactly the argmax of W·x (computed here in float64), on
    random heads and hidden states, and on rows built to be nearly tied with the winner."""
    from gptforge.modeling.decoding import GreedyHead

    assert GreedyHead.usable(torch.zeros(64, 16))
    g = torch.Generator().manual_seed(0)
    for C, scale in [(32, 0.02), (128, 0.02), (128, 1.0), (96, 0.3)]:
        W = torch.randn(3000, C, generator=g) * scale
        screen = GreedyHead(W)
        for i in range(40):
            x = torch.randn(C, generator=g) * (1 + i % 5)
            assert screen.argmax(x) == _reference_argmax(W, x)
    # the quantization's own error stays within the constant the bound uses, unclamped
    W = torch.randn(5000, 48, generator=g) * torch.rand(5000, 1, generator=g) * 3
    screen = GreedyHead(W, chunk_rows=777)
    q = screen.q.double()
    assert int(screen.q.abs().max()) <= 127
    assert float((W.double() - q * screen.scale.double()[:, None]).abs().max()) <= screen.err_w
    assert screen.w_max == float(W.abs().max())
    # near ties: copies of the winning row nudged by one float32 ulp in one element, up or
    # down; the screen cannot see those differences, the verification must
    W = torch.randn(2000, 64, generator=g) * 0.05
    x = torch.randn(64, generator=g)
    win = _reference_argmax(W, x)
    for j, (row, direction) in enumerate([(10, 1.0), (500, -1.0), (1999, 1.0), (0, -1.0)]):
        W2 = W.clone()
        W2[row] = W[win]
        k = int(torch.argmax(x.abs()))
        toward = torch.tensor(float("inf") if (x[k] > 0) == (direction > 0) else float("-inf"))
        W2[row, k] = torch.nextafter(W2[row, k], toward)
        assert GreedyHead(W2).argmax(x) == _reference_argmax(W2, x), (row, direction)
    # an exact tie goes to the lower index, as torch.argmax
    W2 = W.clone()
    W2[3] = W[win]
    assert GreedyHead(W2).argmax(x) == min(3, win)


@needs_int8_op
def test_greedy_head_screen_declines_what_it_cannot_bound():
    from gptforge.modeling.decoding import GreedyHead

    assert GreedyHead.usable(torch.zeros(64, 16))
    W = torch.randn(500, 32)
    screen = GreedyHead(W)
    assert screen.argmax(torch.full((32,), float("nan"))) is None
    x = torch.randn(32)
    x[3] = float("inf")
    assert screen.argmax(x) is None
    same = GreedyHead(torch.randn(1, 32).expand(2000, 32).contiguous())  # every row ties
    assert same.argmax(torch.randn(32)) is None  # > MAX_CANDIDATES: the caller takes the full head
    # only where it pays: float32 on the CPU
    assert not GreedyHead.usable(W.double())
    assert not GreedyHead.usable(W.bfloat16())


@needs_int8_op
def test_greedy_head_copy_follows_the_weights():
    """The int8 copy is kept on the model until its head changes: an in-place update (an
    optimizer step between two generations during training) must make a new one."""
    from gptforge.modeling.decoding import GreedyHead

    m = model()
    a = GreedyHead.for_model(m)
    assert a is not None
    assert GreedyHead.for_model(m) is a
    with torch.no_grad():
        m.transformer.wte.weight.mul_(-1.0)
    b = GreedyHead.for_model(m)
    assert b is not a
    W = m.transformer.wte.weight[:100]
    x = torch.randn(32)
    assert b.argmax(x) == _reference_argmax(W, x)
    m.double()  # not float32: no screen, and the stale copy is dropped
    assert GreedyHead.for_model(m) is None
    assert "_greedy_head" not in m.__dict__


@needs_int8_op
def test_greedy_with_and_without_the_screen_agree(monkeypatch):
    """Long greedy runs with the int8 screen give the tokens of the plain float32 head."""
    from gptforge.modeling.decoding import GreedyHead

    m = model(block_size=64)
    idx = prompt(T=3)
    answered = []
    real_argmax = GreedyHead.argmax
    monkeypatch.setattr(GreedyHead, "argmax", lambda self, x: answered.append(real_argmax(self, x)) or answered[-1])
    with_screen = generate(m, idx, 60, temperature=0)
    assert len(answered) == 60 and None not in answered  # the screen chose every token
    calls = []
    monkeypatch.setattr(GreedyHead, "for_model", classmethod(lambda cls, m, build=True: calls.append(m) or None))
    without = generate(m, idx, 60, temperature=0)
    assert calls  # the patched lookup really was the one consulted
    assert torch.equal(with_screen, without)
    assert len(set(without[0, 3:].tolist())) > 5


@needs_int8_op
def test_greedy_head_probe_refuses_a_kernel_that_rounds_worse_than_the_bound(monkeypatch):
    """The bound assumes the int8 kernel's own rounding; a kernel 1% off must not be trusted:
    no screen, and greedy decoding falls back to the float32 head with the same tokens."""
    from gptforge.modeling.decoding import GreedyHead

    m = model()
    assert GreedyHead.for_model(m) is not None  # trusted before the kernel is made worse
    idx = prompt()
    expected = generate(m, idx, 20, temperature=0)
    real = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda x, q, s: real(x, q, s) * 1.01)
    m2 = model()
    assert GreedyHead.for_model(m2) is None
    assert torch.equal(generate(m2, idx, 20, temperature=0), expected)


def test_unmerged_lora_layers_decode_through_the_modules():
    """A model whose Linears are peft LoRA layers must decode with its adapters: the lean step
    (which reads .weight directly) is not used for it, and greedy tokens equal the merged model's."""
    import copy

    import peft

    from gptforge.modeling.decoding import Decoder

    m = model(block_size=64)
    lora = peft.get_peft_model(copy.deepcopy(m), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"]))
    with torch.no_grad():  # adapters that change the outputs (lora_B starts at zero)
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    inner = lora.base_model.model
    assert not Decoder.supports(inner) and Decoder.supports(m)
    idx = prompt(T=4)
    adapted = generate(inner, idx, 30, temperature=0)
    uncached = generate(inner, idx, 30, temperature=0, use_cache=False)
    merged = generate(lora.merge_and_unload(), idx, 30, temperature=0)
    plain = generate(m, idx, 30, temperature=0)
    assert torch.equal(adapted, uncached)
    assert torch.equal(adapted, merged)
    assert not torch.equal(adapted, plain)  # the adapters really matter here


def test_a_forward_hook_keeps_decoding_on_the_modules():
    from gptforge.modeling.decoding import Decoder

    m = model()
    seen = []
    m.transformer.h[0].mlp.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    assert not Decoder.supports(m)
    generate(m, prompt(), 6, temperature=0)
    assert len(seen) == 6  # the prefill and 5 decode steps all ran the hooked module


@needs_int8_op
def test_int8_head_copy_is_made_only_when_enough_tokens_pay_for_it(monkeypatch):
    from gptforge.modeling.decoding import GreedyHead

    m = model(block_size=64)
    assert GreedyHead.usable(m.transformer.wte.weight)
    generate(m, prompt(), 5, temperature=0)
    assert "_greedy_head" not in m.__dict__
    generate(m, prompt(), 20, temperature=0)
    screen = m.__dict__["_greedy_head"][1]
    assert screen is not None
    used = []
    real = GreedyHead.argmax
    monkeypatch.setattr(GreedyHead, "argmax", lambda self, x: used.append(self) or real(self, x))
    generate(m, prompt(), 5, temperature=0)  # an up-to-date copy is used even for a few tokens
    assert used and all(u is screen for u in used)


def test_directed_bfloat16_rounding_brackets_each_value():
    from gptforge.modeling.decoding import to_bf16

    v = torch.cat([torch.randn(5000) * 1e3, torch.randn(5000) * 1e-3, torch.tensor([0.0, 1.0, -2.5])])
    up, down = to_bf16(v, up=True), to_bf16(v, up=False)
    assert up.dtype == down.dtype == torch.bfloat16
    assert bool((up.double() >= v.double()).all()) and bool((down.double() <= v.double()).all())
    # adjacent bfloat16 numbers (or the value itself when it is one)
    exact = up == down
    assert bool((up[~exact] == torch.nextafter(down[~exact], torch.tensor(float("inf"), dtype=torch.bfloat16))).all())
    assert bool(exact[-3:].all())
    assert to_bf16(torch.tensor(float("nan")), up=False).isnan()
