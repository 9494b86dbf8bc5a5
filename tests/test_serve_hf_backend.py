"""`serve.hf_backend.HFBackend`: rows fed in segments (batched prefill of new rows, chunked
prefill between decode steps, rows opened from copied prefix blocks) give, row for row, the
logits of the model's plain forward over that row's whole sequence alone; with transformers'
forward for every step (a model with a hook), and with the common decode step through
gptforge's lean Llama block (`lean`)."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from hf_models import tiny_llama_config

from gptforge.errors import BadInput
from gptforge.serve.hf_backend import HFBackend

torch.set_num_threads(1)

VOCAB = 128


@pytest.fixture(scope="module", params=["sdpa", "eager", "lean"])
def model(request):
    """A tiny random Llama with grouped-query attention, through SDPA's boolean masks and the
    eager path's additive ones (the forwards counted by a hook, which keeps the backend on
    transformers' forward), and with no hook (`lean`: the common step through LlamaLayers)."""
    torch.manual_seed(0)
    attn = "sdpa" if request.param == "lean" else request.param
    model = transformers.LlamaForCausalLM(llama_config(attn)).float().eval()
    assert model.config._attn_implementation == attn
    model.forwards = 0  # counted, to see how many forwards one backend call makes
    if request.param != "lean":
        model.register_forward_pre_hook(lambda module, args: setattr(module, "forwards", module.forwards + 1))
    else:  # counted without a hook: the instance's forward, wrapped once
        original = model.forward

        @functools.wraps(original)  # the same signature: the backend reads the cache argument's name
        def forward(*args, **kwargs):
            model.forwards += 1
            return original(*args, **kwargs)

        model.forward = forward
    model.lean = request.param == "lean"
    return model


def llama_config(attn: str = "sdpa", **changes) -> transformers.LlamaConfig:
    """A tiny Llama with grouped-query attention (4 heads, 2 key/value heads)."""
    return tiny_llama_config(VOCAB, attn, **changes)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


class Rows:
    """A backend, plus each row's whole sequence for the reference."""

    def __init__(self, model, max_batch=8, context=256, weights="native"):
        self.model = model
        self.backend = HFBackend(model, max_batch, context, weights)
        lean = self.backend._lean
        assert (lean is not None) == model.lean
        if lean is not None:  # a lean step counts as the model's forward it replaces

            def counted(*args, _forward=lean.forward):
                model.forwards += 1
                return _forward(*args)

            lean.forward = counted
        self.seqs: list[list[int]] = []
        self.calls = 0  # the model's forwards during the last `forward`

    def open(self, prefix=None, held=()):
        self.backend.open_row(prefix)
        self.seqs.append(list(held))

    def forward(self, segments):
        before = self.model.forwards
        logits = self.backend.forward(segments)
        self.calls = self.model.forwards - before
        assert logits.dtype == torch.float32 and logits.shape == (len(segments), VOCAB)
        for (row, tokens), got in zip(segments, logits):
            self.seqs[row] += tokens
            check(self.model, self.seqs[row], got)
        return [int(x) for x in logits.argmax(-1)]

    def keep(self, rows):
        self.backend.keep(rows)
        self.seqs = [self.seqs[r] for r in rows]
        assert self.backend.rows == len(rows)


@torch.inference_mode()
def reference(model, seq: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([seq])).logits[0, -1].float()


def check(model, seq, got):
    want = reference(model, seq)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (len(seq), (got - want).abs().max())
    assert int(got.argmax()) == int(want.argmax())


def test_batched_prefill_decode_mixed_call_and_keep(model):
    r = Rows(model)
    for _ in range(3):
        r.open()
    nxt = r.forward([(0, prompt(5, 1)), (1, prompt(13, 2)), (2, prompt(9, 3))])
    assert r.calls == 1  # the three prompts in one padded forward
    for _ in range(3):
        nxt = r.forward([(i, [t]) for i, t in enumerate(nxt)])
        assert r.calls == 1
    r.open()  # row 3 prefills while rows 0-2 decode, in one call (segments in any order)
    out = r.forward([(3, prompt(11, 4)), (2, [nxt[2]]), (0, [nxt[0]]), (1, [nxt[1]])])
    assert r.calls == 2
    nxt = [out[2], out[3], out[1], out[0]]
    nxt = r.forward([(i, [t]) for i, t in enumerate(nxt)])  # row 3 joins the batch
    r.keep([0, 2, 3])  # a middle row leaves
    nxt = [nxt[0], nxt[2], nxt[3]]
    for _ in range(3):
        nxt = r.forward([(i, [t]) for i, t in enumerate(nxt)])
    r.keep([1, 2])  # the batch's first row leaves: its padding columns go
    nxt = [nxt[1], nxt[2]]
    nxt = r.forward([(i, [t]) for i, t in enumerate(nxt)])
    # a subset of rows, and a batch row given several tokens at once
    r.forward([(1, [nxt[1], 7, 8])])
    r.forward([(0, [nxt[0]]), (1, [9])])
    assert r.backend.rows == 2 and [len(s) for s in r.seqs] == [19, 20]
    blocks = r.backend.read_blocks(0, 0, 1, 19)  # row 0's 19 positions span its masked columns
    r.keep([0])  # row 1 leaves: the columns row 0 never used, in the middle, go
    r.forward([(0, [3])])
    r.open(prefix=blocks, held=r.seqs[0][:19])
    r.forward([(1, [4])])  # a prefix row's first segment of one token: straight into the batch
    r.forward([(1, [5]), (0, [6])])


def test_chunked_prefill_between_decode_steps(model):
    r = Rows(model)
    r.open(), r.open()
    nxt = r.forward([(0, prompt(6, 5)), (1, prompt(17, 6))])
    long = prompt(40, 7)
    r.open()
    for start in range(0, 40, 7):
        out = r.forward([(0, [nxt[0]]), (2, long[start : start + 7]), (1, [nxt[1]])])
        nxt = [out[0], out[2]]
    assert r.seqs[2] == long  # the last chunk's logits were checked against the one-shot forward
    last = out[1]
    nxt = r.forward([(0, [nxt[0]]), (1, [nxt[1]]), (2, [last])])
    r.forward([(i, [t]) for i, t in enumerate(nxt)])
    r.keep([])  # every row leaves; the backend starts over
    r.open(), r.open()
    nxt = r.forward([(0, prompt(3, 15)), (1, prompt(30, 16))])
    assert r.calls == 2  # lengths this far apart are prefilled apart
    r.forward([(0, [nxt[0]]), (1, [nxt[1]])])


def test_prefix_blocks_are_copies_and_seed_a_new_row(model):
    r = Rows(model)
    shared = prompt(32, 8)
    r.open()
    (t,) = r.forward([(0, shared + prompt(3, 9))])  # row A: 35 tokens
    blocks = r.backend.read_blocks(0, 0, 2, 16)
    assert len(blocks) == 2
    for block in blocks:
        tensors = [*block.keys, *block.values]
        assert len(tensors) == 4 and all(x.shape == (1, 2, 16, 16) for x in tensors)
        assert block.nbytes == sum(x.numel() * x.element_size() for x in tensors)
        assert not any(x.is_inference() for x in tensors)
    before = [x.clone() for b in blocks for x in (*b.keys, *b.values)]
    r.open()
    (t, _) = r.forward([(0, [t]), (1, prompt(4, 10))])  # A joins the batch and decodes on
    for _ in range(3):
        (t,) = r.forward([(0, [t])])
    r.keep([0])  # the batch's buffers are rebuilt
    assert all(torch.equal(a, x) for a, x in zip(before, (x for b in blocks for x in (*b.keys, *b.values))))
    rest = prompt(9, 11)
    r.open(prefix=blocks, held=shared)  # row B starts at position 32
    out = r.forward([(1, rest[:5]), (0, [t])])
    r.forward([(1, rest[5:]), (0, [out[1]])])
    # blocks read again from A, a batch row now, equal the first copies
    again = r.backend.read_blocks(0, 0, 2, 16)
    assert all(
        torch.allclose(a, b, atol=1e-5)
        for x, y in zip(blocks, again)
        for a, b in zip((*x.keys, *x.values), (*y.keys, *y.values))
    )
    r.open(prefix=again + r.backend.read_blocks(1, 2, 2, 16), held=shared)
    r.forward([(2, rest)])


def test_greedy_generation_equals_generate(model):
    prompts = [prompt(4, 12), prompt(15, 13), prompt(9, 14)]
    steps = 20
    backend = HFBackend(model, 4, 256)
    for _ in prompts:
        backend.open_row()
    nxt = backend.forward(list(enumerate(prompts))).argmax(-1).tolist()
    got = [[t] for t in nxt]
    for _ in range(steps - 1):
        nxt = backend.forward([(i, [t]) for i, t in enumerate(nxt)]).argmax(-1).tolist()
        for g, t in zip(got, nxt):
            g.append(t)
    for p, g in zip(prompts, got):
        ids = torch.tensor([p])
        want = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()  # no stop token
        assert len(want) == steps and g == want


def test_sliding_window_models_are_refused():
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    with pytest.raises(BadInput, match="full-attention cache layers"):
        HFBackend(transformers.MistralForCausalLM(cfg), 2, 64)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_serve_the_model_with_their_rounding(weights):
    """weights="int8" / "int4" (serve --quantize): the decode step's linears are packed, and the
    model transformers' forward prefills with holds their rounding, so every row's logits,
    prefill and decode steps alike, are the rounded model's plain forward over the row (float32)."""
    from gptforge.modeling.llama_decoding import PACKED, decoder_linears

    packed_class = PACKED[weights][0]
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True)).float().eval()
    before = [m.weight.clone() for m in decoder_linears(model)]
    embedding = model.model.embed_tokens.weight.clone()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as SmolLM2's
    model.forwards, model.lean = 0, True
    r = Rows(model, max_batch=4, weights=weights)
    layer = r.backend._lean.layers[0]
    assert all(isinstance(layer[i], packed_class) for i in (2, 4, 6, 8, 12, 14, 16))  # q k v o gate up down
    for m, w in zip(decoder_linears(model), before):  # each weight is its rounding now
        torch.testing.assert_close(m.weight, packed_class.rounded(w), rtol=0, atol=1e-7)
        assert not torch.equal(m.weight, w)
    # the head too (in int8 under both), in a copy of its own: the tied embedding's rows stay
    torch.testing.assert_close(model.lm_head.weight, PACKED["int8"][0].rounded(embedding), rtol=0, atol=1e-7)
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    for _ in range(2):
        r.open()
    nxt = r.forward([(0, prompt(7, 21)), (1, prompt(11, 22))])
    for _ in range(4):  # the common decode step: through the packed linears
        nxt = r.forward([(i, [t]) for i, t in enumerate(nxt)])
    with pytest.raises(BadInput, match=f"--quantize {weights} runs in gptforge's lean Llama-family decoder"):
        HFBackend(transformers.LlamaForCausalLM(llama_config(hidden_act="gelu")), 2, 64, weights=weights)
