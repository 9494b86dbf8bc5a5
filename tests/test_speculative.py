"""Draft-free speculative decoding (gptforge.modeling.speculative) in the lean Llama decoder:
prompt lookup, the acceptance rule against the distribution it must preserve, greedy tokens
identical to plain greedy decoding, and sampling that draws what plain sampling draws."""

from __future__ import annotations

import pytest
import torch

from gptforge.errors import BadInput
from gptforge.modeling.decoding import generate_hf
from gptforge.modeling.speculative import accept_or_resample, filtered_probs, prompt_lookup


class _Tok:
    pad_token_id = 0
    eos_token_id = 2


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


# A prompt that repeats itself: its continuation copies it, so drafts are found and kept.
REPEATING = torch.tensor([[5, 9, 14, 20, 33, 41, 7, 5, 9, 14, 20, 33, 41, 7, 5, 9, 14]])


def test_prompt_lookup_copies_what_followed_the_latest_earlier_match_of_the_longest_suffix():
    assert prompt_lookup([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # suffix 1 2 3 seen at 0: 4 1 followed
    assert prompt_lookup([7, 1, 2, 9, 1, 2, 5, 1, 2], 3) == [5, 1, 2]  # the latest of two matches
    assert prompt_lookup([4, 8, 3, 6, 8], 5) == []  # only the last token matches: below MIN_NGRAM
    assert prompt_lookup([4, 8, 3, 6, 8], 5, min_ngram=1) == [3, 6, 8]  # allowed: cut at the end
    assert prompt_lookup([1, 2, 3], 4) == [] and prompt_lookup([5], 4) == []
    assert prompt_lookup([3, 3, 3], 2) == [3]  # overlapping: what follows the earlier "3 3"


def test_the_acceptance_rule_draws_from_the_target_distribution():
    """Kept with p(d), else drawn from p without d: together p itself (chi-square over 20,000
    draws, fixed seed), for a drafted token that is likely, unlikely, and impossible."""
    from scipy.stats import chisquare

    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    torch.manual_seed(0)
    for drafted in (0, 4, 5):
        counts = torch.zeros(6)
        for _ in range(20_000):
            counts[accept_or_resample(p, drafted)[1]] += 1
        assert counts[5] == 0
        assert chisquare(counts[:5].numpy(), (p[:5] * 20_000).numpy()).pvalue > 1e-3


def test_filtered_probs_is_the_top_k_softmax_at_the_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    got = filtered_probs(logits, 0.5, 2)
    want = torch.softmax(torch.tensor([4.0, 2.0]), -1)
    torch.testing.assert_close(got, torch.tensor([want[0], want[1], 0.0, 0.0]))


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_speculation_gives_plain_greedy_tokens_in_fewer_forwards(k):
    model = tiny_llama()
    plain = generate_hf(model, _Tok(), REPEATING, 40, temperature=0, stop=[])
    stats = {}
    fast = generate_hf(model, _Tok(), REPEATING, 40, temperature=0, stop=[], speculate=k, stats=stats)
    assert torch.equal(fast, plain)
    assert stats["accepted"] > 0 and stats["forwards"] + stats["accepted"] == 40 - 1
    assert stats["forwards"] < 39


def test_speculation_stops_at_the_stop_token_and_at_the_budget():
    model = tiny_llama()
    plain = generate_hf(model, _Tok(), REPEATING, 30, temperature=0, stop=[])[0, REPEATING.size(1) :].tolist()
    stop = plain[12]  # a token the answer reaches: both stop at its first occurrence, kept
    want = generate_hf(model, _Tok(), REPEATING, 30, temperature=0, stop=[stop])
    got = generate_hf(model, _Tok(), REPEATING, 30, temperature=0, stop=[stop], speculate=6)
    assert torch.equal(got, want) and got[0, -1] == stop
    for n in (1, 2, 7):
        assert generate_hf(model, _Tok(), REPEATING, n, temperature=0, stop=[], speculate=6).size(1) == 17 + n


def test_sampling_with_top_1_is_greedy_through_the_acceptance_rule():
    model = tiny_llama()
    plain = generate_hf(model, _Tok(), REPEATING, 30, temperature=0, stop=[])
    stats = {}
    got = generate_hf(model, _Tok(), REPEATING, 30, temperature=0.7, top_k=1, stop=[], speculate=5, stats=stats, seed=3)
    assert torch.equal(got, plain) and stats["accepted"] > 0


@pytest.mark.slow
def test_speculative_sampling_draws_what_plain_sampling_draws(monkeypatch):
    """The 3rd and 4th new tokens (where drafts are verified) over 1,500 seeds each way: a
    chi-square test of homogeneity between plain and speculative sampling (top 3, temperature 1).
    One-token matches draft too, so that many drafts are verified (the rule holds for any draft)."""
    from scipy.stats import chi2_contingency

    from gptforge.modeling import speculative

    monkeypatch.setattr(speculative, "MIN_NGRAM", 1)

    model = tiny_llama()
    tables, drafted, accepted = [], 0, 0
    for speculate in (0, 4):
        seen = {}
        for seed in range(1500):
            stats = {}
            out = generate_hf(
                model,
                _Tok(),
                REPEATING,
                4,
                temperature=1.0,
                top_k=3,
                stop=[],
                seed=seed,
                speculate=speculate,
                stats=stats,
            )
            key = tuple(out[0, -2:].tolist())
            seen[key] = seen.get(key, 0) + 1
            drafted += stats.get("drafted", 0)
            accepted += stats.get("accepted", 0)
        tables.append(seen)
    assert 300 < accepted < drafted - 300  # drafts were verified: many kept, many rejected
    keys = sorted(set(tables[0]) | set(tables[1]))
    frequent = [k for k in keys if tables[0].get(k, 0) + tables[1].get(k, 0) >= 20]
    table = [[t.get(k, 0) for k in frequent] for t in tables]
    assert chi2_contingency(table).pvalue > 1e-3


def test_speculation_is_refused_where_it_cannot_run():
    model = tiny_llama()
    with pytest.raises(BadInput, match="one prompt at a time: 2 prompts at once"):
        generate_hf(model, _Tok(), REPEATING.repeat(2, 1), 4, temperature=0, speculate=4)
    with pytest.raises(BadInput, match="speculate must be >= 0"):
        generate_hf(model, _Tok(), REPEATING, 4, temperature=0, speculate=-1)
    with pytest.raises(BadInput, match="lean Llama-family decoder, one prompt at a time: lean=False"):
        generate_hf(model, _Tok(), REPEATING, 4, temperature=0, speculate=4, lean=False)


def test_generate_cli_speculates_and_says_how_many_drafts_it_kept(tmp_path, monkeypatch, capsys):
    from hf_models import make_tiny_causal_lm

    from gptforge.cli import main

    folder = make_tiny_causal_lm(tmp_path / "llama")
    monkeypatch.chdir(tmp_path)
    prompt = "the cat sat on the mat and the cat sat on the mat and the cat"
    argv = ["generate", prompt, "--checkpoint", str(folder), "--temperature", "0", "--max-new-tokens", "12"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--speculate", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert "drafted tokens kept" in captured.err and "forwards" in captured.err
    from gptforge.modeling.gpt import GPT, GPTConfig
    from gptforge.modeling.weights import save_model

    save_model(
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50304, n_vocab=50257)), tmp_path / "gpt"
    )
    rc = main(["generate", "x", "--checkpoint", str(tmp_path / "gpt"), "--speculate", "4"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "--speculate applies to Hugging Face Llama-family folders" in lines[-1]
