"""The pretraining recipe on two gloo processes on the CPU: DDP equals one process with the same
global batch; zero1 and fsdp follow DDP step for step and resume exactly after a SIGKILL; fsdp's
activation checkpointing and no-reshard knobs change memory, not the math; and each sharded
strategy keeps about half the training state on each process, as `gptforge plan` says. In one
process: tests/test_train.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from cli_support import BIN, cli_env
from pretrain_support import SMALL, _assert_same_final, losses, shards  # noqa: F401  (shards: a fixture)
from process_support import Paused

from gptforge.config.load import load_config
from gptforge.modeling.gpt import GPT, GPTConfig

# ---------------------------------------------------------------------------------------------
# DDP (gloo, 2 processes) == one process with the same global batch


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(tmp_path, shards, small_tokenizer):
    common = [*SMALL, f"tokenizer.path={small_tokenizer}", "pretrain.max_steps=6", "pretrain.batch_tokens=128"]
    args = sum((["-S", s] for s in common), [])
    for name in ("one", "ddp"):
        (tmp_path / name / "data").mkdir(parents=True)
        (tmp_path / name / "data/pretrain").symlink_to(shards)
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1")
    one = subprocess.run(
        [str(BIN / "gptforge"), "pretrain", *args],
        cwd=tmp_path / "one",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr
    ddp = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(BIN / "gptforge"), "pretrain", *args],
        cwd=tmp_path / "ddp",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    a, b = losses(tmp_path / "one/plots/pretrain.csv"), losses(tmp_path / "ddp/plots/pretrain.csv")
    assert sorted(a) == sorted(b) == list(range(6))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])


def _torchrun(folder: Path, shards: Path, args: list[str], env: dict, dry: bool = False):
    """`gptforge pretrain` on 2 processes in `folder` (made, with the shards linked in); `dry`:
    the folder only."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    if not (folder / "data/pretrain").exists():
        (folder / "data/pretrain").symlink_to(shards)
    if dry:
        return None
    return subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(BIN / "gptforge"), "pretrain", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


ACCUM_CLIP = ["pretrain.batch_tokens=256", "pretrain.grad_clip=0.5", "pretrain.max_steps=20"]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory, shards, small_tokenizer) -> Path:
    """DDP on 2 gloo processes, gradient accumulation 2 and clipping on, 20 steps: the run the
    sharded strategies are held to."""
    folder = tmp_path_factory.mktemp("ddp")
    args = sum((["-S", s] for s in [*SMALL, f"tokenizer.path={small_tokenizer}", *ACCUM_CLIP]), [])
    done = _torchrun(folder, shards, args, cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_sharded_strategy_follows_ddp_step_for_step_and_resumes_exactly(
    tmp_path, shards, small_tokenizer, ddp_reference, strategy
):
    """pretrain.strategy zero1 / fsdp on 2 gloo processes, gradient accumulation 2 and clipping on:
    the loss curve of DDP within 1e-5 (relative) for 20 steps; and a run SIGKILLed after step 10
    (its checkpoint: zero1's consolidated optimizer state; fsdp's shards, one file per process)
    and resumed ends bitwise as the uninterrupted one."""
    common = [*SMALL, f"tokenizer.path={small_tokenizer}", *ACCUM_CLIP, f"pretrain.strategy={strategy}"]
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1")

    def run(name: str) -> subprocess.CompletedProcess:
        done = _torchrun(tmp_path / name, shards, sum((["-S", s] for s in common), []), env)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    run("straight")
    ddp, sharded = losses(ddp_reference / "plots/pretrain.csv"), losses(tmp_path / "straight/plots/pretrain.csv")
    assert sorted(ddp) == sorted(sharded) == list(range(20))
    for step in ddp:
        assert abs(ddp[step] - sharded[step]) <= 1e-5 * abs(ddp[step]), (step, ddp[step], sharded[step])

    killed = tmp_path / "killed"
    pause = Paused(tmp_path, 10)  # after step 10 and its checkpoint (ckpt_interval 5)
    _torchrun(killed, shards, [], env, dry=True)
    args = sum((["-S", s] for s in common), [])
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(BIN / "gptforge"), "pretrain", *args],
            cwd=killed,
            env={**env, **pause.env()},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            pause.wait(proc, output=(tmp_path / "killed.log").read_text)
            # torchrun's workers run in process groups of their own: every process of the job.
            job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            for p in job:
                p.kill()
            proc.wait()
            _, alive = psutil.wait_procs(job, timeout=30)
            assert not alive
        finally:
            pause.release()
    step10 = killed / "checkpoints/pretrain/step_00000010"
    if strategy == "fsdp":  # each process wrote its own shards, all under the checksums
        sums = json.loads((step10 / "checksums.json").read_text())["files"]
        assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata", "state.pt", "config.json"} <= set(sums)
        assert not (step10 / "model.safetensors").exists()
    resumed = run("killed")
    assert "step_00000010 at step 10" in resumed.stderr, resumed.stderr[-3000:]
    _assert_same_final(tmp_path / "straight", killed)

    if strategy == "fsdp":
        # Written by 2 processes, read in this one: the same logits as the whole model the run
        # gathered at its end (final/, an ordinary model.safetensors).
        from gptforge.modeling.weights import load_model

        from_shards = load_model(killed / "checkpoints/pretrain/step_00000020")
        whole = load_model(killed / "checkpoints/pretrain/final")
        idx = torch.randint(0, 280, (2, 16), generator=torch.Generator().manual_seed(0))
        assert torch.equal(from_shards(idx)[0], whole(idx)[0])


@pytest.mark.slow
def test_fsdp_with_activation_checkpointing_and_no_reshard_follows_ddp(
    tmp_path, shards, small_tokenizer, ddp_reference
):
    """The two fsdp knobs change memory, not the math: each block recomputed in the backward and
    its weights kept gathered from forward to backward, the losses stay DDP's within 1e-5."""
    args = sum(
        (
            ["-S", s]
            for s in [
                *SMALL,
                f"tokenizer.path={small_tokenizer}",
                *ACCUM_CLIP,
                "pretrain.strategy=fsdp",
                "pretrain.activation_checkpointing=true",
                "pretrain.fsdp_reshard_after_forward=false",
            ]
        ),
        [],
    )
    done = _torchrun(tmp_path, shards, args, cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    ddp, knobs = losses(ddp_reference / "plots/pretrain.csv"), losses(tmp_path / "plots/pretrain.csv")
    assert sorted(ddp) == sorted(knobs) == list(range(20))
    for step in ddp:
        assert abs(ddp[step] - knobs[step]) <= 1e-5 * abs(ddp[step]), (step, ddp[step], knobs[step])


# The memory test's model: a small vocabulary, so that no single parameter dominates (in the tiny
# config the tied 50k-row embedding is most of the model, and zero1 splits by whole parameters).
MEMORY_MODEL = dict(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=64, n_vocab=64)


def _state_bytes(rank: int, world: int, store: str, strategy: str, out: str) -> None:
    import torch.distributed as dist

    from gptforge.training import sharding
    from gptforge.training.optim import adamw, zero1_adamw
    from gptforge.training.parallelize import parallelize
    from gptforge.training.runtime import Runtime

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MEMORY_MODEL))
    if strategy == "fsdp":
        rt = Runtime(device=torch.device("cpu"), rank=rank, world_size=world, ddp=True)
        parallelize(model, rt, strategy="fsdp", param="pretrain")
    build = zero1_adamw if strategy == "zero1" else adamw
    opt = build(model.parameters(), lr=1e-3, weight_decay=0.1, device_type="cpu")
    model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))[1].backward()
    opt.step()
    Path(f"{out}.{rank}").write_text(json.dumps(sharding.state_bytes(model, opt)))
    dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_strategies_keep_about_half_the_training_state_on_each_of_two_processes(tmp_path):
    """Per process, counted from the tensors each holds after a step: zero1 about half the
    optimizer states, fsdp about half of parameters + gradients + optimizer states."""
    import torch.multiprocessing as mp

    per_rank = {}
    for strategy in ("ddp", "zero1", "fsdp"):
        out = tmp_path / strategy
        mp.spawn(_state_bytes, args=(2, str(tmp_path / f"store-{strategy}"), strategy, str(out)), nprocs=2)
        per_rank[strategy] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    print(per_rank)
    whole = per_rank["ddp"][0]
    assert per_rank["ddp"] == [whole, whole]
    assert whole["params"] == whole["grads"] and whole["optimizer"] == 2 * whole["params"]  # AdamW: two moments
    zero1 = [r["optimizer"] for r in per_rank["zero1"]]
    assert all(b <= 0.55 * whole["optimizer"] for b in zero1) and sum(zero1) == whole["optimizer"]
    total = sum(whole.values())
    fsdp = [sum(r.values()) for r in per_rank["fsdp"]]
    assert all(b <= 0.55 * total for b in fsdp) and sum(fsdp) == total, (fsdp, total)

    # `gptforge plan`'s figures for the same model on 2 GPUs: within 5% of what each process held.
    from gptforge.training import memory_plan

    m = MEMORY_MODEL
    cfg = load_config(
        None,
        [
            f"model.n_layer={m['n_layer']}",
            f"model.n_head={m['n_head']}",
            f"model.n_embd={m['n_embd']}",
            f"model.block_size={m['block_size']}",
            f"model.vocab_size={m['vocab_size']}",
        ],
    )
    planned = {r.strategy: r for r in memory_plan.state_rows(memory_plan.gpt_shape(cfg), gpus=2)}
    for strategy, ranks in per_rank.items():
        for measured in ranks:
            for part, attr in (("params", "weights"), ("grads", "grads"), ("optimizer", "optimizer")):
                got = getattr(planned[strategy], attr)
                assert abs(got - measured[part]) <= 0.05 * measured[part], (strategy, part, got, measured[part])
