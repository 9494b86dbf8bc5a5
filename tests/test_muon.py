"""`pretrain.optimizer: muon`: torch's Muon for the blocks' matrices, AdamW for the rest
(gptforge.training.optim.muon_adamw), against its definition and through exact resume.

- Which parameter goes where: every block's linear weights to Muon; embeddings (the tied head),
  norms and biases to AdamW; each group's `lr_scale`.
- Two steps of the pair against the formulas computed here: Muon's Nesterov momentum (`buf <-
  m buf + (1 - m) g`, update `(1 - m) g + m buf`, as lerps: float32's rounding of them decides
  roundings in bf16 later), the quintic Newton-Schulz iteration on the
  update (coefficients 3.4445, -4.7750, 2.0315, five steps, on the transpose of a tall matrix,
  after dividing by the Frobenius norm, in bf16 as torch runs it), the lr scaled by
  sqrt(max(1, rows / cols)) and decoupled decay; AdamW's moments and bias correction in float64.
  Within 1e-6.
- A run under muon SIGKILLed after a checkpoint and resumed ends bitwise equal to the same run
  uninterrupted; its loss falls; the fingerprint tells muon and adamw runs apart; muon with
  zero1 or fsdp is one line.
"""

from __future__ import annotations

import math
import signal

import pytest
import torch
from pretrain_support import SMALL, _assert_same_final, losses, shards  # noqa: F401  (shards: a fixture)
from process_support import Paused
from test_train import _cli, _finished, _kill_args, _workdir

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.training.optim import hidden_matrices, muon_adamw
from gptforge.training.session import fingerprint

A, B, C = 3.4445, -4.7750, 2.0315


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, n_vocab=64, bias=True))


def build(model, **kw):
    args = dict(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), muon_lr=0.02, muon_momentum=0.95)
    args.update(kw)
    return muon_adamw(model, muon_weight_decay=args.pop("muon_weight_decay", 0.05), device_type="cpu", **args)


def test_the_blocks_matrices_go_to_muon_and_the_rest_to_adamw():
    model = tiny_gpt()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build(model)
    muon = sorted(names[id(p)] for g in opt.muon.param_groups for p in g["params"])
    adam = sorted(names[id(p)] for g in opt.adamw.param_groups for p in g["params"])
    assert muon == sorted(
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    assert "transformer.wte.weight" in adam and "transformer.wpe.weight" in adam  # wte is the tied head too
    assert all(".ln_" in n or n.endswith(".bias") or ".wte." in n or ".wpe." in n for n in adam), adam
    assert sorted(muon + adam) == sorted(names.values())  # every parameter once
    assert [g["lr_scale"] for g in opt.muon.param_groups] == [2.0]
    assert {g["lr_scale"] for g in opt.adamw.param_groups} == {1.0}
    assert [p for p in hidden_matrices(model)] == [p for g in opt.muon.param_groups for p in g["params"]]


def newton_schulz(update: torch.Tensor) -> torch.Tensor:
    x = update.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=B, alpha=C), x, beta=A)
    return x.T if tall else x


def test_two_steps_equal_muon_and_adamw_computed_by_hand():
    model = tiny_gpt()
    opt = build(model)
    lr, m, wd_muon, wd = 0.004, 0.95, 0.05, 0.1
    b1, b2, eps = 0.9, 0.95, 1e-8
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    grads = [{n: torch.randn(p.shape, generator=g) * 0.1 for n, p in model.named_parameters()} for _ in range(2)]
    for step_grads in grads:
        for n, p in model.named_parameters():
            p.grad = step_grads[n].clone()
        for group in opt.param_groups:  # as the loop sets them
            group["lr"] = lr * group["lr_scale"]
        opt.step()

    # Muon on a wide (c_attn: 96 x 32 is tall) and a square matrix
    for name in (
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.1.attn.c_proj.weight",
        "transformer.h.0.mlp.c_proj.weight",
    ):
        w, buf = start[name].clone(), torch.zeros_like(start[name])
        muon_lr = lr * 2.0
        for step_grads in grads:
            grad = step_grads[name]
            # m buf + (1 - m) g and (1 - m) g + m buf, as lerps: in float32 the rounding decides
            # bf16 roundings in Newton-Schulz, so the reference rounds where torch does
            buf = torch.lerp(buf, grad, 1 - m)
            update = newton_schulz(torch.lerp(grad, buf, m))
            rows, cols = w.shape
            w = w * (1 - muon_lr * wd_muon) - muon_lr * math.sqrt(max(1.0, rows / cols)) * update.float()
        got = dict(model.named_parameters())[name].detach()
        assert (got - w).abs().max() < 1e-6, (name, (got - w).abs().max())
        assert not torch.equal(got, start[name])
    # AdamW on an embedding (decayed) and a bias (not), in float64
    for name, decay in (("transformer.wte.weight", wd), ("transformer.h.0.attn.c_attn.bias", 0.0)):
        w = start[name].double()
        m1, m2 = torch.zeros_like(w), torch.zeros_like(w)
        for t, step_grads in enumerate(grads, 1):
            grad = step_grads[name].double()
            m1, m2 = b1 * m1 + (1 - b1) * grad, b2 * m2 + (1 - b2) * grad * grad
            w = w * (1 - lr * decay) - lr * (m1 / (1 - b1**t)) / ((m2 / (1 - b2**t)).sqrt() + eps)
        got = dict(model.named_parameters())[name].detach().double()
        assert (got - w).abs().max() < 1e-6, (name, (got - w).abs().max())
    # the state holds both, and loads into a new pair
    state = opt.state_dict()
    assert set(state) == {"muon", "adamw"}
    again = build(model)
    again.load_state_dict(state)
    assert again.state_dict()["muon"]["state"][0]["momentum_buffer"].equal(state["muon"]["state"][0]["momentum_buffer"])


def test_muon_is_in_the_fingerprint_and_only_with_ddp(small_tokenizer):
    manifest = {"shards": [{"sha256": "x"}]}
    cfg = lambda *s: load_config(None, [*SMALL, f"tokenizer.path={small_tokenizer}", *s])  # noqa: E731
    adamw, muon = fingerprint(cfg(), manifest, 1), fingerprint(cfg("pretrain.optimizer=muon"), manifest, 1)
    assert adamw != muon
    assert fingerprint(cfg("pretrain.optimizer=muon", "pretrain.muon_lr=0.01"), manifest, 1) != muon
    assert fingerprint(cfg("pretrain.muon_lr=0.01"), manifest, 1) == adamw  # unused under adamw
    for strategy in ("zero1", "fsdp"):
        with pytest.raises(BadInput, match=f"pretrain.optimizer muon runs with pretrain.strategy ddp, not {strategy}"):
            cfg("pretrain.optimizer=muon", f"pretrain.strategy={strategy}")


@pytest.mark.slow
def test_sigkill_then_resume_under_muon_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, shards, small_tokenizer):
    args = _kill_args(small_tokenizer) + ["-S", "pretrain.optimizer=muon", "-S", "pretrain.max_steps=60"]
    straight = _workdir(tmp_path / "straight", shards)
    _finished(args, straight, tmp_path / "straight.log")
    curve = losses(straight / "plots/pretrain.csv")
    assert curve[max(curve)] < curve[min(curve)] - 0.5, curve  # muon trains

    root = _workdir(tmp_path / "killed", shards)
    pause = Paused(tmp_path, 40)  # a checkpointed step (ckpt_interval 20)
    log = tmp_path / "killed.log"
    ckpts = root / "checkpoints/pretrain"
    with _cli(args, root, log, **pause.env()) as killed:
        pause.wait(killed, output=log.read_text)
        assert (ckpts / "step_00000040/checksums.json").is_file()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    err = _finished(args, root, tmp_path / "resumed.log")
    assert "resumed from" in err and "step_00000040 at step 40" in err, err[-3000:]
    _assert_same_final(straight, root)
