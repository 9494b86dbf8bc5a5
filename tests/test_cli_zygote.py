"""The fork server that runs the tests' `gptforge` commands (tests/cli_zygote.py) against the
reference it stands in for: the same command as a fresh subprocess.

Its exit status, stdout and stderr are the fresh process's (a one-line error, a command that
succeeds), the command's environment and working folder are its own, a command past its timeout
is killed and raises as `subprocess.run` does (and the server goes on), and an environment that
changes what the preloaded libraries read at import is run fresh.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading

import cli_zygote
import pytest
from cli_support import BIN, cli_env, run_cli

# Each exports and loads models, or runs commands as fresh processes too: seconds each.
pytestmark = pytest.mark.slow


def _last_lines(text: str) -> list[str]:
    """The lines that do not carry a time stamp (log lines do)."""
    return [line for line in text.splitlines() if not line[:2].isdigit()]


def test_a_forked_command_is_the_fresh_process_twin(tmp_path):
    (tmp_path / "params.yaml").write_text("{}\n")
    for args in (
        ["prepare", "classify", "-S", "data.classify.source=/no/such/file", "-S", "tracking.enabled=false"],
        ["config", "show", "-S", "pretrain.max_steps=7"],
    ):
        env = cli_env(GPTFORGE_PREFECT="0")
        fresh = run_cli(args, tmp_path, env, fresh=True)
        forked = cli_zygote.run_forked([str(BIN / "gptforge"), *args], tmp_path, env, timeout=120)
        if forked is None:  # a server with thread pools (pytest without xdist) refuses, and says why
            assert "threads" in cli_zygote._SERVER.disabled and not os.environ.get("PYTEST_XDIST_WORKER")
            continue
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), args
        assert _last_lines(forked.stderr) == _last_lines(fresh.stderr), args
    assert fresh.returncode == 0 and "max_steps: 7" in fresh.stdout


def test_the_command_has_its_own_environment_and_folder(tmp_path):
    (tmp_path / "params.yaml").write_text("{}\n")
    args = ["prepare", "classify", "-S", "data.classify.source=no-such-file", "-S", "tracking.enabled=false"]
    plain = run_cli(args, tmp_path, cli_env(GPTFORGE_PREFECT="0"))
    debug = run_cli(args, tmp_path, cli_env(GPTFORGE_PREFECT="0", GPTFORGE_DEBUG="1"))
    assert plain.returncode == debug.returncode == 2
    assert "Traceback" not in plain.stderr and "Traceback" in debug.stderr  # GPTFORGE_DEBUG is read at run time
    assert str(tmp_path / "no-such-file") in plain.stderr or "no-such-file" in plain.stderr.splitlines()[-1]
    assert os.getcwd() != str(tmp_path)  # the test's own folder is untouched


def test_a_command_past_its_timeout_is_killed_and_the_server_goes_on(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    (tmp_path / "params.yaml").write_text("{}\n")
    url = f"https://127.0.0.1:{listener.getsockname()[1]}/sms.zip"  # the TLS handshake never gets an answer
    env = cli_env(GPTFORGE_PREFECT="0")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            run_cli(
                ["prepare", "classify", "-S", f"data.classify.source={url}"]
                + ["-S", "data.download.timeout=600", "-S", "tracking.enabled=false"],
                tmp_path,
                env,
                timeout=3,
            )
    finally:
        listener.close()
    again = run_cli(["config", "show"], tmp_path, env)
    assert again.returncode == 0 and "pretrain:" in again.stdout


def test_an_environment_read_at_import_gets_a_fresh_process(tmp_path):
    env = cli_env()
    assert cli_zygote.import_time_differences(env, dict(os.environ)) == []  # PATH only: forked
    changed = {**env, "HF_HOME": str(tmp_path), "OMP_NUM_THREADS": "2", "GPTFORGE_DEBUG": "1"}
    assert cli_zygote.import_time_differences(changed, env) == ["HF_HOME", "OMP_NUM_THREADS"]
    assert cli_zygote.run_forked([str(BIN / "gptforge"), "config", "show"], tmp_path, changed, timeout=60) is None
