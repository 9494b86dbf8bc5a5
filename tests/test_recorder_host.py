"""The recorder host (flows/recorder_host.py): one process that has imported what recorders need
and forks each working folder's recorder on request (gptforge.runtime.recorder_launch).

Checked as the stages meet it, through `ensure_recorder` with journals written directly: each
folder still gets a recorder of its own, forked by one host, run with the asking process's
environment; a host killed with its socket left behind, a second host for the same key and
`GPTFORGE_RECORDER_HOST=0` still get every journal delivered. Each test has its own host
(XDG_CACHE_HOME in the test's folder), not the suite's.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from test_recorder import T0, copy_mlflow, delivered, mlflow_run, open_journal, recorder_log, wait_for

from gptforge.runtime import recorder_launch
from gptforge.runtime.journal import RECORDER_DIR
from gptforge.runtime.recording import ensure_recorder


@pytest.fixture
def own_cache(monkeypatch) -> Path:
    """A cache folder of the test's own, short enough for a Unix socket's path."""
    cache = Path(tempfile.mkdtemp(prefix="gf-"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv(recorder_launch.HOST_ENV, raising=False)
    yield cache
    shutil.rmtree(cache, ignore_errors=True)


def journal_in(work: Path, key: str, uri: str) -> None:
    """A short stage journal whose records go to MLflow only."""
    j = open_journal(work, key, prefect_url=False, mlflow_uri=uri)
    j.write("run_start", time=T0 + 1, run="main", name="prepare_classify", parent=None, tags={})
    j.write("metrics", time=T0 + 2, run="main", metrics={"loss": 1.25}, step=1, timestamp=int((T0 + 2) * 1000))
    j.write("run_end", time=T0 + 3, run="main", status="FINISHED")
    j.write("close", time=T0 + 4, state="COMPLETED", message="done", exit_code=0)
    j.close()


def recorder_of(work: Path) -> psutil.Process:
    state = work / RECORDER_DIR / "state.json"
    wait_for(state.exists, "the recorder's state.json", work)
    return psutil.Process(json.loads(state.read_text())["pid"])


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_one_host_forks_each_folder_s_recorder_with_the_asking_stage_s_environment(
    tmp_path, own_cache, mlflow_uri, monkeypatch
):
    monkeypatch.setenv("GPTFORGE_RECORDER_IDLE_SECONDS", "3")
    first, second = tmp_path / "a", tmp_path / "b"
    uri = copy_mlflow(mlflow_uri, tmp_path / "db")
    journal_in(first, "20240101T000000-prepare_classify-aaaa", uri)
    ensure_recorder(first)
    recorder = recorder_of(first)
    host = recorder.parent()
    assert host.cmdline()[-2] == "flows.recorder_host" and host.cwd() == "/"
    socket_path = Path(host.cmdline()[-1])
    assert socket_path.parent == own_cache / "gptforge"

    monkeypatch.setenv("GPTFORGE_RECORDER_IDLE_SECONDS", "1")  # this stage's environment, not the host's
    journal_in(second, "20240101T000001-prepare_classify-bbbb", uri)
    ensure_recorder(second)
    other = recorder_of(second)
    assert other.pid != recorder.pid and other.parent().pid == host.pid
    assert Path(other.cwd()) == second.resolve()
    keys = {first: "20240101T000000-prepare_classify-aaaa", second: "20240101T000001-prepare_classify-bbbb"}
    for work, key in keys.items():
        wait_for(lambda: delivered(work, key), "its journal delivered", work)
        _, run = mlflow_run(uri, key)
        assert run.info.status == "FINISHED" and run.data.metrics == {"loss": 1.25}
    wait_for(lambda: gone(other.pid), "the second recorder gone", second, within=60)
    assert "idle for 1 s with nothing pending: exiting" in recorder_log(second)
    wait_for(lambda: gone(recorder.pid), "the first recorder gone", first, within=60)
    assert "idle for 3 s with nothing pending: exiting" in recorder_log(first)
    # Its recorders gone and nothing asked for in their idle time: the host leaves, socket and all.
    wait_for(lambda: gone(host.pid) and not socket_path.exists(), "the host gone", first, within=60)
    assert sorted(p.name for p in socket_path.parent.iterdir()) == ["recorder-host.log"]  # nothing left but its log


@pytest.mark.slow
def test_a_killed_host_a_second_host_and_no_host_still_deliver(tmp_path, own_cache, mlflow_uri, monkeypatch):
    monkeypatch.setenv("GPTFORGE_RECORDER_IDLE_SECONDS", "2")
    uri = copy_mlflow(mlflow_uri, tmp_path / "db")

    # A host killed outright leaves its socket file: the next stage starts a new host.
    first = tmp_path / "a"
    journal_in(first, "20240101T000000-prepare_classify-aaaa", uri)
    ensure_recorder(first)
    host = recorder_of(first).parent()
    socket_path = Path(host.cmdline()[-1])
    wait_for(lambda: delivered(first, "20240101T000000-prepare_classify-aaaa"), "delivered", first)
    host.send_signal(signal.SIGKILL)
    host.wait(30)
    assert socket_path.exists()
    second = tmp_path / "b"
    journal_in(second, "20240101T000001-prepare_classify-bbbb", uri)
    ensure_recorder(second)
    new_host = recorder_of(second).parent()
    assert new_host.pid != host.pid and new_host.cmdline()[-2] == "flows.recorder_host"
    wait_for(lambda: delivered(second, "20240101T000001-prepare_classify-bbbb"), "delivered", second)

    # A second host for the same key (the lock taken) is that folder's recorder itself.
    new_host.send_signal(signal.SIGTERM)
    new_host.wait(30)
    third = tmp_path / "c"
    journal_in(third, "20240101T000002-prepare_classify-cccc", uri)
    with open(socket_path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        ensure_recorder(third)
        recorder = recorder_of(third)
        assert recorder.cmdline()[-2] == "flows.recorder_host" and recorder.parent().pid == os.getpid()  # not forked
        assert Path(recorder.cwd()) == third.resolve()
        wait_for(lambda: delivered(third, "20240101T000002-prepare_classify-cccc"), "delivered", third)
        assert not socket_path.exists()

    # GPTFORGE_RECORDER_HOST=0: the plain recorder, a process of its own.
    monkeypatch.setenv(recorder_launch.HOST_ENV, "0")
    fourth = tmp_path / "d"
    journal_in(fourth, "20240101T000003-prepare_classify-dddd", uri)
    ensure_recorder(fourth)
    plain = recorder_of(fourth)
    assert plain.cmdline()[-2:] == ["-m", "flows.recorder"]
    wait_for(lambda: delivered(fourth, "20240101T000003-prepare_classify-dddd"), "delivered", fourth)
    for n, key in enumerate(("aaaa", "bbbb", "cccc", "dddd")):
        assert mlflow_run(uri, f"20240101T00000{n}-prepare_classify-{key}")[1].info.status == "FINISHED"


def test_the_host_key_follows_the_recorder_code(tmp_path, own_cache, monkeypatch):
    """A changed recorder source means another host: one never forks code older than the checkout's."""
    import importlib.machinery

    flows, runtime = tmp_path / "flows", tmp_path / "runtime"
    for folder in (flows, runtime):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (flows / "recorder.py").write_text("A = 1\n")
    specs = {
        name: importlib.machinery.ModuleSpec(name, None, is_package=True) for name in ("flows", "gptforge.runtime")
    }
    specs["flows"].submodule_search_locations = [str(flows)]
    specs["gptforge.runtime"].submodule_search_locations = [str(runtime)]
    monkeypatch.setattr(recorder_launch.importlib.util, "find_spec", lambda name: specs[name])
    before = recorder_launch.host_socket()
    assert before == recorder_launch.host_socket() and before.parent == own_cache / "gptforge"
    (flows / "recorder.py").write_text("A = 22\n")
    assert recorder_launch.host_socket() != before
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ("deep" * 30)))
    with pytest.raises(OSError, match="too long for a Unix socket"):
        recorder_launch.host_socket()  # start_recorder then starts the plain recorder


def test_an_unanswered_host_is_not_waited_on_for_long(tmp_path, monkeypatch):
    """A socket that accepts but never answers (a host stopped mid-request) costs the stage at
    most ASK_SECONDS, then it starts a host of its own."""
    import socket

    monkeypatch.setattr(recorder_launch, "ASK_SECONDS", 0.5)
    path = tmp_path / "h.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(str(path))
        silent.listen(1)
        began = time.monotonic()
        assert recorder_launch._ask_host(path, tmp_path) is False
        assert time.monotonic() - began < 5
    assert recorder_launch._ask_host(tmp_path / "none.sock", tmp_path) is False
