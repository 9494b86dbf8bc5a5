"""gptforge.training.parallelize: activation checkpointing from outside the model, and the one
place that wraps a model for data-parallel training.

Against the plain model as the reference: with checkpointing on, each transformer layer's forward
runs twice per training step (once more in the backward pass: it really recomputes), the loss and
every gradient equal the plain model's (our GPT in both architectures, a transformers Llama), the
state dict keeps its names, evaluation under no_grad and KV-cache decoding give the same logits,
and stripping the wrappers gives back the model's own layers. (The GPT gradient check moved here
from tests/test_finetune_instruct_hf.py when checkpointing left the model.) Two-process runs
through pretraining and fine-tuning are tests/test_train_distributed.py's and
tests/test_finetune_distributed.py's.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.training.parallelize import parallelize, strip_activation_checkpointing, transformer_layers
from gptforge.training.runtime import Runtime

ONE = Runtime(device=torch.device("cpu"))
SRC = Path(__file__).resolve().parents[1] / "src" / "gptforge"


def _gpt(arch: str) -> GPT:
    torch.manual_seed(0)
    extra = {"arch": "llama", "n_kv_head": 1} if arch == "llama" else {}
    return GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64, n_vocab=64, dropout=0.0, **extra)
    )


def _llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg)


def _loss(model, idx):
    if isinstance(model, GPT):
        return model(idx[:, :-1], idx[:, 1:])[1]
    return model(input_ids=idx, labels=idx).loss


def _count_forwards(model) -> list[int]:
    calls = [0]
    for layer in transformer_layers(model):
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))  # (the recompute stops early)
    return calls


@pytest.mark.parametrize(
    "make", [lambda: _gpt("gpt2"), lambda: _gpt("llama"), _llama], ids=["gpt2", "llama", "hf-llama"]
)
def test_checkpointed_layers_recompute_and_give_the_plain_gradients(make):
    plain = make()
    recomputed = copy.deepcopy(plain)
    keys = list(plain.state_dict())
    counts = {"plain": _count_forwards(plain), "recomputed": _count_forwards(recomputed)}
    wrapped = parallelize(recomputed, ONE, strategy="ddp", param="test", activation_checkpointing=True)
    assert wrapped is recomputed  # one process: no data-parallel wrapper
    assert list(recomputed.state_dict()) == keys  # the names saved and loaded stay the model's
    idx = torch.randint(0, 64, (3, 32), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name, model in (("plain", plain), ("recomputed", recomputed)):
        model.train()
        losses[name] = _loss(model, idx)
        losses[name].backward()
    assert counts["plain"][0] == 2  # each of the 2 layers once
    assert counts["recomputed"][0] == 4  # and once more each in the backward pass
    torch.testing.assert_close(losses["recomputed"], losses["plain"], atol=0, rtol=0)
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)

    # Evaluation through the wrappers, then without them: the plain model's logits
    plain.eval(), recomputed.eval()
    with torch.no_grad():
        torch.testing.assert_close(_loss(recomputed, idx), _loss(plain, idx), atol=0, rtol=0)
    strip_activation_checkpointing(recomputed)
    assert [type(m) for m in recomputed.modules()] == [type(m) for m in plain.modules()]


def test_kv_cache_decoding_through_checkpointed_blocks_is_the_plain_decoding():
    from gptforge.modeling.decoding import generate

    plain = _gpt("gpt2").eval()
    wrapped = copy.deepcopy(plain)
    parallelize(wrapped, ONE, strategy="ddp", param="test", activation_checkpointing=True)
    prompt = torch.tensor([[1, 2, 3, 4]])
    a = generate(plain, prompt, 12, temperature=0.0)
    b = generate(wrapped.eval(), prompt, 12, temperature=0.0)
    assert torch.equal(a, b)


def test_only_parallelize_wraps_models_for_data_parallel_training():
    """Pretraining and fine-tuning share one wrapping: FSDP's fully_shard, DDP and
    checkpoint_wrapper are called in gptforge.training.parallelize and nowhere else in src/."""
    calls = re.compile(r"\b(fully_shard|DistributedDataParallel|DDP|checkpoint_wrapper)\(")
    found = {
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if any(calls.search(line) for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    }
    assert found == {"training/parallelize.py"}
