"""docker/build.sh and docker/check.py on bad input, with a stand-in `docker` (no engine needed).

Each says what is wrong in one line, last, and exits non-zero: no engine (and how to start one),
a base image that does not exist (naming BASE_IMAGE), an unknown argument, a disk too full for the
build. The end-to-end run of both against a real engine is `make docker-check` (docker/check.py, run
by .ci/run after the suite).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docker_support import ROOT

BUILD = ROOT / "docker" / "build.sh"
CHECK = ROOT / "docker" / "check.py"


def stand_in_docker(tmp_path: Path, script: str, *, system_bin: bool = True) -> dict[str, str]:
    """An environment whose PATH has a `docker` running `script` (bash), python3 and, with
    `system_bin`, /usr/bin (bash, sed, git; no dockerd, debootstrap or nvidia-smi there). Without
    it nothing else is found: no real docker-compose may ever touch a stack of the host's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text("#!/bin/bash\n" + script)
    docker.chmod(0o755)
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}/usr/bin" if system_bin else str(bin_dir)
    return {"PATH": path, "HOME": str(tmp_path)}


def last_line(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1] if lines else ""


def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_scripts_are_valid_and_executable():
    subprocess.run(["bash", "-n", str(BUILD)], check=True, timeout=30)
    subprocess.run(["bash", "-n", str(ROOT / "docker" / "lib.sh")], check=True, timeout=30)
    assert os.access(BUILD, os.X_OK)


def test_build_without_an_engine_says_how_to_start_one(tmp_path):
    env = stand_in_docker(tmp_path, 'if [[ "$1" == info ]]; then exit 1; fi\n')
    result = run([str(BUILD), "--cpu"], env)
    assert result.returncode == 2
    assert "no Docker engine answers" in last_line(result) and "dockerd" in last_line(result)


def test_build_with_a_base_image_that_does_not_exist_names_it(tmp_path):
    # The engine answers; the image is neither here nor pullable.
    env = stand_in_docker(
        tmp_path, 'case "$1" in info) exit 0 ;; image|pull) exit 1 ;; esac\necho "unexpected: $*" >&2; exit 3\n'
    )
    result = run([str(BUILD), "--cpu", "--base", "nosuch/base:1.0"], env)
    assert result.returncode == 2, result.stderr
    assert last_line(result) == "docker/build.sh: BASE_IMAGE nosuch/base:1.0 does not exist here and cannot be pulled"


def test_build_refuses_an_unknown_argument(tmp_path):
    env = stand_in_docker(tmp_path, "exit 0\n")
    result = run([str(BUILD), "--fast"], env)
    assert result.returncode == 2 and "unknown argument --fast" in last_line(result)


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ('if [[ "$1" == info ]]; then exit 1; fi\n', "no Docker engine answers; start one"),
        ('if [[ "$1" == compose ]]; then exit 1; fi\nexit 0\n', "no Docker Compose; install it"),
    ],
)
def test_check_says_what_is_missing(tmp_path, script, expected):
    env = stand_in_docker(tmp_path, script, system_bin=False)
    result = run([sys.executable, str(CHECK), "--no-build"], env)
    assert result.returncode == 1
    assert last_line(result).startswith("docker-check: FAILED: ") and expected in last_line(result), result.stderr


def test_check_says_first_when_the_disk_has_no_room_for_the_build(tmp_path, monkeypatch):
    """CI's check once died in the build's last copy ("no space left on device") after the whole
    suite: a disk too full for the build is said before it starts, in one line."""
    env = stand_in_docker(tmp_path, 'case "$1" in info) echo /var/lib/docker ;; image) exit 1 ;; esac\n')
    monkeypatch.setenv("PATH", env["PATH"])
    spec = importlib.util.spec_from_file_location("docker_check", CHECK)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(check.shutil, "disk_usage", lambda path: usage._replace(free=int(3.7e9)))
    line = check.disk_shortfall(build=True)
    assert line.startswith("3.7 GB free on the disk of Docker's data root /var/lib/docker, the check needs about 7 GB")
    assert check.disk_shortfall(build=False) is None  # the image is there to use: 1 GB is room enough
