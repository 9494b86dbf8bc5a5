"""Weight-only int8 and int4 in gptforge's own GPT decoder (`decoding.Decoder(weights=...)`,
`generate(weights=...)`, `gptforge generate --quantize` of a gptforge checkpoint): the packed
prompt pass and steps compute the model whose linears are replaced by their rounding (against
its module forward in float64), the head in int8, greedy tokens are that model's, and what it
cannot decode is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from gptforge.errors import BadInput
from gptforge.modeling.decoding import Decoder, generate
from gptforge.modeling.gpt import GPT, GPTConfig, KVCache
from gptforge.modeling.weight_only import HEAD_WEIGHTS, PACKED

VOCAB = 96


def tiny(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=64, vocab_size=VOCAB, n_vocab=VOCAB, n_layer=2, n_head=2, n_embd=64))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)  # answers that vary from token to token
    return model.eval()


def rounded_copy(model: GPT, weights: str) -> GPT:
    """The model in float64 with every block linear rounded as `weights` packs it (from the
    model's own weights, in its dtype, as the decoder packs them), and its int8 head."""
    ref = copy.deepcopy(model).double()
    pack = PACKED[weights][0]
    with torch.no_grad():
        for b, theirs in zip(ref.transformer.h, model.transformer.h):
            for mine, orig in [
                (b.attn.c_attn, theirs.attn.c_attn),
                (b.attn.c_proj, theirs.attn.c_proj),
                (b.mlp.c_fc, theirs.mlp.c_fc),
                (b.mlp.c_proj, theirs.mlp.c_proj),
            ]:
                mine.weight.copy_(pack.rounded(orig.weight).double())
    head = PACKED[HEAD_WEIGHTS][0].rounded(model.lm_head.weight).double()
    return ref, head


def off(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative error of a against b, over the whole vector."""
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_prompt_and_steps_compute_the_rounded_model(weights, dtype):
    """Against the rounded model's module forward in float64; in bf16 within twice the error of
    the plain bf16 model's own forward against its float64 self (bf16 rounds every activation)."""
    model = tiny().to(dtype)
    ref, head = rounded_copy(model, weights)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref.hidden_states(ids)[0]  # (12, C), float64
        plain_error = max(
            off(a, b) for a, b in zip(model.hidden_states(ids)[0], copy.deepcopy(model).double().hidden_states(ids)[0])
        )
    tol = 1e-5 if dtype == torch.float32 else 2 * plain_error
    cache = KVCache(model.config, 1, 12, dtype=dtype)
    step = Decoder(model, cache, weights)
    with torch.inference_mode():
        got = [step.prefill(ids[:, :8])] + [step(ids[:, t]) for t in range(8, 12)]
        logits = step.logits(got[-1])
    for last, h in zip(range(7, 12), got):
        assert off(h[0], expected[last]) < tol, last
    assert off(logits[0], got[-1][0].double() @ head.T) < max(tol, 1e-2 if dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_greedy_tokens_are_the_rounded_models(weights):
    model = tiny()
    ref, head = rounded_copy(model, weights)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    got = generate(model, prompt, 30, temperature=0, weights=weights)[0, 6:].tolist()
    seq = prompt[0].tolist()
    with torch.no_grad():
        for _ in range(30):
            h = ref.hidden_states(torch.tensor([seq]))[0, -1]
            seq.append(int((h @ head.T).argmax()))
    assert got == seq[6:]
    plain = generate(model, prompt, 30, temperature=0)[0, 6:].tolist()
    assert plain != got or weights == "int8"  # int4 changes this random model's answer; int8 may not


def test_packed_weights_are_refused_where_they_cannot_decode():
    model = tiny()
    prompt = torch.zeros(1, 60, dtype=torch.long)
    with pytest.raises(BadInput, match="60 prompt \\+ 10 new tokens > block_size 64"):
        generate(model, prompt, 10, temperature=0, weights="int8")
    with pytest.raises(BadInput, match="weights: expected one of native, int8, int4, got 'int2'"):
        Decoder(model, KVCache(model.config, 1, 8), "int2")
    hooked = copy.deepcopy(model)
    hooked.transformer.h[0].register_forward_hook(lambda *a: None)
    with pytest.raises(BadInput, match="int4 weights decode plain GPT-2 checkpoints"):
        generate(hooked, prompt[:, :4], 4, temperature=0, weights="int4")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_served_answers_are_generates_alone_and_among_other_rows(weights):
    """`gptforge serve --quantize` of a gptforge checkpoint: GPTBackend over the packed Decoder,
    its prompt in a mixed step, its tokens beside other rows (ragged positions), equal to
    `generate(weights=...)` alone."""
    from gptforge.serve.engine_core import step
    from gptforge.serve.gpt_backend import GPTBackend
    from gptforge.serve.sampling import Sampling
    from gptforge.serve.scheduler import Job, Scheduler

    model = tiny()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 11)]
    alone = [
        generate(model, torch.tensor([p]), 16, temperature=0, weights=weights)[0, len(p) :].tolist() for p in prompts
    ]
    scheduler = Scheduler(GPTBackend(model, 4, weights), prefill_chunk=8)
    jobs = [Job(i, p, Sampling(temperature=0.0, max_tokens=16), frozenset()) for i, p in enumerate(prompts)]
    scheduler.add(jobs[0])
    for k in range(200):
        if k == 2:  # the others join while the first decodes
            scheduler.add(jobs[1])
            scheduler.add(jobs[2])
        if not scheduler.has_work:
            break
        step(scheduler)
    assert [j.fed for j in jobs] == alone


def test_packed_copies_are_kept_on_the_model_until_a_weight_changes():
    """`weight_only.pack_all`: a second decoder of the same model reuses the packed copies (no
    second 0.4-s packing of SmolLM2 per `generate` call); an in-place update packs again."""
    model = tiny()
    first = Decoder(model, KVCache(model.config, 1, 8), "int8")
    again = Decoder(model, KVCache(model.config, 1, 8), "int8")
    assert again.layers[0][3] is first.layers[0][3] and again.packed_head is first.packed_head
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(2)
    changed = Decoder(model, KVCache(model.config, 1, 8), "int8")
    assert changed.layers[0][3] is not first.layers[0][3]
    torch.testing.assert_close(changed.layers[1][10].scale, 2 * first.layers[1][10].scale)
    assert changed.packed_head is first.packed_head  # the head's own entry: unchanged
    int4 = Decoder(model, KVCache(model.config, 1, 8), "int4")  # another format: its own entry
    assert Decoder(model, KVCache(model.config, 1, 8), "int8").layers[0][3] is changed.layers[0][3]
    assert int4.layers[0][3] is not changed.layers[0][3]
