"""The pause point that lets tests act on a training run at a known step (gptforge.runtime.pause)."""

from __future__ import annotations

import logging
import threading

from gptforge.runtime.pause import FILE_ENV, STEP_ENV, PausePoint


def test_only_both_variables_on_rank_0_make_a_pause(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv(STEP_ENV, raising=False)
    monkeypatch.setenv(FILE_ENV, str(tmp_path / "p"))
    assert PausePoint.from_env().step is None
    monkeypatch.setenv(STEP_ENV, "3")
    assert (PausePoint.from_env().step, PausePoint.from_env().path) == (3, tmp_path / "p")
    assert PausePoint.from_env(master=False).step is None  # other ranks wait in their collectives
    monkeypatch.setenv(STEP_ENV, "soon")
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        assert PausePoint.from_env().step is None
    assert "is not a step number: no pause" in caplog.text


def test_it_holds_after_its_step_until_the_file_is_removed(tmp_path):
    path = tmp_path / "paused"
    pause = PausePoint(3, path)
    pause.after(2)  # another step: straight through, nothing written
    assert not path.exists()
    released = threading.Event()
    thread = threading.Thread(target=lambda: (pause.after(3), released.set()), daemon=True)
    thread.start()
    # The file appears only inside `after`, which returns only once it is gone: while it exists
    # the loop is held, whatever the machine's speed.
    while not path.exists():
        assert thread.is_alive()
        released.wait(0.01)
    assert path.read_text().startswith("paused at step 3, pid ")
    assert not released.is_set()
    path.unlink()
    thread.join(timeout=60)  # a bound against a hang only
    assert released.is_set() and not thread.is_alive()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left beside it
