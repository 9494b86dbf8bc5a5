"""Checkpoints: atomic step folders, pruning, checksums, fallback to the newest good one, safe loading."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from gptforge.errors import BadInput
from gptforge.io import sha256_file
from gptforge.training.checkpoint import (
    capture_rng,
    list_checkpoints,
    load_state,
    newest_good,
    restore_rng,
    save_checkpoint,
    step_of,
    verify,
)

FILES = ("model.safetensors", "config.json", "state.pt")


def fake_model(tag: str):
    """A `write_model` that writes what weights.save_model would: weights and their config."""

    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(f"weights of {tag}".encode() * 100)
        (folder / "config.json").write_text(json.dumps({"tag": tag}))

    return write


def a_state(step: int) -> dict:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=1e-3, betas=(0.9, 0.95))
    opt.step()  # AdamW state: step tensors, exp_avg, nested dicts, tuples, None
    return {
        "step": step,
        "optimizer": opt.state_dict(),
        "loader": {"epoch": 0, "position": step},
        "rng": capture_rng(),
        "loss": 1.5,
        "name": "run",
    }


def save(root: Path, step: int, keep_last: int | None = 3) -> Path:
    return save_checkpoint(root, step, write_model=fake_model(f"step {step}"), state=a_state(step), keep_last=keep_last)


# ---------------------------------------------------------------------------------------------
# Saving, listing, pruning


def test_save_writes_the_files_and_their_checksums(tmp_path):
    folder = save(tmp_path / "ckpt", 42)
    assert folder == tmp_path / "ckpt" / "step_00000042"
    assert sorted(p.name for p in folder.iterdir()) == sorted([*FILES, "checksums.json"])
    sums = json.loads((folder / "checksums.json").read_text())["files"]
    assert sorted(sums) == sorted(FILES)
    assert verify(folder) is None
    assert step_of(folder) == 42
    state = load_state(folder)
    assert state["step"] == 42 and state["loader"] == {"epoch": 0, "position": 42}
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]  # no temporary left


def test_list_sorts_by_step_and_skips_other_names(tmp_path):
    root = tmp_path / "ckpt"
    for step in (1000, 20, 300):
        save(root, step, keep_last=None)
    for name in ("final", ".step_00000999.abc.tmp", "step_12x", "notes"):
        (root / name).mkdir()
    (root / "step_00000005").write_text("a file, not a folder")
    assert [p.name for p in list_checkpoints(root)] == ["step_00000020", "step_00000300", "step_00001000"]
    assert list_checkpoints(tmp_path / "absent") == []


def test_keep_last_prunes_the_oldest_but_never_final(tmp_path):
    root = tmp_path / "ckpt"
    (root / "final").mkdir(parents=True)
    (root / "final" / "model.safetensors").write_bytes(b"final")
    for step in range(0, 60, 10):
        save(root, step, keep_last=2)
    assert [step_of(p) for p in list_checkpoints(root)] == [40, 50]
    assert (root / "final" / "model.safetensors").read_bytes() == b"final"


def test_keep_last_never_removes_the_one_just_written(tmp_path):
    """Resumed from step 20 after step 30 was found damaged: the new step 25 stays."""
    root = tmp_path / "ckpt"
    for step in (10, 20, 30):
        save(root, step, keep_last=None)
    save(root, 25, keep_last=1)
    assert [step_of(p) for p in list_checkpoints(root)] == [25]
    save(root, 26, keep_last=2)
    assert [step_of(p) for p in list_checkpoints(root)] == [25, 26]


def test_saving_a_step_again_replaces_it(tmp_path):
    root = tmp_path / "ckpt"
    save(root, 7)
    save_checkpoint(root, 7, write_model=fake_model("again"), state={"step": 7}, keep_last=3)
    assert json.loads((root / "step_00000007" / "config.json").read_text()) == {"tag": "again"}
    assert verify(root / "step_00000007") is None


def test_a_failing_write_leaves_no_step_folder(tmp_path):
    root = tmp_path / "ckpt"
    save(root, 10)
    before = {p.name: p.read_bytes() for p in (root / "step_00000010").iterdir()}

    def dies_halfway(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # a Ctrl-C (or any kill that unwinds) in the middle of the write

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 20, write_model=dies_halfway, state={"step": 20}, keep_last=1)
    assert [p.name for p in root.iterdir()] == ["step_00000010"]  # no step_20, no temporary, no pruning
    assert {p.name: p.read_bytes() for p in (root / "step_00000010").iterdir()} == before
    assert newest_good(root) == root / "step_00000010"


def test_a_state_weights_only_cannot_load_is_refused_before_writing(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(TypeError, match=r"state\['loss'\] is a numpy.float64"):
        save_checkpoint(root, 1, write_model=fake_model("x"), state={"loss": np.float64(1.0)}, keep_last=1)
    with pytest.raises(TypeError, match=r"state\['cfg'\] is a .*Path"):
        save_checkpoint(root, 1, write_model=fake_model("x"), state={"cfg": Path("a")}, keep_last=1)
    assert list_checkpoints(root) == []


# ---------------------------------------------------------------------------------------------
# Verifying and falling back


@pytest.mark.parametrize("name", FILES)
def test_verify_names_a_truncated_file(tmp_path, name):
    folder = save(tmp_path / "ckpt", 1)
    path = folder / name
    path.write_bytes(path.read_bytes()[:-5])
    reason = verify(folder)
    assert reason.startswith(f"{path} is truncated or resized") and "\n" not in reason


@pytest.mark.parametrize("name", FILES)
def test_verify_names_a_corrupted_file(tmp_path, name):
    folder = save(tmp_path / "ckpt", 1)
    path = folder / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    path.write_bytes(bytes(data))
    assert verify(folder) == f"{path} fails its checksum (the bytes changed after it was written)"


@pytest.mark.parametrize("name", FILES)
def test_verify_names_a_missing_file(tmp_path, name):
    folder = save(tmp_path / "ckpt", 1)
    (folder / name).unlink()
    assert verify(folder) == f"{folder / name} is missing"


def test_verify_reports_missing_or_unreadable_checksums(tmp_path):
    folder = save(tmp_path / "ckpt", 1)
    sums = folder / "checksums.json"
    sums.write_text('{"files": {"state.pt": {"sha256": "ab"}}}')
    assert verify(folder) == f"{sums} is unreadable (KeyError)"
    sums.write_text("{trunc")
    assert verify(folder).startswith(f"{sums} is unreadable")
    sums.unlink()
    assert verify(folder) == f"{sums} is missing"


def test_newest_good_falls_back_and_warns(tmp_path, caplog):
    root = tmp_path / "ckpt"
    for step in (100, 200, 300):
        save(root, step)
    (root / "step_00000300" / "state.pt").write_bytes(b"")  # killed disk, truncated
    (root / "step_00000200" / "checksums.json").unlink()
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        assert newest_good(root) == root / "step_00000100"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert str(root / "step_00000300") in warnings[0] and "state.pt is truncated" in warnings[0]
    assert str(root / "step_00000200") in warnings[1] and "checksums.json is missing" in warnings[1]


def test_newest_good_is_none_without_a_good_one(tmp_path, caplog):
    assert newest_good(tmp_path / "absent") is None
    folder = save(tmp_path / "ckpt", 1)
    (folder / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        assert newest_good(tmp_path / "ckpt") is None
    assert "config.json" in caplog.text


# ---------------------------------------------------------------------------------------------
# Loading


def test_load_state_refuses_a_damaged_checkpoint(tmp_path):
    folder = save(tmp_path / "ckpt", 1)
    (folder / "model.safetensors").write_bytes(b"xx")
    with pytest.raises(BadInput) as e:
        load_state(folder)
    assert str(e.value).startswith(f"checkpoint {folder} is damaged: {folder / 'model.safetensors'} is truncated")


class Payload:
    """Stands for anything a pickle could smuggle in: with weights_only=False, unpickling runs code."""

    def __reduce__(self):
        return (print, ("this ran while loading",))


class TrainerState:
    def __init__(self):
        self.step = 1


@pytest.mark.parametrize("obj, refused", [(Payload(), "GLOBAL print"), (TrainerState(), "TrainerState")])
def test_load_state_uses_weights_only(tmp_path, capsys, obj, refused):
    folder = save(tmp_path / "ckpt", 1)
    # A state.pt made by someone else, with a consistent checksums.json: verify passes, loading must not.
    torch.save({"step": 1, "custom": obj}, folder / "state.pt")
    sums = json.loads((folder / "checksums.json").read_text())
    state_pt = folder / "state.pt"
    sums["files"]["state.pt"] = {"sha256": sha256_file(state_pt), "bytes": state_pt.stat().st_size}
    (folder / "checksums.json").write_text(json.dumps(sums))
    assert verify(folder) is None
    with pytest.raises(BadInput) as e:
        load_state(folder)
    text = str(e.value)
    assert text.startswith(f"{folder / 'state.pt'} cannot be loaded with weights_only=True")
    assert "\n" not in text and "\x1b" not in text
    assert refused in text
    assert "add_safe_globals" not in text
    assert "this ran while loading" not in capsys.readouterr().out


def test_load_state_of_a_weights_only_folder(tmp_path):
    folder = save(tmp_path / "ckpt", 1)
    (folder / "state.pt").unlink()
    sums = json.loads((folder / "checksums.json").read_text())
    del sums["files"]["state.pt"]
    (folder / "checksums.json").write_text(json.dumps(sums))
    with pytest.raises(BadInput, match="state.pt is missing: .* holds weights only"):
        load_state(folder)


def test_step_of_refuses_other_names(tmp_path):
    assert step_of(tmp_path / "step_00001234") == 1234
    with pytest.raises(BadInput, match="not a checkpoint folder"):
        step_of(tmp_path / "final")


# ---------------------------------------------------------------------------------------------
# Random number generators


def draw() -> list:
    return [
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
        np.random.rand(3).tolist(),
        np.random.randn(),
        random.random(),
        random.gauss(0, 1),
    ]


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    draw()
    np.random.randn(), random.gauss(0, 1)  # leave a cached Gaussian in numpy and Python
    rng = capture_rng()
    expected = draw()
    folder = save_checkpoint(tmp_path, 1, write_model=fake_model("rng"), state={"rng": rng}, keep_last=1)
    draw()
    restore_rng(load_state(folder)["rng"])  # through torch.save / weights_only load
    assert draw() == expected
    restore_rng(rng)
    assert draw() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_round_trip():
    rng = capture_rng()
    expected = torch.rand(4, device="cuda").tolist()
    restore_rng(rng)
    assert torch.rand(4, device="cuda").tolist() == expected
