"""The `slurm_cluster` fixture (tests/slurm_support.py) runs batch jobs: `sbatch --wait` returns when the job
ends, with the job's exit status (no accounting, so no sacct), and a job sees the submitter's environment."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from slurm_support import slurm_cluster  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow


def submit_and_wait(cluster, script: Path, tmp_path: Path, env: dict | None = None):
    """`sbatch --wait` the script in tmp_path; the finished sbatch (its return code is the job's)."""
    return cluster.run(
        [
            "sbatch",
            "--wait",
            "--quiet",
            "-p",
            cluster.partition,
            "-D",
            str(tmp_path),
            "-o",
            str(tmp_path / "job.out"),
            "-t",
            "1",
            str(script),
        ],
        timeout=60,
        env=env or cluster.environ(),
    )


def test_job_runs_with_the_submitters_environment(slurm_cluster, tmp_path):
    out = tmp_path / "result.txt"
    script = tmp_path / "job.sh"
    script.write_text(f'#!/bin/sh\nhostname -s > {out}\necho "$GPTFORGE_SLURM_PROBE" >> {out}\n')
    done = submit_and_wait(
        slurm_cluster, script, tmp_path, env={**slurm_cluster.environ(), "GPTFORGE_SLURM_PROBE": "x1"}
    )
    assert done.returncode == 0, f"{done.stderr}\n{slurm_cluster.log_tail()}"
    assert out.read_text().split() == [socket.gethostname().split(".")[0], "x1"]


def test_failing_job_fails_sbatch_wait(slurm_cluster, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\necho failing\nexit 3\n")
    done = submit_and_wait(slurm_cluster, script, tmp_path)
    assert done.returncode == 3, f"{done.stderr}\n{slurm_cluster.log_tail()}"
    assert (tmp_path / "job.out").read_text() == "failing\n"
