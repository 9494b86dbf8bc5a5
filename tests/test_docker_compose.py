"""The worker image's compose project and pool, checked without a Docker engine.

- docker/compose.yaml: valid against the Compose Specification schema (vendored in
  tests/data, see its README) after interpolating the defaults, as `docker compose` does, and
  the house rules of `compose_problems`: ports on 127.0.0.1, defaults for every variable,
  non-root containers, healthchecks, declared volumes, the GPU reservation. The same checker
  is run on broken variants of the file to show that it rejects them.
- docker/compose.yaml's `serve` service: loopback port, the MLflow service's registry, the API
  key and engine settings, its healthcheck, and the command its shell really runs.
- docker/gpu-pool.json: the `gpu` pool's job template agrees with the compose file, and the `gpu`
  deployments of prefect.yaml with both.

The Dockerfile itself: tests/test_dockerfile.py; docker/entrypoint.sh: tests/test_docker_entrypoint.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from docker_support import (  # noqa: F401  (dockerfile_text, stages, dockerfile_args, image_user: fixtures)
    POOL_TEMPLATE,
    ROOT,
    WORKDIR,
    dockerfile_args,
    dockerfile_text,
    image_user,
    is_root,
    stages,
)

COMPOSE = ROOT / "docker" / "compose.yaml"
COMPOSE_SCHEMA = Path(__file__).resolve().parent / "data" / "compose-spec.json"

GPU_SERVICES = {"gpu-worker", "serve"}
# Bind mounts a service may have: the worker drives the host's Docker engine.
ALLOWED_BIND_TARGETS = {"/var/run/docker.sock"}


# --------------------------------------------------------------------------------------
# compose checker
# --------------------------------------------------------------------------------------

VAR_REF = re.compile(r"\$\$|\$\{([^}]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
WITH_DEFAULT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(:?-)(.*)$", re.S)


def _strings(node, path="$"):
    """(path, string) for every string in a YAML document, keys included."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{path}.{key}", str(key)
            yield from _strings(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def interpolate(node):
    """The document `docker compose` sees with no variable set: each `${VAR:-default}` is its default."""

    def substitute(text: str) -> str:
        def one(match: re.Match) -> str:
            if match.group(0) == "$$":
                return "$"
            body = match.group(1)
            found = WITH_DEFAULT.match(body or "")
            return found.group(3) if found else ""

        return VAR_REF.sub(one, text)

    if isinstance(node, dict):
        return {key: interpolate(value) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value) for value in node]
    if isinstance(node, str):
        return substitute(node)
    return node


def _volume_source_target(entry) -> tuple[str | None, str]:
    if isinstance(entry, dict):
        return entry.get("source"), entry["target"]
    parts = entry.split(":")
    if len(parts) == 1:
        return None, parts[0]  # anonymous volume
    return parts[0], parts[1]


def _is_bind_source(source: str) -> bool:
    return source.startswith(("/", ".", "~"))


def compose_problems(doc: dict, schema: dict, image_user: str | None) -> list[str]:
    """Every way `doc` breaks the Compose schema or this project's rules, as messages.

    image_user is the USER of our Dockerfile: it counts for services built from it.
    """
    problems: list[str] = []

    # 1. every variable has a default: the file works with no .env at all
    for path, text in _strings(doc):
        for match in VAR_REF.finditer(text):
            if match.group(0) == "$$":
                continue
            if match.group(2) or not WITH_DEFAULT.match(match.group(1)):
                problems.append(f"{path}: variable {match.group(0)} has no default")

    resolved = interpolate(doc)

    # 2. the Compose Specification
    validator = jsonschema.Draft202012Validator(schema)
    for error in sorted(validator.iter_errors(resolved), key=lambda e: list(e.absolute_path)):
        where = "/".join(str(p) for p in error.absolute_path)
        problems.append(f"schema: {where}: {error.message}")

    services = resolved.get("services") or {}
    declared_volumes = set((resolved.get("volumes") or {}).keys())
    declared_networks = set((resolved.get("networks") or {}).keys())
    healthy_needed = {
        dep
        for svc in services.values()
        if isinstance(svc.get("depends_on"), dict)
        for dep, cond in svc["depends_on"].items()
        if (cond or {}).get("condition") == "service_healthy"
    }

    for name, svc in services.items():
        if not isinstance(svc, dict):
            continue
        ports = svc.get("ports") or []
        # 3. published ports on the loopback interface only
        for port in ports:
            if isinstance(port, dict):
                ok = port.get("host_ip") == "127.0.0.1"
            else:
                ok = re.fullmatch(r"127\.0\.0\.1:\d+:\d+(/(tcp|udp))?", str(port)) is not None
            if not ok:
                problems.append(f"{name}: port {port!r} is not bound to 127.0.0.1")

        # 4. healthchecks on the servers and on whatever others wait for
        if ports or name in healthy_needed:
            test = (svc.get("healthcheck") or {}).get("test")
            disabled = (svc.get("healthcheck") or {}).get("disable") in (True, "true")
            if not test or disabled or test == ["NONE"]:
                problems.append(f"{name}: no healthcheck")

        # 5. non-root: long-running services run as a non-root user; root only for a
        #    one-shot helper with no network
        user = svc.get("user")
        if user is None and "build" in svc:
            user = image_user
        if is_root(user):
            one_shot = svc.get("restart") == "no" and not ports and svc.get("network_mode") == "none"
            if not one_shot:
                problems.append(f"{name}: runs as root (user {user!r})")

        # 6. volumes: named ones declared; bind mounts only for the Docker socket
        for entry in svc.get("volumes") or []:
            source, target = _volume_source_target(entry)
            if source is None:
                problems.append(f"{name}: anonymous volume at {target}")
            elif _is_bind_source(source):
                if target not in ALLOWED_BIND_TARGETS:
                    problems.append(f"{name}: bind mount {source}:{target}")
            elif source not in declared_volumes:
                problems.append(f"{name}: volume {source!r} is not declared")

        nets = svc.get("networks") or []
        for net in nets if isinstance(nets, list) else nets.keys():
            if net not in declared_networks:
                problems.append(f"{name}: network {net!r} is not declared")
        deps = svc.get("depends_on") or []
        for dep in deps if isinstance(deps, list) else deps.keys():
            if dep not in services:
                problems.append(f"{name}: depends on unknown service {dep!r}")

        # 7. pinned images (a service with `build` names the tag it builds, not one it pulls)
        image = svc.get("image")
        if image is None and "build" not in svc:
            problems.append(f"{name}: no image")
        elif image is not None and "build" not in svc:
            tag = image.rsplit("/", 1)[-1]
            if "@sha256:" not in image and (":" not in tag or tag.endswith(":latest")):
                problems.append(f"{name}: image {image!r} is not pinned")

        # 8. GPUs for the GPU services
        if name in GPU_SERVICES:
            devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get(
                "devices"
            ) or []
            if not any(d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or []) for d in devices):
                problems.append(f"{name}: no nvidia GPU reservation")

    for name in GPU_SERVICES - set(services):
        problems.append(f"service {name} is missing")
    return problems


@pytest.fixture(scope="module")
def compose_schema() -> dict:
    return json.loads(COMPOSE_SCHEMA.read_text())


@pytest.fixture(scope="module")
def compose_doc() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_passes_schema_and_rules(compose_doc, compose_schema, image_user):
    assert compose_problems(compose_doc, compose_schema, image_user) == []


def _set(doc, dotted, value):
    node = doc
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value


def _del(doc, dotted):
    node = doc
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node[key]
    del node[keys[-1]]


BROKEN_VARIANTS = {
    "port on every interface": (
        lambda d: _set(d, "services.prefect-server.ports", ["4200:4200"]),
        "not bound to 127.0.0.1",
    ),
    "port on 0.0.0.0": (
        lambda d: _set(d, "services.mlflow.ports", ["0.0.0.0:5000:5000"]),
        "not bound to 127.0.0.1",
    ),
    "bare port number": (lambda d: _set(d, "services.mlflow.ports", [5000]), "not bound to 127.0.0.1"),
    "variable without default": (
        lambda d: _set(d, "services.prefect-server.ports", ["127.0.0.1:${PREFECT_PORT}:4200"]),
        "has no default",
    ),
    "unbraced variable": (
        lambda d: _set(d, "services.gpu-worker.image", "$GPTFORGE_IMAGE"),
        "has no default",
    ),
    "no GPU reservation": (lambda d: _del(d, "services.gpu-worker.deploy"), "no nvidia GPU reservation"),
    "server as root": (lambda d: _set(d, "services.mlflow.user", "0:0"), "runs as root"),
    "server with the image's default user": (lambda d: _del(d, "services.prefect-server.user"), "runs as root"),
    "no healthcheck on a server": (lambda d: _del(d, "services.mlflow.healthcheck"), "no healthcheck"),
    "undeclared volume": (
        lambda d: d["services"]["gpu-worker"]["volumes"].append("scratch:/scratch"),
        "is not declared",
    ),
    "bind mount of a host folder": (
        lambda d: d["services"]["gpu-worker"]["volumes"].append("/srv/data:/workspace/gptforge/data"),
        "bind mount",
    ),
    "unpinned image": (
        lambda d: _set(d, "services.mlflow.image", "ghcr.io/mlflow/mlflow:latest"),
        "not pinned",
    ),
    "unknown key": (lambda d: _set(d, "services.mlflow.portz", ["127.0.0.1:5000:5000"]), "schema:"),
    "wrong type": (lambda d: _set(d, "services.mlflow.healthcheck.retries", [3]), "schema:"),
}


@pytest.mark.parametrize("variant", sorted(BROKEN_VARIANTS))
def test_compose_checker_rejects_broken_variants(compose_doc, compose_schema, image_user, variant):
    mutate, expected = BROKEN_VARIANTS[variant]
    doc = copy.deepcopy(compose_doc)
    mutate(doc)
    problems = compose_problems(doc, compose_schema, image_user)
    assert any(expected in p for p in problems), problems


def test_compose_checker_needs_a_non_root_image_user(compose_doc, compose_schema):
    """Without `user:` a built service runs as the Dockerfile's USER: root when it has none."""
    doc = copy.deepcopy(compose_doc)
    _del(doc, "services.gpu-worker.user")
    assert compose_problems(doc, compose_schema, "1000:1000") == []
    assert any("gpu-worker: runs as root" in p for p in compose_problems(doc, compose_schema, None))


def test_compose_worker_wiring(compose_doc, dockerfile_args):
    resolved = interpolate(compose_doc)
    worker = resolved["services"]["gpu-worker"]
    assert worker["build"] == {
        "context": "..",
        "dockerfile": "docker/Dockerfile",
        "args": {"TORCH_CUDA": dockerfile_args["TORCH_CUDA"], "GIT_COMMIT": "unknown"},
    }
    env = worker["environment"]
    assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["PREFECT_WORK_POOL"] == "gpu" and env["PREFECT_WORKER_TYPE"] == "docker"
    assert env["GPTFORGE_IMAGE"] == worker["image"]
    assert "/var/run/docker.sock:/var/run/docker.sock" in worker["volumes"]
    for server in ("prefect-server", "mlflow"):
        assert worker["depends_on"][server] == {"condition": "service_healthy"}


def test_compose_servers_match_the_image_versions(compose_doc, dockerfile_args):
    services = interpolate(compose_doc)["services"]
    prefect_tag = services["prefect-server"]["image"].rsplit(":", 1)[1]
    assert prefect_tag == f"{dockerfile_args['PREFECT_VERSION']}-python{dockerfile_args['PYTHON_VERSION']}"
    assert services["mlflow"]["image"].rsplit(":", 1)[1] == f"v{dockerfile_args['MLFLOW_VERSION']}"
    command = services["mlflow"]["command"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert "mlflow" in command[command.index("--allowed-hosts") + 1].split(",")


@pytest.fixture(scope="module")
def serve_service(compose_doc) -> dict:
    return interpolate(compose_doc)["services"]["serve"]


def test_compose_serve_wiring(serve_service, compose_doc):
    resolved = interpolate(compose_doc)
    assert serve_service["profiles"] == ["serve"]  # started on request, once models are registered
    assert serve_service["ports"] == ["127.0.0.1:8000:8000"]
    assert compose_doc["services"]["serve"]["ports"] == ["127.0.0.1:${SERVE_PORT:-8000}:8000"]
    assert serve_service["image"] == resolved["services"]["gpu-worker"]["image"]
    assert serve_service["build"] == resolved["services"]["gpu-worker"]["build"]  # one image
    assert not is_root(serve_service["user"])
    env = serve_service["environment"]
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["SERVE_ENGINE"] == "gptforge"
    assert env["GPTFORGE_API_KEY"] == ""  # no key unless one is set
    assert compose_doc["services"]["serve"]["environment"]["GPTFORGE_API_KEY"] == "${GPTFORGE_API_KEY:-}"
    assert serve_service["depends_on"] == {"mlflow": {"condition": "service_healthy"}}
    test = serve_service["healthcheck"]["test"]
    assert test[0] == "CMD" and "http://127.0.0.1:8000/health" in test[-1]
    # Downloaded models go to the shared `cache` volume, where the image points the cache.
    mounts = dict(_volume_source_target(v) for v in serve_service["volumes"])
    assert mounts["cache"] == "/cache" and env["GPTFORGE_SERVE_CACHE"].startswith("/cache/")
    devices = serve_service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def _serve_argv(serve_service, tmp_path, **overrides) -> list[str]:
    """The arguments `gptforge` gets when the service's command runs in bash, with a stand-in
    `gptforge` and the service's environment (defaults, or `overrides` as .env would set)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "gptforge"
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$STUB_OUT"\n')
    stub.chmod(0o755)
    # `models:/gptforge-instruct@*` would match this file if the shell expanded globs.
    (tmp_path / "models:").mkdir(exist_ok=True)
    (tmp_path / "models:" / "gptforge-instruct@x").touch()
    out = tmp_path / "argv.txt"
    env = {
        **serve_service["environment"],
        **overrides,
        "STUB_OUT": str(out),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    command = serve_service["command"]
    assert command[:2] == ["bash", "-c"]
    subprocess.run(command, env=env, cwd=tmp_path, check=True, timeout=30)
    return out.read_text().splitlines()


def test_compose_serve_command(serve_service, tmp_path):
    assert _serve_argv(serve_service, tmp_path) == [
        "serve",
        "models:/gptforge-instruct@champion",
        "models:/gptforge-classify@champion",
        "--engine",
        "gptforge",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ]
    assert _serve_argv(serve_service, tmp_path, SERVE_ENGINE="vllm", SERVE_MODELS="models:/gptforge-instruct@*") == [
        "serve",
        "models:/gptforge-instruct@*",
        "--engine",
        "vllm",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ]


# --------------------------------------------------------------------------------------
# the gpu pool's job template
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool_template() -> dict:
    return json.loads(POOL_TEMPLATE.read_text())


def test_pool_template_is_consistent(pool_template):
    variables = pool_template["variables"]
    for key, value in pool_template["job_configuration"].items():
        placeholder = re.fullmatch(r"\{\{ (\w+) \}\}", value) if isinstance(value, str) else None
        assert placeholder and placeholder.group(1) in variables["properties"], key
    defaults = {k: v["default"] for k, v in variables["properties"].items() if "default" in v}
    jsonschema.validate(defaults, variables)
    # The GPU request that works in a Docker pool (FACTS.md): no `gpus` field exists there.
    assert defaults["container_create_kwargs"]["device_requests"] == [
        {"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}
    ]
    assert defaults["image_pull_policy"] == "IfNotPresent"  # the image is built on the host


def test_pool_template_matches_compose(pool_template, compose_doc, dockerfile_text):
    defaults = {k: v.get("default") for k, v in pool_template["variables"]["properties"].items()}
    resolved = interpolate(compose_doc)
    worker = resolved["services"]["gpu-worker"]
    assert defaults["image"] == worker["image"]
    assert defaults["networks"] == [resolved["networks"]["gptforge"]["name"]]
    assert defaults["env"]["MLFLOW_TRACKING_URI"] == worker["environment"]["MLFLOW_TRACKING_URI"]

    # Flow runs mount the compose volumes by their fixed names, at the worker's mount points.
    by_name = {v["name"]: key for key, v in resolved["volumes"].items()}
    worker_mounts = dict(_volume_source_target(v) for v in worker["volumes"])
    assert defaults["volumes"], "no volumes for the flow runs"
    for entry in defaults["volumes"]:
        name, target = entry.split(":")[:2]
        assert name in by_name, f"{name} is not a compose volume"
        assert worker_mounts.get(by_name[name]) == target, entry
        # created (and owned by the worker user) in the image, so a fresh volume gets its owner
        relative = target.removeprefix(WORKDIR + "/")
        assert relative in dockerfile_text, f"{target} is not created in the image"


def test_gpu_deployments_fit_the_image_and_compose(compose_doc):
    """The deployments on the `gpu` pool (prefect.yaml, tracked, deploys every stage there) run the
    code baked into the image, and whatever job variables they set agree with the compose project."""
    prefect_yaml = ROOT / "prefect.yaml"
    assert prefect_yaml.is_file(), f"{prefect_yaml} is missing"
    doc = yaml.safe_load(prefect_yaml.read_text()) or {}
    gpu = [d for d in doc.get("deployments") or [] if ((d.get("work_pool") or {}).get("name")) == "gpu"]
    assert gpu, "prefect.yaml has no deployment on the gpu pool"
    resolved = interpolate(compose_doc)
    worker = resolved["services"]["gpu-worker"]
    for deployment in gpu:
        name = f"{deployment.get('entrypoint')} ({deployment.get('name')})"
        steps = deployment.get("pull", doc.get("pull")) or []
        dirs = [(step.get("prefect.deployments.steps.set_working_directory") or {}).get("directory") for step in steps]
        assert WORKDIR in dirs, f"{name}: pull steps {steps}"
        variables = deployment["work_pool"].get("job_variables") or {}
        if "image" in variables:
            assert variables["image"] == worker["image"], f"{name}: the compose file builds {worker['image']}"
        if "networks" in variables:
            assert variables["networks"] == [resolved["networks"]["gptforge"]["name"]], name
        if "container_create_kwargs" in variables:  # replaces the pool's default as a whole
            requests = variables["container_create_kwargs"].get("device_requests") or []
            assert any(r.get("driver") == "nvidia" for r in requests), f"{name}: no GPU request"
        if "volumes" in variables:  # replaces the pool's default as a whole
            assert f"gptforge-dvc-cache:{WORKDIR}/.dvc/cache" in variables["volumes"], name
