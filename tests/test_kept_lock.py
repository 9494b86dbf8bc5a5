"""gptforge.pipeline.kept_lock: dvc.lock kept in GPTFORGE_DVC_LOCK_DIR between runs whose
workspace does not last (flow-run containers); unset, the workspace's dvc.lock is left alone."""

from __future__ import annotations

import pytest

from gptforge.errors import BadInput
from gptforge.pipeline.kept_lock import LOCK_DIR_ENV, kept_dvc_lock


def test_unset_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(LOCK_DIR_ENV, raising=False)
    (tmp_path / "dvc.lock").write_text("image's\n")
    with kept_dvc_lock(tmp_path):
        (tmp_path / "dvc.lock").write_text("after repro\n")
    assert (tmp_path / "dvc.lock").read_text() == "after repro\n"


def test_the_kept_lock_comes_in_and_the_new_one_goes_back(tmp_path, monkeypatch):
    state, work = tmp_path / "state", tmp_path / "work"
    state.mkdir()
    work.mkdir()
    monkeypatch.setenv(LOCK_DIR_ENV, str(state))
    (work / "dvc.lock").write_text("image's\n")
    # First run: nothing kept yet, the image's copy stands; what repro wrote is kept.
    with kept_dvc_lock(work):
        assert (work / "dvc.lock").read_text() == "image's\n"
        (work / "dvc.lock").write_text("run 1\n")
    assert (state / "dvc.lock").read_text() == "run 1\n"
    # A new workspace (the next container) starts from the kept lock, also when repro fails.
    (work / "dvc.lock").write_text("image's\n")
    with pytest.raises(RuntimeError), kept_dvc_lock(work):
        assert (work / "dvc.lock").read_text() == "run 1\n"
        (work / "dvc.lock").write_text("run 2, one stage done\n")
        raise RuntimeError("stage failed")
    assert (state / "dvc.lock").read_text() == "run 2, one stage done\n"
    assert not (state / "dvc.lock").is_symlink() and not (work / "dvc.lock").is_symlink()


def test_a_missing_folder_is_bad_input(tmp_path, monkeypatch):
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(BadInput, match="GPTFORGE_DVC_LOCK_DIR=.*not a writable folder"), kept_dvc_lock(tmp_path):
        pass


def test_each_lock_update_is_kept_while_repro_runs(tmp_path, monkeypatch):
    """A container killed mid-stage never reaches the `finally`: the stages finished before the
    kill must already be in the kept lock, and a lock caught mid-write is never copied."""
    import time

    from gptforge.pipeline import kept_lock

    state, work = tmp_path / "state", tmp_path / "work"
    state.mkdir()
    work.mkdir()
    monkeypatch.setenv(LOCK_DIR_ENV, str(state))
    monkeypatch.setattr(kept_lock, "POLL_SECONDS", 0.05)
    kept = state / "dvc.lock"

    def kept_soon(text: str) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if kept.is_file() and kept.read_text() == text:
                return True
            time.sleep(0.02)
        return False

    with kept_dvc_lock(work):
        (work / "dvc.lock").write_text("schema: '2.0'\nstages:\n  prepare: {cmd: a}\n")
        assert kept_soon("schema: '2.0'\nstages:\n  prepare: {cmd: a}\n")
        (work / "dvc.lock").write_text("schema: '2.0'\nstages:\n  prepare: {cmd: a\n")  # half-written
        time.sleep(0.5)
        assert kept.read_text() == "schema: '2.0'\nstages:\n  prepare: {cmd: a}\n"
        (work / "dvc.lock").write_text("schema: '2.0'\nstages:\n  prepare: {cmd: a}\n  train: {cmd: b}\n")
        assert kept_soon("schema: '2.0'\nstages:\n  prepare: {cmd: a}\n  train: {cmd: b}\n")
