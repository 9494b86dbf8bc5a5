"""The pretraining recipe in one process: schedule, exact resume after SIGKILL, AMP/compile, NaN
handling, outputs, and its bad inputs. On several processes (DDP, zero1, fsdp):
tests/test_train_distributed.py."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from cli_support import BIN, cli_env, error_lines
from pretrain_support import SMALL, _assert_same_final, losses, shards  # noqa: F401  (shards: a fixture)
from process_support import Paused, records_delivered, started
from safetensors.torch import load_file

from gptforge.config.load import load_config
from gptforge.errors import BadInput, StageFailed
from gptforge.training import loop as T
from gptforge.training import session


def small_cfg(small_tokenizer, *extra):
    return load_config(None, [*SMALL, f"tokenizer.path={small_tokenizer}", *extra])


def run_pretrain(cfg, shards: Path, out: Path) -> dict:
    return T.pretrain(
        cfg,
        data_dir=shards,
        out_dir=out / "checkpoints",
        metrics_path=out / "metrics.json",
        plots_path=out / "plots.csv",
    )


# ---------------------------------------------------------------------------------------------


def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = load_config(
        None, ["pretrain.lr=1.0", "pretrain.min_lr=0.1", "pretrain.warmup_steps=10", "pretrain.max_steps=110"]
    )
    assert T.lr_at(0, cfg) == pytest.approx(0.1) and T.lr_at(9, cfg) == pytest.approx(1.0)
    assert T.lr_at(10, cfg) == pytest.approx(1.0)
    assert T.lr_at(60, cfg) == pytest.approx(0.55)  # halfway through the cosine
    assert T.lr_at(110, cfg) == pytest.approx(0.1) and T.lr_at(500, cfg) == pytest.approx(0.1)
    values = [T.lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_batch_tokens_must_divide():
    cfg = load_config(None, ["pretrain.batch_tokens=1000", "pretrain.batch_size=12", "model.block_size=64"])
    with pytest.raises(BadInput, match=r"batch_tokens \(1000\) is not divisible by .*12\*64\*2 = 1536"):
        T.grad_accum_steps(cfg, 2)
    assert T.grad_accum_steps(load_config(None, ["pretrain.batch_tokens=3072"]), 2) == 2


def test_run_writes_metrics_plots_and_a_loadable_final_model(tmp_path, shards, small_tokenizer):
    from gptforge.modeling.weights import load_model

    cfg = small_cfg(small_tokenizer, "pretrain.max_steps=12")
    metrics = run_pretrain(cfg, shards, tmp_path)
    assert set(metrics) >= {"train_loss", "val_loss", "tokens", "tokens_per_sec", "mfu"}
    assert metrics["tokens"] == 12 * 64 and metrics["tokens_per_sec"] > 0
    assert json.loads((tmp_path / "metrics.json").read_text()) == pytest.approx(metrics)
    steps = losses(tmp_path / "plots.csv")
    assert sorted(steps) == list(range(12))
    assert steps[11] < steps[0]  # it learns: the corpus is 17 words
    with open(tmp_path / "plots.csv") as f:  # train_s: the steps' seconds before each row, rising
        seconds = [float(r["train_s"]) for r in csv.DictReader(f)]
    assert seconds[0] == 0 and all(b > a for a, b in zip(seconds[:12], seconds[1:12]))
    assert len(seconds) == 13 and seconds[12] > seconds[11]  # the whole-split row: after the last step
    model = load_model(tmp_path / "checkpoints/final")
    assert model.config.n_layer == 2 and model.config.n_vocab == 281
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["final", "step_00000010", "step_00000012"]  # keep_last=2


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, shards, small_tokenizer, monkeypatch):
    from gptforge.modeling.gpt import GPT

    real_forward = GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = real_forward(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] > 7:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    cfg = small_cfg(small_tokenizer, "pretrain.max_steps=20")
    with pytest.raises(
        StageFailed, match=r"loss is nan at step 7: stopping; the last good checkpoint is .*step_00000005"
    ):
        run_pretrain(cfg, shards, tmp_path)
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["step_00000005"]
    weights = load_file(tmp_path / "checkpoints/step_00000005/model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path, shards, small_tokenizer, monkeypatch):
    """ENOSPC in the middle of writing a checkpoint (a patched writer: half a file, then the
    error): the run stops with one clear error, the previous checkpoint verifies and resumes."""
    import errno

    from gptforge.training import checkpoint as ckpt

    real_save = ckpt.save_model
    calls = {"n": 0}

    def disk_fills_up(model, folder):
        calls["n"] += 1
        if calls["n"] == 2:
            (Path(folder) / "model.safetensors").write_bytes(b"half a file")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(model, folder)

    monkeypatch.setattr(ckpt, "save_model", disk_fills_up)
    cfg = small_cfg(small_tokenizer, "pretrain.max_steps=20")
    with pytest.raises(
        StageFailed,
        match=r"cannot write checkpoint .*step_00000010: No space left on device; "
        r"the previous checkpoints \(step_00000005\) are intact",
    ):
        run_pretrain(cfg, shards, tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000005"]  # no temporary left
    assert ckpt.verify(tmp_path / "checkpoints/step_00000005") is None
    monkeypatch.setattr(ckpt, "save_model", real_save)
    resumed = run_pretrain(small_cfg(small_tokenizer, "pretrain.max_steps=20"), shards, tmp_path)
    assert math.isfinite(resumed["val_loss"])


@pytest.mark.slow
def test_disk_full_on_a_real_small_filesystem(tmp_path, shards, small_tokenizer):
    """The same with a real full disk: a 1 MiB tmpfs holds two checkpoints of this model, not three."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the patched-writer test covers the logic")
    try:
        cfg = small_cfg(small_tokenizer, "pretrain.max_steps=40", "pretrain.keep_last=10")
        with pytest.raises(StageFailed, match=r"No space left on device; the previous checkpoints \(step_00000005"):
            run_pretrain(cfg, shards, mount)
        from gptforge.training import checkpoint as ckpt

        kept = ckpt.list_checkpoints(mount / "checkpoints")
        assert kept and all(ckpt.verify(k) is None for k in kept)
        assert not [p for p in (mount / "checkpoints").iterdir() if p.name.startswith(".")]  # no half-written folder
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# ---------------------------------------------------------------------------------------------
# Exact resume: SIGKILL after a checkpoint, `resume: auto`, bitwise equal final weights. The run
# to interrupt is paused after a checkpointed step (gptforge.runtime.pause), not raced.


def _cli(args, cwd, log: Path, **env):
    """`gptforge pretrain ARGS` running, its output to `log` (a paused run is not read from while
    it waits); killed on the way out if still running (a failed test leaves no paused run)."""
    return started(
        [str(BIN / "gptforge"), "pretrain", *args], cwd, cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", **env), log
    )


def _finished(args, cwd, log: Path, **env) -> str:
    """The output of a run that must end well (the timeout is a bound against a hang)."""
    with _cli(args, cwd, log, **env) as proc:
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    return log.read_text()


def _kill_args(small_tokenizer) -> list[str]:
    return [
        *sum((["-S", s] for s in SMALL), []),
        "-S",
        f"tokenizer.path={small_tokenizer}",
        "-S",
        "pretrain.max_steps=300",
        "-S",
        "pretrain.ckpt_interval=20",
        "-S",
        "pretrain.log_interval=50",
        "-S",
        "model.dropout=0.1",
    ]  # dropout: the RNG state must be restored too


def _workdir(root: Path, shards: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "data/pretrain").symlink_to(shards)
    return root


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shards, small_tokenizer) -> Path:
    """The reference: the 300-step run of the kill tests, never interrupted."""
    root = _workdir(tmp_path_factory.mktemp("straight"), shards)
    log = root.parent / f"{root.name}.log"
    _finished(_kill_args(small_tokenizer), root, log)
    return root


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, shards, small_tokenizer, uninterrupted):
    args = _kill_args(small_tokenizer)
    root = _workdir(tmp_path / "killed", shards)
    pause = Paused(tmp_path, 100)  # a checkpointed step (ckpt_interval 20), a third of the way
    log = tmp_path / "killed.log"
    ckpts = root / "checkpoints/pretrain"
    with _cli(args, root, log, **pause.env()) as killed:
        pause.wait(killed, output=log.read_text)
        assert (ckpts / "step_00000100/checksums.json").is_file()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    assert not (ckpts / "final").exists()

    log = tmp_path / "resumed.log"
    err = _finished(args, root, log)
    assert "resumed from" in err and "step_00000100 at step 100" in err, err[-3000:]
    _assert_same_final(uninterrupted, root)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_checkpoint_then_stop_and_mlflow_says_killed(
    tmp_path, shards, small_tokenizer, uninterrupted, mlflow_uri, sig
):
    """A polite stop (worker drained, docker stop, Ctrl-C) saves the step it is at, ends the
    MLflow run as KILLED, exits 128+signal; resuming from that checkpoint ends bit-identical.
    The signal comes while the run is paused after step 40: it is acted on at the end of step 41,
    a step no regular checkpoint falls on."""
    args = _kill_args(small_tokenizer) + ["-S", "tracking.enabled=true", "-S", f"tracking.experiment=stop-{sig.name}"]
    root = _workdir(tmp_path / "stopped", shards)
    pause = Paused(tmp_path, 40)
    log = tmp_path / "stopped.log"
    ckpts = root / "checkpoints/pretrain"
    with _cli(args, root, log, MLFLOW_TRACKING_URI=mlflow_uri, **pause.env()) as proc:
        pause.wait(proc, output=log.read_text)
        proc.send_signal(sig)
        pause.release_once_taken(proc, log)
        proc.wait(timeout=300)  # a bound against a hang: one more step and a checkpoint
    err = log.read_text()
    assert proc.returncode == 128 + sig, err[-3000:]
    last = err.strip().splitlines()[-1]
    step = pause.step + 1
    assert last.startswith(f"gptforge: pretrain stopped by {sig.name} at step {step};") and "Traceback" not in err, last
    assert (ckpts / f"step_{step:08d}" / "checksums.json").is_file()
    assert not (ckpts / "final").exists()
    records_delivered(root)  # a stopped stage leaves its records to the recorder

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name(f"stop-{sig.name}")
    [run] = client.search_runs([exp.experiment_id])
    assert run.info.status == "KILLED"

    log = tmp_path / "resumed.log"
    err = _finished(args, root, log, MLFLOW_TRACKING_URI=mlflow_uri)
    assert f"step_{step:08d} at step {step}" in err, err[-3000:]
    _assert_same_final(uninterrupted, root)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, shards, small_tokenizer, caplog):
    cfg = small_cfg(small_tokenizer, "pretrain.max_steps=10", "pretrain.keep_last=3")
    run_pretrain(cfg, shards, tmp_path)
    newest = tmp_path / "checkpoints/step_00000010/model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    cfg = small_cfg(small_tokenizer, "pretrain.max_steps=10", "pretrain.keep_last=3")
    with caplog.at_level("INFO", logger="gptforge"):
        run_pretrain(cfg, shards, tmp_path)
    text = caplog.text
    assert "step_00000010" in text and "model.safetensors" in text
    assert "resumed from" in text and "step_00000005 at step 5" in text


def test_resume_from_a_corrupt_checkpoint_names_the_file(tmp_path, shards, small_tokenizer):
    cfg = small_cfg(small_tokenizer, "pretrain.max_steps=5")
    run_pretrain(cfg, shards, tmp_path)
    folder = tmp_path / "checkpoints/step_00000005"
    state = folder / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    cfg = small_cfg(small_tokenizer, "pretrain.max_steps=5", f"pretrain.resume={folder}")
    with pytest.raises(BadInput, match=r"cannot resume from .*step_00000005: .*state\.pt"):
        run_pretrain(cfg, shards, tmp_path)


# ---------------------------------------------------------------------------------------------
# Bad inputs


def test_shards_missing(tmp_path, small_tokenizer):
    with pytest.raises(BadInput, match=r"manifest.json not found"):
        run_pretrain(small_cfg(small_tokenizer), tmp_path / "nowhere", tmp_path)


def test_shards_from_another_tokenizer(tmp_path, shards, gpt2_tokenizer_dir):
    cfg = load_config(None, [*SMALL, f"tokenizer.path={gpt2_tokenizer_dir}", "model.vocab_size=50304"])
    with pytest.raises(BadInput, match=r"made with tokenizer .*this run uses"):
        run_pretrain(cfg, shards, tmp_path)


def test_block_size_above_the_models_positions(tmp_path, shards, small_tokenizer):
    cfg = small_cfg(small_tokenizer, "pretrain.max_steps=2")
    run_pretrain(cfg, shards, tmp_path / "a")
    cfg = small_cfg(
        small_tokenizer,
        "model.block_size=32",
        "pretrain.batch_tokens=128",
        f"pretrain.init_from={tmp_path / 'a/checkpoints/final'}",
    )
    with pytest.raises(BadInput, match=r"model.block_size \(32\) is above the 16 positions of checkpoint"):
        run_pretrain(cfg, shards, tmp_path / "b")


def test_init_from_a_checkpoint_with_more_positions_crops_them(tmp_path, shards, small_tokenizer):
    from gptforge.modeling.weights import load_model

    cfg = small_cfg(small_tokenizer, "pretrain.max_steps=2", "model.block_size=32", "pretrain.batch_tokens=128")
    run_pretrain(cfg, shards, tmp_path / "a")
    source = load_model(tmp_path / "a/checkpoints/final")
    cfg = small_cfg(small_tokenizer, "pretrain.max_steps=1", f"pretrain.init_from={tmp_path / 'a/checkpoints/final'}")
    run_pretrain(cfg, shards, tmp_path / "b")
    cropped = load_model(tmp_path / "b/checkpoints/final")
    assert cropped.config.block_size == 16 and cropped.transformer.wpe.weight.shape == (16, 32)
    assert not torch.equal(cropped.transformer.wpe.weight, source.transformer.wpe.weight[:16])  # and it trained


@pytest.mark.slow  # three CLI processes
def test_cli_pretrain_bad_inputs_are_one_line(tmp_path):
    r = subprocess.run(
        [str(BIN / "gptforge"), "pretrain", "-S", "model.n_embd=130", "-S", "model.n_head=4"],
        cwd=tmp_path,
        env=cli_env(GPTFORGE_PREFECT="0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "gptforge: error: config with -S overrides: model.n_embd (130) is not divisible by model.n_head (4)"
    ]
    r = subprocess.run(
        [str(BIN / "gptforge"), "pretrain", "-S", "pretrain.batch_tokens=1000"],
        cwd=tmp_path,
        env=cli_env(GPTFORGE_PREFECT="0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and len(error_lines(r.stderr)) == 1 and "not divisible" in r.stderr
    r = subprocess.run(
        [str(BIN / "gptforge"), "pretrain"],
        cwd=tmp_path,
        env=cli_env(GPTFORGE_PREFECT="0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "run `gptforge prepare pretrain` first" in r.stderr


# ---------------------------------------------------------------------------------------------
# bf16 autocast and torch.compile on the CPU


def _first_losses(cfg, shards, out: Path, n=3) -> tuple[session.Session, list[float]]:
    """The recipe's own session (gptforge.training.loop.setup, as the stage builds it: runtime, model,
    torch.compile when pretrain.compile asks, optimizer, loader) and its first `n` losses."""
    s = T.setup(cfg, shards, out)
    return s, [
        T.train_step(
            s.model, s.raw_model, s.optimizer, s.scaler, s.train_loader, s.grad_accum, s.rt, lr=1e-3, grad_clip=1.0
        )[0]
        for _ in range(n)
    ]


def test_bf16_autocast_matches_fp32(tmp_path, shards, small_tokenizer):
    s, fp32 = _first_losses(small_cfg(small_tokenizer, "pretrain.precision=fp32"), shards, tmp_path / "fp32")
    assert s.rt.precision == "fp32"
    s, bf16 = _first_losses(small_cfg(small_tokenizer, "pretrain.precision=bf16"), shards, tmp_path / "bf16")
    assert s.rt.precision == "bf16"
    # bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2% per value); matmuls accumulate
    # in fp32, so the loss (a mean over 64 tokens of log-softmax in fp32) moves by well under 1%.
    for a, b in zip(fp32, bf16):
        assert math.isfinite(b) and abs(a - b) / a < 0.01, (a, b)
    assert fp32 != bf16  # autocast really changed the arithmetic


@pytest.mark.slow
def test_compile_matches_eager(tmp_path, shards, small_tokenizer):
    """pretrain.compile=true makes the recipe compile its model (dynamo captured and inductor
    compiled the training graphs), and the compiled steps give the eager losses."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch._dynamo.utils import counters

    s, eager = _first_losses(small_cfg(small_tokenizer, "pretrain.compile=false"), shards, tmp_path / "eager", n=2)
    assert not s.rt.compile and s.model is s.raw_model
    counters.clear()
    s, compiled = _first_losses(small_cfg(small_tokenizer, "pretrain.compile=true"), shards, tmp_path / "compiled", n=2)
    assert s.rt.compile and isinstance(s.model, OptimizedModule) and s.model._orig_mod is s.raw_model
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters)  # dynamo captured the forward
    assert counters["inductor"], dict(counters)  # and inductor compiled it (or took it from its cache)
    # Same fp32 math; inductor fuses and may reorder reductions: differences at fp32 rounding.
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 1e-4 * abs(a), (a, b)
