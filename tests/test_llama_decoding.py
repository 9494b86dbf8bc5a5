"""The lean Llama-family decoder (`gptforge.modeling.llama_decoding`) against transformers' own
model with the same weights: hidden states in float64 after a prefill, decode steps and a later
chunk; `generate_hf`'s tokens through it against transformers' `generate` (greedy, sampled with a
seed, stop ids, a batch); and the models it leaves to transformers."""

from __future__ import annotations

import pytest
import torch

from gptforge.errors import BadInput
from gptforge.modeling.decoding import generate_hf
from gptforge.modeling.llama_decoding import LlamaDecoder, unsupported


def tiny(arch: str, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=arch == "llama",
    )
    shape.update(extra)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**shape)).eval()
    with torch.no_grad():  # non-trivial norms (ones at init would hide a missing weight)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


class _Tok:
    """The two attributes generate_hf asks of a tokenizer."""

    pad_token_id = None
    eos_token_id = 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hidden_states_equal_transformers_forward_in_float64(arch):
    model = tiny(arch).double()
    assert unsupported(model) is None
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model.model(input_ids=ids).last_hidden_state  # (2, 12, 64), no cache
    decoder = LlamaDecoder(model, batch=2, max_len=12)
    with torch.inference_mode():
        got = [decoder(ids[:, :5])]  # prefill
        got += [decoder(ids[:, t : t + 1]) for t in range(5, 8)]  # decode steps
        got += [decoder(ids[:, 8:12])]  # a chunk at position 8: the explicit causal mask
    for last, h in zip([4, 5, 6, 7, 11], got):
        torch.testing.assert_close(h, reference[:, last], rtol=0, atol=1e-12)
    with pytest.raises(Exception, match="holds 12 positions, 13 needed"):
        decoder(ids[:, :1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generate_hf_lean_gives_transformers_tokens(arch):
    model = tiny(arch).double()
    ids = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(stop=[])  # no stop: 32 tokens each
    greedy = generate_hf(model, _Tok(), ids, 32, temperature=0, **kw)
    assert greedy.shape == (1, 39)
    assert torch.equal(greedy, generate_hf(model, _Tok(), ids, 32, temperature=0, lean=False, **kw))
    # sampled: transformers draws with torch's global generator from the same probabilities
    for top_k in (None, 20):
        a = generate_hf(model, _Tok(), ids, 24, temperature=0.9, top_k=top_k, seed=5, **kw)
        b = generate_hf(model, _Tok(), ids, 24, temperature=0.9, top_k=top_k, seed=5, lean=False, **kw)
        assert torch.equal(a, b)


def test_a_batch_stops_row_by_row_as_transformers_does():
    model = tiny("llama").double()
    ids = torch.randint(3, 300, (3, 6), generator=torch.Generator().manual_seed(3))
    free = generate_hf(model, _Tok(), ids, 20, temperature=0, stop=[])
    # stop at a token that one row makes early and another later or never
    stop = int(free[0, 6 + 3])
    lean = generate_hf(model, _Tok(), ids, 20, temperature=0, stop=[stop])
    stock = generate_hf(model, _Tok(), ids, 20, temperature=0, stop=[stop], lean=False)
    assert torch.equal(lean, stock)
    assert lean[0, 6 + 3] == stop and (lean[0, 6 + 4 :] == stop).all()  # padded with the stop id (no pad id)


def test_float32_greedy_through_the_int8_head_screen_equals_transformers():
    model = tiny("llama", vocab_size=4096, hidden_size=128, intermediate_size=256)
    ids = torch.randint(3, 4096, (1, 9), generator=torch.Generator().manual_seed(4))
    lean = generate_hf(model, _Tok(), ids, 32, temperature=0, stop=[])
    assert "_greedy_head" in model.__dict__  # the screen was used (32 >= 16 new tokens, batch 1, float32)
    assert torch.equal(lean, generate_hf(model, _Tok(), ids, 32, temperature=0, stop=[], lean=False))


def test_models_it_cannot_run_exactly_are_left_to_transformers():
    from peft import LoraConfig, get_peft_model

    scaled = tiny("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert "rotary scaling 'linear'" in unsupported(scaled)
    assert "activation" in unsupported(tiny("llama", hidden_act="gelu"))
    peft_model = get_peft_model(tiny("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    assert "not plain nn.Linear" in unsupported(peft_model.base_model.model)
    hooked = tiny("llama")
    hooked.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert unsupported(hooked) == "forward hooks"
    # and generate_hf still decodes them (transformers' generate): the scaled model's own argmax
    ids = torch.tensor([[5, 6, 7]])
    out = generate_hf(scaled, _Tok(), ids, 4, temperature=0, stop=[])
    seq = ids[0].tolist()
    with torch.no_grad():
        for _ in range(4):
            seq.append(int(scaled(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out[0].tolist() == seq


def test_dtype_flag_loads_the_weights_in_that_dtype(tmp_path, monkeypatch, capsys):
    """`gptforge generate --dtype bfloat16` answers from bf16 weights (the lean decoder then runs
    in bf16); `serve --dtype` reaches the engine the same way; a bad name is one line."""
    from hf_models import make_tiny_causal_lm

    from gptforge.cli import main
    from gptforge.modeling import hf_causal
    from gptforge.modeling.hf_causal import inference_dtype
    from gptforge.serve.engine_process import EngineSpec, build_scheduler

    folder = make_tiny_causal_lm(tmp_path / "llama")
    seen = []
    load = hf_causal.load_causal_lm

    def recording(*args, **kwargs):
        model, tok = load(*args, **kwargs)
        seen.append(next(model.parameters()).dtype)
        return model, tok

    monkeypatch.setattr(hf_causal, "load_causal_lm", recording)
    monkeypatch.chdir(tmp_path)
    rc = main(
        [
            "generate",
            "The fox",
            "--checkpoint",
            str(folder),
            "--temperature",
            "0",
            "--max-new-tokens",
            "6",
            "--dtype",
            "bfloat16",
        ]
    )
    assert rc == 0 and seen == [torch.bfloat16]
    assert "gptforge: 6 tokens in" in capsys.readouterr().err
    scheduler, _ = build_scheduler(EngineSpec("hf", str(folder), dtype="bfloat16", prefix_cache_mb=0))
    assert seen[-1] == torch.bfloat16 and scheduler.backend._lean.dtype == torch.bfloat16
    assert inference_dtype("auto", "cpu") == torch.float32 and inference_dtype("auto", "cuda") == torch.bfloat16
    with pytest.raises(BadInput, match="--dtype must be one of auto, float32, bfloat16, got 'float16'"):
        inference_dtype("float16", "cpu")


def test_int8_weights_round_each_row_to_its_own_scale():
    from gptforge.modeling.llama_decoding import Int8Weight

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, dtype=torch.float64, generator=g)
    w = w * torch.linspace(0.01, 3.0, 48, dtype=torch.float64)[:, None]
    packed = Int8Weight(w, torch.float32)
    scale = w.abs().amax(dim=1) / 127  # the formula: symmetric, the row's largest |w| maps to 127
    assert packed.q.dtype == torch.int8 and packed.q.abs().max() == 127
    torch.testing.assert_close(packed.scale.double(), scale, rtol=1e-7, atol=0)
    error = (packed.dequantized().double() - w).abs()
    # Round to nearest: at most half a step, plus the float32 rounding of w, scale and q * scale
    # (a few ulps of |w|: the bound without it failed on 1 draw in several).
    assert (error <= scale[:, None] / 2 + 4 * w.abs() * 2.0**-24).all()


def test_int4_weights_round_each_group_of_32_between_its_extremes():
    """int4_groups: each group of 32 inputs of a row maps its smallest value to 0 and its largest
    to 15, every value within half a step of its level; the kernel multiplies by exactly
    `Int4Weight.rounded` (against float64, float32 activations)."""
    from gptforge.modeling.llama_decoding import Int4Weight, int4_groups, int4_linear

    g = torch.Generator().manual_seed(1)
    w = (
        torch.randn(48, 96, dtype=torch.float64, generator=g)
        * torch.linspace(0.01, 3.0, 48, dtype=torch.float64)[:, None]
    )
    q, scale, zero = int4_groups(w)
    groups = q.view(48, 3, 32)
    assert q.dtype == torch.int32 and (groups.amin(-1) == 0).all() and (groups.amax(-1) == 15).all()
    w_groups = w.view(48, 3, 32)
    torch.testing.assert_close(scale.double(), (w_groups.amax(-1) - w_groups.amin(-1)) / 15, rtol=1e-6, atol=0)
    rounded = Int4Weight.rounded(w.float()).double()
    assert ((rounded - w).abs() <= scale.double().repeat_interleave(32, dim=1) / 2 + 1e-6 * w.abs().max()).all()
    x = torch.randn(5, 96, generator=g)
    got = int4_linear(x, Int4Weight(w.float(), torch.float32), None).double()
    torch.testing.assert_close(got, x.double() @ rounded.T, rtol=0, atol=1e-4)
    with pytest.raises(BadInput, match="int4 weights need an input width divisible by 32, got 40"):
        Int4Weight(torch.zeros(8, 40), torch.float32)


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_quantized_layers_compute_the_model_with_rounded_weights(weights, dtype, tol):
    """weights="int8" / "int4" is the same model with each linear's weight replaced by its
    rounding: its hidden states against transformers' forward in float64 on those weights."""
    from gptforge.modeling.llama_decoding import PACKED

    packed_class = PACKED[weights][0]
    model = tiny("llama").to(dtype)
    reference = tiny("llama").double()
    with torch.no_grad():
        for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
            is_linear = name.endswith("proj.weight")
            ref.copy_(packed_class.rounded(p).double() if is_linear else p.double())
    ids = torch.randint(3, 300, (1, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = reference.model(input_ids=ids).last_hidden_state[0]
    decoder = LlamaDecoder(model, batch=1, max_len=10, weights=weights)
    with torch.inference_mode():
        got = [decoder(ids[:, :6])] + [decoder(ids[:, t : t + 1]) for t in range(6, 10)]
    for last, h in zip([5, 6, 7, 8, 9], got):
        torch.testing.assert_close(h[0].double(), expected[last], rtol=tol, atol=tol)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_head_gives_the_logits_of_its_rounding(weights):
    """The head is quantized with the layers, in int8 under both: `logits` against the rounded
    head in float64; and int4's own kernel pads a vocabulary that is no multiple of 16."""
    from gptforge.modeling.llama_decoding import PACKED, Int4Weight, LlamaLayers, int4_linear

    model = tiny("llama")
    layers = LlamaLayers(model, 8, weights)
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    want = h.double() @ PACKED["int8"][0].rounded(model.lm_head.weight).double().T
    torch.testing.assert_close(layers.logits(h).double(), want, rtol=0, atol=1e-4)
    head4 = model.lm_head.weight  # 300 rows: padded to 304 inside, 300 columns out
    want4 = h.double() @ Int4Weight.rounded(head4).double().T
    torch.testing.assert_close(
        int4_linear(h, Int4Weight(head4, torch.float32), None).double(), want4, rtol=0, atol=1e-4
    )
    native = LlamaLayers(model, 8)
    assert native.packed_head is native.head and torch.equal(native.logits(h), h @ model.lm_head.weight.T)


def test_quantize_int8_decodes_through_generate_and_is_refused_where_it_cannot_run(tmp_path, monkeypatch, capsys):
    from hf_models import make_tiny_causal_lm

    from gptforge.cli import main

    model = tiny("llama")
    ids = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(7))
    out = generate_hf(model, _Tok(), ids, 12, temperature=0, stop=[], quantize="int8")
    assert out.shape == (1, 19) and torch.equal(out[:, :7], ids)
    with pytest.raises(BadInput, match="cannot run this model: activation 'gelu'"):
        generate_hf(tiny("llama", hidden_act="gelu"), _Tok(), ids, 4, temperature=0, quantize="int8")
    with pytest.raises(BadInput, match="expected int8, int4 or none, got 'int2'"):
        generate_hf(model, _Tok(), ids, 4, temperature=0, quantize="int2")
    out4 = generate_hf(model, _Tok(), ids, 12, temperature=0, stop=[], quantize="int4")
    assert out4.shape == (1, 19) and torch.equal(out4[:, :7], ids)
    folder = make_tiny_causal_lm(tmp_path / "llama")
    monkeypatch.chdir(tmp_path)
    generate = ["generate", "The fox", "--checkpoint", str(folder), "--temperature", "0", "--max-new-tokens", "5"]
    for extra in (["--dtype", "bfloat16", "--quantize", "int8"], ["--quantize", "int4"]):
        assert main([*generate, *extra]) == 0
        assert "gptforge: 5 tokens in" in capsys.readouterr().err
    from gptforge.modeling.gpt import GPT, GPTConfig
    from gptforge.modeling.weights import save_model

    save_model(
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50304, n_vocab=50257)), tmp_path / "gpt"
    )
    # a gptforge checkpoint decodes with packed weights too (tests/test_weight_only_gpt.py), within its context
    from serve_support import PARAMS  # the embedded GPT-2 tokenizer

    gpt = ["generate", "The fox", "--checkpoint", str(tmp_path / "gpt"), "--quantize", "int8", "--params", str(PARAMS)]
    assert main([*gpt, "--max-new-tokens", "5"]) == 0
    assert "gptforge: 5 tokens in" in capsys.readouterr().err
    rc = main(gpt)
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        rc == 2
        and "int8 weights decode within the model's context: 2 prompt + 64 new tokens > block_size 16" in lines[-1]
    )
