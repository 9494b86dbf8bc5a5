"""docker/entrypoint.sh, the worker image's entrypoint, run with a stand-in `prefect` (no Docker engine).

It is valid bash and executable; it runs any other command as given (how the Docker worker starts
a flow run in the image); `worker` needs PREFECT_API_URL, then starts a Docker worker on the `gpu`
pool with docker/gpu-pool.json filled in from its environment, or a process worker without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from docker_support import POOL_TEMPLATE, ROOT

ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"


@pytest.fixture()
def stub_path(tmp_path) -> Path:
    """A PATH with a `prefect` that records its arguments (and the job template it is given)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    prefect = bin_dir / "prefect"
    prefect.write_text(
        "#!/usr/bin/env bash\n"
        'printf "%s\\n" "$@" > "$STUB_OUT"\n'
        "prev=''\n"
        'for arg in "$@"; do\n'
        '  if [[ "$prev" == --base-job-template ]]; then cp "$arg" "$STUB_OUT.json"; fi\n'
        '  prev="$arg"\n'
        "done\n"
    )
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for f in (prefect, python):
        f.chmod(0o755)
    return bin_dir


def run_entrypoint(stub_path: Path, tmp_path: Path, *args: str, **env: str):
    out = tmp_path / "prefect-args.txt"
    base = {
        "PATH": f"{stub_path}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "STUB_OUT": str(out),
        "HOME": str(tmp_path),
        "GPTFORGE_POOL_TEMPLATE": str(POOL_TEMPLATE),
    }
    result = subprocess.run(
        ["bash", str(ENTRYPOINT), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    prefect_args = out.read_text().splitlines() if out.exists() else None
    template = json.loads(Path(f"{out}.json").read_text()) if Path(f"{out}.json").exists() else None
    return result, prefect_args, template


def test_entrypoint_is_valid_bash():
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True, timeout=30)
    assert os.access(ENTRYPOINT, os.X_OK), "docker/entrypoint.sh is not executable"


def test_entrypoint_runs_other_commands_as_given(stub_path, tmp_path):
    # This is how the Docker worker starts a flow run in the image.
    result, prefect_args, _ = run_entrypoint(stub_path, tmp_path, "prefect", "flow-run", "execute")
    assert result.returncode == 0, result.stderr
    assert prefect_args == ["flow-run", "execute"]


def test_entrypoint_worker_needs_an_api_url(stub_path, tmp_path):
    result, prefect_args, _ = run_entrypoint(stub_path, tmp_path)
    assert result.returncode == 2 and "PREFECT_API_URL" in result.stderr
    assert prefect_args is None


def test_entrypoint_starts_the_docker_worker_with_the_gpu_template(stub_path, tmp_path):
    result, prefect_args, template = run_entrypoint(
        stub_path,
        tmp_path,
        "worker",
        "--limit",
        "1",
        PREFECT_API_URL="http://prefect-server:4200/api",
        GPTFORGE_IMAGE="registry.example/gptforge-gpu:9.9.9",
        GPTFORGE_NETWORK="othernet",
        MLFLOW_TRACKING_URI="http://tracking:5000",
    )
    assert result.returncode == 0, result.stderr
    template_arg = prefect_args.index("--base-job-template")
    assert prefect_args[:template_arg] == ["worker", "start", "--pool", "gpu", "--type", "docker"]
    assert prefect_args[template_arg + 2 :] == ["--limit", "1"]
    props = template["variables"]["properties"]
    assert props["image"]["default"] == "registry.example/gptforge-gpu:9.9.9"
    assert props["networks"]["default"] == ["othernet"]
    assert props["env"]["default"]["MLFLOW_TRACKING_URI"] == "http://tracking:5000"
    assert props["container_create_kwargs"]["default"]["device_requests"][0]["driver"] == "nvidia"


def test_entrypoint_process_worker_gets_no_docker_template(stub_path, tmp_path):
    result, prefect_args, template = run_entrypoint(
        stub_path,
        tmp_path,
        PREFECT_API_URL="http://prefect-server:4200/api",
        PREFECT_WORK_POOL="gpu-local",
        PREFECT_WORKER_TYPE="process",
    )
    assert result.returncode == 0, result.stderr
    assert prefect_args == ["worker", "start", "--pool", "gpu-local", "--type", "process"]
    assert template is None


def test_entrypoint_cpu_pool_takes_the_projects_volume_names(stub_path, tmp_path):
    """The CPU worker (compose's cpu-worker): pool `cpu`, docker/cpu-pool.json without a device
    request, and the volume names of the compose project (GPTFORGE_VOLUME_PREFIX, as the check's)."""
    result, prefect_args, template = run_entrypoint(
        stub_path,
        tmp_path,
        PREFECT_API_URL="http://prefect-server:4200/api",
        PREFECT_WORK_POOL="cpu",
        GPTFORGE_POOL_TEMPLATE=str(ROOT / "docker" / "cpu-pool.json"),
        GPTFORGE_VOLUME_PREFIX="gptforge-check",
    )
    assert result.returncode == 0, result.stderr
    assert prefect_args[:6] == ["worker", "start", "--pool", "cpu", "--type", "docker"]
    props = template["variables"]["properties"]
    assert props["image"]["default"] == "gptforge-cpu:latest"
    assert "device_requests" not in props["container_create_kwargs"]["default"]
    volumes = props["volumes"]["default"]
    assert "gptforge-check-dvc-cache:/workspace/gptforge/.dvc/cache" in volumes
    assert "gptforge-check-state:/state" in volumes
    assert all(v.startswith("gptforge-check-") for v in volumes), volumes
