"""gptforge.io's atomic writes: the file or folder appears whole, with the mode `open` and
`mkdir` would have given it (mkstemp and mkdtemp make them private to their owner: a GGUF file
that Ollama's service user cannot read, a metrics folder a web server cannot serve)."""

from __future__ import annotations

import os
import stat

import pytest

from gptforge.io import atomic_dir, atomic_file, umask


@pytest.fixture(params=[0o022, 0o077, 0o002])
def mask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_atomic_writes_take_the_umask_as_open_and_mkdir_do(mask, tmp_path):
    assert umask() == mask
    with atomic_file(tmp_path / "a.txt") as f:
        f.write("whole")
    with open(tmp_path / "b.txt", "w") as f:  # the reference: plain open
        f.write("whole")
    with atomic_dir(tmp_path / "d") as d:
        (d / "x").write_text("1")
    (tmp_path / "e").mkdir()  # the reference: plain mkdir
    mode = lambda p: stat.S_IMODE((tmp_path / p).stat().st_mode)  # noqa: E731
    assert mode("a.txt") == mode("b.txt") == 0o666 & ~mask
    assert mode("d") == mode("e") == 0o777 & ~mask
    assert (tmp_path / "a.txt").read_text() == "whole" and (tmp_path / "d/x").read_text() == "1"


def test_a_failed_write_leaves_the_old_file(tmp_path):
    (tmp_path / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "a.txt") as f:
            f.write("half")
            raise RuntimeError("stopped")
    assert (tmp_path / "a.txt").read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]
