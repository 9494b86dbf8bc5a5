"""`model.arch: llama` against transformers' LlamaForCausalLM with the same weights (the
independent reference): logits within 1e-5 in float32 and gradients too, with grouped-query
attention and a tied or untied head; our KV-cache greedy decode token for token against
transformers' `generate`; the exported Hugging Face folder and a round trip through it give the
same logits; and the config's rules (llama keys refused under gpt2, old checkpoints read as gpt2)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.modeling.decoding import generate
from gptforge.modeling.export import export_hf
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.hf_convert import from_hf, load_pretrained, to_hf
from gptforge.modeling.hf_llama import llama_hf_state_dict
from gptforge.modeling.weights import load_model, save_model
from gptforge.training.loop import build_model

N_VOCAB = 50257


def _config(**kw) -> GPTConfig:
    base = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, n_vocab=N_VOCAB, arch="llama", n_kv_head=2, bias=False)
    return GPTConfig(**{**base, **kw})


def _perturbed(config: GPTConfig) -> GPT:
    # Non-unit RMSNorm gains and larger weights: a tensor dropped, split wrongly or transposed shows.
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    return model.eval()


def _tokens(T: int = 32) -> torch.Tensor:
    return torch.randint(0, N_VOCAB, (2, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # grouped-query attention (4 query heads, 2 key/value heads), tied head
        dict(n_kv_head=4, tie_embeddings=False, rope_theta=500000.0, attention="math"),
        dict(n_kv_head=1, bias=True, ffn_hidden=96),
    ],
    ids=["gqa-tied", "mha-untied-math", "mqa-bias"],
)
def test_logits_and_gradients_equal_transformers_llama(kw):
    model = _perturbed(_config(**kw))
    hf = to_hf(model).float()
    assert isinstance(hf, transformers.LlamaForCausalLM)
    idx = _tokens()
    ours, _ = model(idx)
    want = hf(idx).logits
    torch.testing.assert_close(ours[..., :N_VOCAB], want, rtol=1e-5, atol=1e-5)
    assert torch.isinf(ours[..., N_VOCAB:]).all()

    # Gradients of the same loss, compared under transformers' names (our fused matrices split).
    model.train(), hf.train()
    targets = _tokens().roll(1, dims=1)
    _, loss = model(idx, targets)
    loss.backward()
    want_loss = torch.nn.functional.cross_entropy(hf(idx).logits.flatten(0, 1), targets.flatten())
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    ours_grads = _grads_by_hf_name(model)
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    assert set(ours_grads) == set(hf_grads)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(ours_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def _grads_by_hf_name(model: GPT) -> dict[str, torch.Tensor]:
    """Our gradients under transformers' names, through the same splitting as the weights."""
    saved = {k: p.detach().clone() for k, p in model.named_parameters()}
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(p.grad)
    grads = llama_hf_state_dict(model)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(saved[k])
    if model.config.tie_embeddings:  # the tied matrix's gradient is the embedding's and the head's
        grads["model.embed_tokens.weight"] = model.transformer.wte.weight.grad[:N_VOCAB]
    return grads


def test_kv_cache_greedy_decode_equals_transformers_generate():
    model = _perturbed(_config(block_size=64))
    hf = to_hf(model).float()
    prompt = _tokens(7)[:1]
    ours = generate(model, prompt, 24, temperature=0.0)
    uncached = generate(model, prompt, 24, temperature=0.0, use_cache=False)
    want = hf.generate(prompt, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert ours.tolist() == want.tolist() == uncached.tolist()


def test_export_folder_and_round_trip_give_the_same_logits(tmp_path, gpt2_tokenizer_dir):
    model = _perturbed(_config(tie_embeddings=False))
    save_model(model, tmp_path / "ckpt")
    assert load_model(tmp_path / "ckpt").config == model.config
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf", str(gpt2_tokenizer_dir))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is False
    idx = _tokens()
    with torch.no_grad():
        want = model(idx)[0][..., :N_VOCAB]
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        torch.testing.assert_close(hf(idx).logits, want, rtol=1e-5, atol=1e-5)
        back, source = load_pretrained(str(out), param="pretrain.init_from")
        assert source.startswith("Hugging Face Llama folder") and back.config.arch == "llama"
        torch.testing.assert_close(back(idx)[0][..., :N_VOCAB], want, rtol=1e-5, atol=1e-5)
        again = from_hf(to_hf(back))
        torch.testing.assert_close(again(idx)[0], back(idx)[0], rtol=0, atol=0)


def test_pretrain_builds_the_llama_arch_from_params():
    cfg = load_config(None, ["model.arch=llama", "model.n_kv_head=2", "model.tie_embeddings=false"])
    model = build_model(cfg, N_VOCAB)
    c = model.config
    assert (c.arch, c.n_kv_head, c.tie_embeddings, c.bias, c.ffn_hidden) == ("llama", 2, False, False, 384)
    assert "wpe" not in model.transformer and model.lm_head.weight is not model.transformer.wte.weight
    # the untied embedding is a lookup: not in the FLOP-bearing count; the head is
    assert model.num_params() == sum(p.numel() for p in model.parameters()) - model.transformer.wte.weight.numel()


def test_llama_keys_under_gpt2_are_refused_in_one_line():
    with pytest.raises(BadInput) as err:
        load_config(None, ["model.n_kv_head=2"])
    assert "model.n_kv_head is a llama key" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(BadInput, match="n_head .4. is not a multiple of model.n_kv_head .3."):
        load_config(None, ["model.arch=llama", "model.n_kv_head=3"])


def test_a_checkpoint_from_before_the_llama_keys_reads_as_gpt2(tmp_path):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    save_model(model, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    for key in ("arch", "n_kv_head", "rope_theta", "ffn_hidden", "norm_eps", "tie_embeddings"):
        d.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert load_model(tmp_path).config == model.config
