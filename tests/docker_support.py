"""docker/Dockerfile as the docker/ tests read it (tests/test_dockerfile.py, test_docker_compose.py,
test_docker_entrypoint.py), and the paths of docker/ that more than one of them reads.

The Dockerfile's instructions with continuation lines joined, per build stage; ARG defaults and ENV values;
whether a USER is root; and module-scoped fixtures for the file's text, its stages, its ARG
defaults and the final stage's USER (import them into a test module to use them there).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
POOL_TEMPLATE = ROOT / "docker" / "gpu-pool.json"

WORKDIR = "/workspace/gptforge"


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not buf and not stripped):
            continue  # comments, also inside a continued instruction, as Docker reads them
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        keyword, _, rest = buf.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_stages(text: str) -> list[list[tuple[str, str]]]:
    """Instructions per build stage; index 0 holds the global ARGs before the first FROM."""
    stages: list[list[tuple[str, str]]] = [[]]
    for ins in dockerfile_instructions(text):
        if ins[0] == "FROM":
            stages.append([])
        stages[-1].append(ins)
    return stages


def arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for keyword, rest in instructions:
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            out[name.strip()] = value.strip().strip('"')
    return out


def env_values(instructions: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for keyword, rest in instructions:
        if keyword == "ENV":
            for token in shlex.split(rest):
                name, _, value = token.partition("=")
                out[name] = value
    return out


def expand(value: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m.group(1) or m.group(2)], value)


def is_root(user: str | None) -> bool:
    return user is None or user.split(":")[0] in {"", "0", "root"}


@pytest.fixture(scope="module")
def dockerfile_text() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def stages(dockerfile_text):
    return dockerfile_stages(dockerfile_text)


@pytest.fixture(scope="module")
def dockerfile_args(stages) -> dict[str, str]:
    return {k: v for stage in stages for k, v in arg_defaults(stage).items()}


@pytest.fixture(scope="module")
def image_user(stages, dockerfile_args) -> str | None:
    users = [rest for keyword, rest in stages[-1] if keyword == "USER"]
    return expand(users[-1], dockerfile_args) if users else None
