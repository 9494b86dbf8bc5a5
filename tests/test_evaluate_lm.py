"""The `LM` that the evaluate stage hands lm-eval (gptforge.evaluate.lm.GptforgeLM), on the tiny
GPT of tests/test_evaluate.py: its loglikelihoods (batched, left-truncated, rolling) against an
independent float64 computation from the model's logits, its greedy flag, its greedy generation
and stops, its vocabulary check; and the in-loop (build-nanogpt style) HellaSwag evaluator of
pretraining against a direct computation with the same GPT, and against toy models in
tests/test_hellaswag.py.

The module-scoped fixtures `enc`, `checkpoint` and `model` are test_evaluate's, made once more
for this module (a GPT of 2 layers, 32 wide).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_evaluate import (  # noqa: F401 - fixtures
    BLOCK,
    HELLASWAG,
    checkpoint,
    direct_loglikelihood,
    enc,
    encode_pair,
    model,
)

from gptforge.errors import BadInput
from gptforge.evaluate.lm import GptforgeLM
from gptforge.modeling.decoding import generate
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.training import hellaswag as hs

# --------------------------------------------------------------------------------------------
# The LM


def instances(pairs):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=0) for pair in pairs]


def test_loglikelihood_matches_direct_computation(model, enc):
    lm = GptforgeLM(model, enc, batch_size=3, name="t")
    long_ctx = "The quick brown fox jumps over the lazy dog and then runs far away into the deep forest. " * 2
    pairs = [
        ("The cat sat on the", " mat."),
        ("The cat sat on the", " hat and the dog sat on the log."),
        ("Question: 2 + 2?\nAnswer:", " B"),
        ("Question: 2 + 2?\nAnswer:", " C"),
        ("", "Hello world"),
        ("Trailing space ", "here"),
        (long_ctx, " the end of it"),
        (long_ctx, " x"),
    ]
    assert len(encode_pair(enc, *pairs[6])[0]) > 2 * BLOCK  # left-truncated
    got = lm.loglikelihood(instances(pairs), disable_tqdm=True)
    assert len(got) == len(pairs)
    for pair, (lp, greedy) in zip(pairs, got):
        ref_lp, ref_greedy = direct_loglikelihood(model, *encode_pair(enc, *pair))
        assert math.isfinite(lp) and lp < 0
        assert lp == pytest.approx(ref_lp, abs=1e-4), pair
        assert greedy == ref_greedy
    # A different batch size gives the same numbers (padding does not leak into real positions).
    lm1 = GptforgeLM(model, enc, batch_size=1)
    again = lm1.loglikelihood(instances(pairs), disable_tqdm=True)
    assert [a for a, _ in again] == pytest.approx([a for a, _ in got], abs=1e-5)


def test_greedy_flag_is_true_for_the_model_s_own_argmax(model, enc):
    ctx = enc.encode_ordinary("Once upon a time")
    with torch.no_grad():
        nxt = int(model(torch.tensor([ctx]))[0][0, -1, : enc.n_vocab].argmax())
    lm = GptforgeLM(model, enc)
    (lp_best, greedy_best), (lp_other, greedy_other) = lm.score_tokens(
        [(ctx, [nxt]), (ctx, [(nxt + 1) % enc.n_vocab])], disable_tqdm=True
    )
    assert greedy_best and not greedy_other
    assert lp_best > lp_other


def test_loglikelihood_rolling_scores_every_token_once(model, enc):
    from lm_eval.api.instance import Instance

    lm = GptforgeLM(model, enc, batch_size=4)
    short, long = "A short text.", "A longer text that goes on and on, well past one window of the model. " * 3
    got = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (s,), 0) for s in (short, long)], disable_tqdm=True
    )
    for text, value in zip((short, long), got):
        toks = enc.encode_ordinary(text)
        # Disjoint chunks of BLOCK targets, each with the BLOCK tokens before it as context
        # (the first after <|endoftext|>); the last chunk keeps a full window of context.
        full = [enc.eot_token] + toks
        ref, start = 0.0, 0
        while start < len(toks):
            end = min(start + BLOCK, len(toks))
            lo = max(0, end - BLOCK)  # index into full: input full[lo:end] predicts toks[lo:end]
            lp, _ = direct_loglikelihood(model, full[lo : start + 1], toks[start:end])
            ref += lp
            start = end
        assert value == pytest.approx(ref, abs=1e-4)
    assert len(enc.encode_ordinary(long)) > 2 * BLOCK


def test_generate_until_is_greedy_and_stops_at_until(model, enc):
    from lm_eval.api.instance import Instance

    lm = GptforgeLM(model, enc)
    prompt = "Hello"  # this model's greedy text from it: "ooooisisisisisisisis", no <|endoftext|>
    ids = torch.tensor([enc.encode_ordinary(prompt)])
    full = generate(model, ids, 12, temperature=0, eot_id=enc.eot_token)[0, ids.size(1) :].tolist()
    assert enc.eot_token not in full
    expected = enc.decode(full)
    [text] = lm.generate_until(
        [Instance("generate_until", {}, (prompt, {"until": ["\u2603"], "max_gen_toks": 12}), 0)], disable_tqdm=True
    )
    assert text == expected
    stop = expected[len(expected) // 2 :][:2]
    assert expected.split(stop)[0]  # the stop first shows after some text: a cut in the right place shows
    [cut] = lm.generate_until(
        [Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 12}), 0)], disable_tqdm=True
    )
    assert cut == expected.split(stop)[0]


def test_vocabulary_mismatch_is_bad_input(enc):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=512, n_vocab=500))
    with pytest.raises(BadInput, match="vocabulary of 500 tokens.*has 281"):
        GptforgeLM(model, enc)


# --------------------------------------------------------------------------------------------
# Pretraining's in-loop HellaSwag, on the same GPT


def test_in_loop_hellaswag_agrees_with_direct_computation(model, enc):
    """gptforge.training.hellaswag (pretraining's build-nanogpt-style score) with the real GPT, on the same
    examples: summed and mean loss of `ctx` + " " + ending, left-truncated to the window."""
    examples = [{"ctx": ex["ctx"], "endings": ex["endings"], "label": int(ex["label"])} for ex in HELLASWAG]
    got = hs.evaluate(model, examples, enc)
    correct = correct_norm = n = 0
    for ex in examples:
        ctx = enc.encode_ordinary(ex["ctx"])
        conts = [enc.encode_ordinary(" " + e) for e in ex["endings"]]
        drop = max(0, len(ctx) + max(map(len, conts)) - BLOCK)  # the same context for every ending
        assert drop < len(ctx)  # every example keeps some context, so every one is scored
        sums, means = [], []
        for cont in conts:
            seq = ctx[drop:] + cont
            with torch.no_grad():
                logits, _ = model(torch.tensor([seq[:-1]]))
            logp = F.log_softmax(logits[0].double(), -1)[-len(cont) :]
            loss = -float(logp.gather(1, torch.tensor(cont)[:, None]).sum())
            sums.append(loss)
            means.append(loss / len(cont))
        n += 1
        correct += min(range(4), key=sums.__getitem__) == ex["label"]
        correct_norm += min(range(4), key=means.__getitem__) == ex["label"]
    assert n == 8 and got["n"] == n and got["skipped"] == 0
    assert (got["correct"], got["correct_norm"]) == (correct, correct_norm)
    assert any(len(enc.encode_ordinary(ex["ctx"])) > BLOCK // 2 for ex in examples)
