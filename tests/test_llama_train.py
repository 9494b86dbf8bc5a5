"""The pretraining recipe with `model.arch: llama` (grouped-query attention, an untied head):
bf16 autocast within 1% of fp32 and torch.compile at fp32's rounding of eager, as for gpt2
(tests/test_train.py); a run SIGKILLed after a checkpoint and resumed (under muon, so both of
issue 48's additions) ends bitwise equal to the uninterrupted one; and on 2 gloo processes fsdp's
losses follow ddp's within 1e-5 for 20 steps (tests/test_train_distributed.py's protocol)."""

from __future__ import annotations

import math
import signal

import pytest
from cli_support import cli_env
from pretrain_support import SMALL, _assert_same_final, losses, shards  # noqa: F401  (shards: a fixture)
from process_support import Paused
from test_train import _cli, _finished, _first_losses, _kill_args, _workdir, small_cfg
from test_train_distributed import ACCUM_CLIP, _torchrun

LLAMA = ["model.arch=llama", "model.n_kv_head=1", "model.tie_embeddings=false"]


def test_bf16_autocast_and_the_llama_parts_train(tmp_path, shards, small_tokenizer):
    s, fp32 = _first_losses(small_cfg(small_tokenizer, *LLAMA, "pretrain.precision=fp32"), shards, tmp_path / "a")
    assert s.raw_model.config.arch == "llama" and s.raw_model.config.n_kv_head == 1
    s, bf16 = _first_losses(small_cfg(small_tokenizer, *LLAMA, "pretrain.precision=bf16"), shards, tmp_path / "b")
    for a, b in zip(fp32, bf16):
        assert math.isfinite(b) and abs(a - b) / a < 0.01, (a, b)
    assert fp32 != bf16 and fp32[-1] < fp32[0]


@pytest.mark.slow
def test_compile_matches_eager_for_llama(tmp_path, shards, small_tokenizer):
    _, eager = _first_losses(small_cfg(small_tokenizer, *LLAMA, "pretrain.compile=false"), shards, tmp_path / "e", n=2)
    s, compiled = _first_losses(
        small_cfg(small_tokenizer, *LLAMA, "pretrain.compile=true"), shards, tmp_path / "c", n=2
    )
    assert s.rt.compile and s.model is not s.raw_model
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 1e-4 * abs(a), (a, b)


@pytest.mark.slow
def test_sigkill_then_resume_under_llama_and_muon_is_bitwise_equal(tmp_path, shards, small_tokenizer):
    args = _kill_args(small_tokenizer) + sum((["-S", s] for s in LLAMA), [])
    args += ["-S", "pretrain.optimizer=muon", "-S", "pretrain.max_steps=60"]
    straight = _workdir(tmp_path / "straight", shards)
    _finished(args, straight, tmp_path / "straight.log")
    curve = losses(straight / "plots/pretrain.csv")
    assert curve[max(curve)] < curve[min(curve)] - 0.5, curve

    root = _workdir(tmp_path / "killed", shards)
    pause = Paused(tmp_path, 40)  # a checkpointed step (ckpt_interval 20)
    log = tmp_path / "killed.log"
    with _cli(args, root, log, **pause.env()) as killed:
        pause.wait(killed, output=log.read_text)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    err = _finished(args, root, tmp_path / "resumed.log")
    assert "step_00000040 at step 40" in err, err[-3000:]
    _assert_same_final(straight, root)


@pytest.mark.slow
def test_fsdp_follows_ddp_for_llama_on_two_processes(tmp_path, shards, small_tokenizer):
    common = [*SMALL, f"tokenizer.path={small_tokenizer}", *ACCUM_CLIP, *LLAMA]
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1")
    curves = {}
    for strategy in ("ddp", "fsdp"):
        args = sum((["-S", s] for s in [*common, f"pretrain.strategy={strategy}"]), [])
        done = _torchrun(tmp_path / strategy, shards, args, env)
        assert done.returncode == 0, done.stderr[-3000:]
        curves[strategy] = losses(tmp_path / strategy / "plots/pretrain.csv")
    ddp, fsdp = curves["ddp"], curves["fsdp"]
    assert sorted(ddp) == sorted(fsdp) == list(range(20))
    for step in ddp:
        assert abs(ddp[step] - fsdp[step]) <= 1e-5 * abs(ddp[step]), (step, ddp[step], fsdp[step])
