"""`make docker-check`: the containerized worker built and run as its users run it, checked from outside.

It starts the Docker engine if none answers (as root) or says how, builds the CPU image
(docker/build.sh --cpu), starts the Prefect server, the MLflow server and the `cpu` worker with
the compose file (project, network and volumes named `gptforge-check`, ports 14200/15000/18000,
so a stack of the user's own is left alone), deploys `pipeline/cpu` from a container of the image,
and then runs that deployment as a user would, each flow run in a new container of the image:

1. with an image that does not exist (job variable): the flow run must end Crashed or Failed with
   the reason, not hang;
2. the named part of the quickstart from data through pretraining and instruction fine-tuning to
   `register@instruct`; the flow-run container is killed mid-pretraining: Crashed or Failed;
3. again: Completed, pretraining resumed from its checkpoint on the checkpoints volume, the
   finished stages restored from the DVC cache volume;
4. with the worker killed first and started again: the new worker takes it, Completed, no stage run.

Then from outside: the flow runs' states and task runs in Prefect's API; MLflow's runs, metrics,
checkpoint artifacts and the registered version with its `champion` alias; the DVC cache volume;
and the `serve-cpu` service answering /health and a chat completion from the champion. It tears
down what it started (containers, network, volumes) and prints the timings. Only the standard
library: it runs with the host's python3, before any venv exists. Every wait is bounded and says
what it waited for; a failure ends with one line, `docker-check: FAILED: ...`, and exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
NAME = os.environ.get("GPTFORGE_CHECK_NAME", "gptforge-check")
IMAGE = os.environ.get("GPTFORGE_CPU_IMAGE", "gptforge-cpu:latest")
PORTS = {
    "PREFECT_PORT": os.environ.get("GPTFORGE_CHECK_PREFECT_PORT", "14200"),
    "MLFLOW_PORT": os.environ.get("GPTFORGE_CHECK_MLFLOW_PORT", "15000"),
    "SERVE_PORT": os.environ.get("GPTFORGE_CHECK_SERVE_PORT", "18000"),
}
PREFECT = f"http://127.0.0.1:{PORTS['PREFECT_PORT']}/api"
MLFLOW = f"http://127.0.0.1:{PORTS['MLFLOW_PORT']}"
SERVE = f"http://127.0.0.1:{PORTS['SERVE_PORT']}"
OFFICIAL = {"PREFECT_IMAGE": "prefecthq/prefect:3.8.8-python3.11", "MLFLOW_IMAGE": "ghcr.io/mlflow/mlflow:v3.17.2"}
# The named part of the quickstart (dvc.yaml): prepare_pretrain, pretrain, evaluate@pretrain,
# prepare_instruct, finetune_instruct, evaluate@instruct, register@instruct. A checkpoint every
# 10 steps leaves pretraining's last 50 steps to be killed in.
STAGES = ["register@instruct"]
OVERRIDES = ["pretrain.ckpt_interval=10"]
CHAMPION = "gptforge-instruct"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
TIMINGS: list[tuple[str, float]] = []


class CheckFailed(Exception):
    """What went wrong, in one line."""


def say(message: str) -> None:
    print(f"docker-check: {message}", flush=True)


@contextlib.contextmanager
def timed(what: str):
    say(f"{what} ...")
    start = time.monotonic()
    yield
    TIMINGS.append((what, time.monotonic() - start))
    say(f"{what}: {TIMINGS[-1][1]:.1f} s")


def run(cmd: list[str], *, timeout: float = 120, env: dict | None = None, quiet: bool = True) -> str:
    """Run a command; its output, or CheckFailed with its last line."""
    try:
        done = subprocess.run(
            cmd,
            capture_output=quiet,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"`{' '.join(cmd[:4])} ...` did not finish within {timeout:.0f} s") from e
    if done.returncode != 0:
        tail = ((done.stderr or "") + (done.stdout or "")).strip().splitlines()
        raise CheckFailed(f"`{' '.join(cmd[:4])} ...` exited {done.returncode}: {tail[-1] if tail else ''}")
    return done.stdout or ""


def wait_for(what: str, probe, timeout: float, every: float = 1.0):
    """Call probe() until it returns something truthy, for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
        except (OSError, urllib.error.URLError, ValueError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def http(method: str, url: str, body: dict | None = None, timeout: float = 30):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def prefect(method: str, path: str, body: dict | None = None):
    return http(method, PREFECT + path, body)


# ---------------------------------------------------------------------------------------------
# the engine, compose and the stack
# ---------------------------------------------------------------------------------------------


def ensure_engine() -> None:
    if shutil.which("docker") is None:
        raise CheckFailed("no docker client; install Docker (Debian, as root: apt-get install -y docker.io)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        raise CheckFailed(
            "no Docker engine answers; start one (as root: nohup dockerd --storage-driver=overlay2 "
            ">/var/log/dockerd.log 2>&1 &, or systemctl start docker)"
        )
    say("no Docker engine answers: starting dockerd (log: /var/log/gptforge-dockerd.log)")
    with open("/var/log/gptforge-dockerd.log", "ab") as log:
        subprocess.Popen(["dockerd", "--storage-driver=overlay2"], stdout=log, stderr=log, start_new_session=True)
    wait_for(
        "dockerd to answer `docker info`",
        lambda: subprocess.run(["docker", "info"], capture_output=True).returncode == 0,
        60,
    )


# Disk the check takes on the disk of Docker's data root, measured here with `df` (docs/docker.md):
# the CPU image built from nothing peaks at 5.9 GB (4.3 GB stays: the image and the builder's
# cache), a rebuild over that cache at a few MB, the stack's containers and volumes 0.6 GB. With
# less free, the build dies midway ("no space left on device"); the check says so before it starts.
NEED_GB = {"build from nothing": 7.0, "image present": 1.0}


def disk_shortfall(build: bool) -> str | None:
    """Why this disk is too full for the check, in one line; None when it has room."""
    root = run(["docker", "info", "--format", "{{.DockerRootDir}}"]).strip() or "/var/lib/docker"
    present = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode == 0
    case = "image present" if present or not build else "build from nothing"
    free = shutil.disk_usage(root if os.path.exists(root) else "/").free / 1e9
    if free >= NEED_GB[case]:
        return None
    return (
        f"{free:.1f} GB free on the disk of Docker's data root {root}, the check needs about "
        f"{NEED_GB[case]:.0f} GB ({case}; docs/docker.md): free some (docker builder prune, docker image prune)"
    )


def compose_command() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise CheckFailed("no Docker Compose; install it (Debian 12: apt-get install -y docker-compose)")


def server_images() -> dict[str, str]:
    """The official Prefect and MLflow images where this engine has or can pull them, else ours."""
    chosen = {}
    for var, image in OFFICIAL.items():
        have = subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0
        if not have:
            try:
                have = subprocess.run(["docker", "pull", "-q", image], capture_output=True, timeout=180).returncode == 0
            except subprocess.TimeoutExpired:
                have = False
        chosen[var] = image if have else IMAGE
    return chosen


class Stack:
    """The compose project of the check: its environment and the commands on it."""

    def __init__(self, images: dict[str, str]):
        self.compose = compose_command() + ["-p", NAME, "-f", str(COMPOSE_FILE)]
        self.env = {
            **PORTS,
            **images,
            "GPTFORGE_CPU_IMAGE": IMAGE,
            "GPTFORGE_NETWORK": NAME,
            "GPTFORGE_VOLUME_PREFIX": NAME,
            "DOCKER_GID": str(os.stat("/var/run/docker.sock").st_gid),
            "SERVE_MODELS": f"models:/{CHAMPION}@champion",
        }

    def __call__(self, *args: str, timeout: float = 300) -> str:
        return run(self.compose + ["--profile", "cpu", "--profile", "cpu-serve", *args], env=self.env, timeout=timeout)

    def container(self, service: str) -> str:
        ids = self("ps", "-q", service).split()
        if not ids:
            raise CheckFailed(f"no container of service {service}")
        return ids[0]

    def down(self) -> None:
        self("down", "--volumes", "--remove-orphans", timeout=180)


def start_stack(stack: Stack) -> str:
    """Servers and worker up, healthy, the pool made by the worker; the deployment's id."""
    stack("up", "-d", "prefect-server", "mlflow", "cpu-worker")
    wait_for("Prefect's /api/health", lambda: http("GET", PREFECT + "/health") is True, 240, 2)
    wait_for("MLflow's /health", lambda: urllib.request.urlopen(MLFLOW + "/health", timeout=5).status == 200, 240, 2)
    wait_for("the worker to create the `cpu` pool", lambda: prefect("GET", "/work_pools/cpu"), 180, 2)
    wait_for("a worker of pool `cpu` online", lambda: online_workers(), 180, 2)
    with timed("deploy pipeline/cpu from a container of the image"):
        run(
            [
                "docker",
                "run",
                "--rm",
                "--network",
                NAME,
                "-e",
                "PREFECT_API_URL=http://prefect-server:4200/api",
                IMAGE,
                "prefect",
                "--no-prompt",
                "deploy",
                "--name",
                "pipeline/cpu",
            ],
            timeout=300,
        )
    return prefect("GET", "/deployments/name/pipeline/cpu")["id"]


def online_workers() -> list:
    workers = prefect("POST", "/work_pools/cpu/workers/filter", {})
    return [w for w in workers if w.get("status") == "ONLINE"]


# ---------------------------------------------------------------------------------------------
# flow runs
# ---------------------------------------------------------------------------------------------


def create_run(deployment: str, job_variables: dict | None = None) -> str:
    body = {"parameters": {"stages": STAGES, "overrides": OVERRIDES}, "job_variables": job_variables or {}}
    return prefect("POST", f"/deployments/{deployment}/create_flow_run", body)["id"]


def state(run_id: str) -> dict:
    return prefect("GET", f"/flow_runs/{run_id}")["state"] or {}


def wait_terminal(run_id: str, what: str, timeout: float) -> dict:
    return wait_for(what, lambda: (s := state(run_id)).get("type") in TERMINAL and s, timeout, 2)


def flow_run_container(run_id: str) -> tuple[str, str]:
    """(container id, image) of the flow run's container, once the worker has started it."""
    out = run(["docker", "ps", "--filter", f"label=io.prefect.flow-run-id={run_id}", "--format", "{{.ID}} {{.Image}}"])
    parts = out.split()
    return (parts[0], parts[1]) if len(parts) >= 2 else ("", "")


def summary_rows(run_id: str) -> list[tuple[str, str, str]]:
    """(stage, status, duration) from the pipeline's `pipeline-summary` artifact (a markdown table)."""
    body = {"artifacts": {"flow_run_id": {"any_": [run_id]}, "key": {"any_": ["pipeline-summary"]}}}
    artifacts = prefect("POST", "/artifacts/filter", body)
    if not artifacts:
        raise CheckFailed(f"flow run {run_id} left no pipeline-summary artifact")
    rows = []
    for line in artifacts[0]["data"].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            # "| `pretrain` | <icon> ran | 12.3 s | ..." (gptforge.pipeline.run.PipelineReport.markdown)
            known = [s for s in ("up to date", "restored", "ran", "failed", "not run") if cells[1].endswith(s)]
            rows.append((cells[0].strip("`"), known[0] if known else cells[1], cells[2]))
    return rows


def summary_statuses(run_id: str) -> dict[str, str]:
    """Each stage's status from the pipeline's summary."""
    return {stage: status for stage, status, _ in summary_rows(run_id)}


def subflows(run_id: str) -> list[dict]:
    return prefect("POST", "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})


def task_run_count(run_ids: list[str]) -> int:
    return prefect("POST", "/task_runs/count", {"flow_runs": {"id": {"any_": run_ids}}})


def state_reason(run_id: str) -> str:
    """The state message, or the flow run's last log lines, for the report of a failed run."""
    s = state(run_id)
    logs = prefect(
        "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_DESC", "limit": 3}
    )
    last = " / ".join(log["message"].splitlines()[0] for log in logs)
    return f"{s.get('type')}: {s.get('message') or ''} {('(logs: ' + last + ')') if last else ''}".strip()


# ---------------------------------------------------------------------------------------------
# the scenario
# ---------------------------------------------------------------------------------------------


def check_missing_image(deployment: str) -> None:
    with timed("a flow run whose image is missing ends Crashed or Failed"):
        run_id = create_run(deployment, {"image": "gptforge-missing-image:latest"})
        final = wait_terminal(run_id, "the flow run with a missing image to end", 180)
        if final["type"] not in ("CRASHED", "FAILED"):
            raise CheckFailed(f"a flow run with a missing image ended {final['type']}")
        say(f"  missing image -> {state_reason(run_id)[:300]}")


def killed_run(deployment: str) -> str:
    """Run the part, kill its container once pretraining has written a checkpoint."""
    with timed("run 1: killed mid-pretraining"):
        run_id = create_run(deployment)
        container, image = wait_for(
            "the worker to start the flow-run container",
            lambda: flow_run_container(run_id)[0] and flow_run_container(run_id),
            300,
        )
        say(f"  flow run {run_id} in container {container[:12]} of image {image}")

        def has_checkpoint():
            if state(run_id).get("type") in TERMINAL:
                raise CheckFailed("run 1 ended before pretraining wrote a checkpoint to kill it after")
            out = subprocess.run(
                ["docker", "exec", container, "sh", "-c", "ls checkpoints/pretrain 2>/dev/null"],
                capture_output=True,
                text=True,
            )
            return [n for n in out.stdout.split() if n.startswith("step_")]

        steps = wait_for("pretraining's first checkpoint (checkpoints/pretrain/step_*)", has_checkpoint, 600, 0.5)
        run(["docker", "kill", container])
        say(f"  killed the flow-run container after {steps[-1]}")
        final = wait_terminal(run_id, "the killed flow run to end", 180)
        if final["type"] not in ("CRASHED", "FAILED"):
            raise CheckFailed(f"the killed flow run ended {final['type']}")
        say(f"  killed run -> {state_reason(run_id)[:300]}")
    return run_id


def completed_run(deployment: str, label: str) -> tuple[str, dict]:
    """Run the part once more and wait for Completed; (flow run id, each stage's status)."""
    run_id = create_run(deployment)
    image = ""
    deadline = time.monotonic() + 1200
    while (s := state(run_id)).get("type") not in TERMINAL:
        image = image or flow_run_container(run_id)[1]
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after 1200 s waiting for {label} (state {s.get('type')})")
        time.sleep(2)
    if s["type"] != "COMPLETED":
        raise CheckFailed(f"{label}: flow run {run_id} {state_reason(run_id)}")
    rows = summary_rows(run_id)
    statuses = {stage: status for stage, status, _ in rows}
    say(f"  flow run {run_id} Completed in a container of {image or '(too quick to see)'}: {statuses}")
    ran = [f"{stage} {seconds}" for stage, status, seconds in rows if status == "ran"]
    say(f"  stages run in the container: {', '.join(ran) or 'none'}")
    return run_id, statuses


def check_resumed(stack: Stack, statuses: dict) -> None:
    if statuses.get("pretrain") != "ran":
        raise CheckFailed(f"run 2: pretrain {statuses.get('pretrain')}, expected ran (resumed)")
    if statuses.get("prepare_pretrain") not in ("restored", "up to date"):
        raise CheckFailed(
            f"run 2: prepare_pretrain {statuses.get('prepare_pretrain')}, expected restored from the DVC cache"
        )
    logs = run(stack.compose + ["logs", "--no-color", "cpu-worker"], env=stack.env)
    resumed = [line for line in logs.splitlines() if "resumed from" in line]
    if not resumed:
        raise CheckFailed("run 2: pretrain did not log 'resumed from ... at step N'")
    say(f"  {resumed[-1].split('|', 1)[-1].strip()[:160]}")


def restarted_worker_run(deployment: str, stack: Stack) -> str:
    with timed("run 3: worker killed, restarted, takes the next run; no stage runs"):
        run(["docker", "kill", stack.container("cpu-worker")])
        wait_for("the killed worker to leave", lambda: not running_service(stack, "cpu-worker"), 60)
        run_id = create_run(deployment)
        time.sleep(1)
        if state(run_id).get("type") not in ("SCHEDULED", "PENDING"):
            raise CheckFailed(f"run 3 started without a worker: {state(run_id).get('type')}")
        stack("up", "-d", "cpu-worker")
        final = wait_terminal(run_id, "run 3 to end", 600)
        if final["type"] != "COMPLETED":
            raise CheckFailed(f"run 3: {state_reason(run_id)}")
        statuses = summary_statuses(run_id)
        ran = [name for name, status in statuses.items() if status == "ran"]
        if ran or not statuses:
            raise CheckFailed(f"run 3 re-ran {ran} (statuses {statuses})")
        say(f"  run 3 Completed, no stage ran: {statuses}")
    return run_id


def running_service(stack: Stack, service: str) -> bool:
    ids = stack("ps", "-q", service).split()
    return bool(ids) and run(["docker", "inspect", "-f", "{{.State.Running}}", ids[0]]).strip() == "true"


def check_prefect(run_ids: list[str]) -> None:
    for run_id in run_ids:
        children = subflows(run_id)
        tasks = task_run_count([run_id] + [c["id"] for c in children])
        states = sorted({c["state_type"] for c in children})
        if tasks == 0 or any(s != "COMPLETED" for s in states):
            raise CheckFailed(f"flow run {run_id}: {tasks} task runs, subflow states {states}")
        say(f"  Prefect: flow run {run_id} Completed, {len(children)} stage subflows {states}, {tasks} task runs")


def check_mlflow() -> str:
    experiment = http("GET", MLFLOW + "/api/2.0/mlflow/experiments/get-by-name?experiment_name=gptforge")
    eid = experiment["experiment"]["experiment_id"]
    runs = http("POST", MLFLOW + "/api/2.0/mlflow/runs/search", {"experiment_ids": [eid], "max_results": 200}).get(
        "runs", []
    )
    with_metrics = [r for r in runs if r["data"].get("metrics")]
    if not with_metrics:
        raise CheckFailed("MLflow: no run with metrics")
    alias = http("GET", MLFLOW + f"/api/2.0/mlflow/registered-models/alias?name={CHAMPION}&alias=champion")
    version = alias["model_version"]
    if version.get("status") != "READY":
        raise CheckFailed(f"MLflow: {CHAMPION} v{version['version']} is {version.get('status')}")
    # The checkpoints: the training stages' runs carry their weights as artifacts.
    checkpoints = {}
    for r in runs:
        if r["info"].get("run_name") in ("pretrain", "finetune_instruct"):
            files = artifact_files(r["info"]["run_id"], "")
            # (run 1's pretrain run was killed before it logged any: one run of each stage will do)
            checkpoints.setdefault(r["info"]["run_name"], []).extend(f for f in files if f.endswith(".safetensors"))
    if not checkpoints or not all(checkpoints.values()):
        raise CheckFailed(f"MLflow: checkpoint artifacts of the training runs: {checkpoints}")
    say(
        f"  MLflow: {len(runs)} runs ({len(with_metrics)} with metrics); {CHAMPION} version {version['version']} "
        f"@champion, READY, from run {version['run_id']}; checkpoints "
        + "; ".join(f"{k}: {v[0]}" for k, v in checkpoints.items())
    )
    return version["run_id"]


def artifact_files(run_id: str, path: str, depth: int = 0) -> list[str]:
    listing = http("GET", MLFLOW + f"/api/2.0/mlflow/artifacts/list?run_id={run_id}&path={path}")
    out = []
    for f in listing.get("files", []):
        if f.get("is_dir") and depth < 3:
            out += artifact_files(run_id, f["path"], depth + 1)
        elif not f.get("is_dir"):
            out.append(f["path"])
    return out


def check_dvc_cache() -> None:
    out = run(
        [
            "docker",
            "run",
            "--rm",
            "--entrypoint",
            "sh",
            "-v",
            f"{NAME}-dvc-cache:/c",
            IMAGE,
            "-c",
            "find /c/files -type f | wc -l; find /c/runs -type f | wc -l",
        ]
    )
    files, runs = (int(x) for x in out.split())
    if files == 0 or runs == 0:
        raise CheckFailed(f"the DVC cache volume holds {files} files and {runs} run-cache entries")
    say(f"  DVC cache volume {NAME}-dvc-cache: {files} cached files, {runs} run-cache entries")


def check_serve(stack: Stack) -> None:
    with timed("serve-cpu: /health and a chat completion from the champion"):
        stack("up", "-d", "serve-cpu")
        wait_for(
            "serve-cpu's /health", lambda: urllib.request.urlopen(SERVE + "/health", timeout=5).status == 200, 300, 2
        )
        model = http("GET", SERVE + "/v1/models")["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Name a primary color."}],
            "max_tokens": 24,
            "temperature": 0,
        }
        reply = http("POST", SERVE + "/v1/chat/completions", body, timeout=120)
        answer = reply["choices"][0]["message"]["content"]
        if not isinstance(answer, str) or reply["usage"]["completion_tokens"] < 1:
            raise CheckFailed(f"serve-cpu answered {reply}")
        say(f"  served {model}: {answer.strip()[:120]!r} ({reply['usage']['completion_tokens']} tokens)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the stack running (and its volumes) at the end")
    parser.add_argument("--no-build", action="store_true", help=f"use the existing {IMAGE}")
    parser.add_argument(
        "--disk-only", action="store_true", help="only say whether this disk has room for the check (exit 3 if not)"
    )
    args = parser.parse_args()
    # A SIGTERM (CI's timeout, a Ctrl-C'd make) still tears the stack down: SystemExit runs `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    stack = None
    try:
        ensure_engine()
        shortfall = disk_shortfall(build=not args.no_build)
        if args.disk_only:
            say(shortfall or "this disk has room for the check")
            return 3 if shortfall else 0
        if shortfall:
            raise CheckFailed(shortfall)
        if not args.no_build:
            with timed(f"build {IMAGE}"):
                run([str(ROOT / "docker" / "build.sh"), "--cpu", "--tag", IMAGE], timeout=1800, quiet=False)
        images = server_images()
        say(f"server images: Prefect {images['PREFECT_IMAGE']}, MLflow {images['MLFLOW_IMAGE']}")
        stack = Stack(images)
        stack.down()  # what a previous check left behind
        with timed("stack up: Prefect server, MLflow server, cpu worker, pool, deployment"):
            deployment = start_stack(stack)
        check_missing_image(deployment)
        killed_run(deployment)
        with timed("run 2: resumes and completes"):
            run2, statuses = completed_run(deployment, "run 2")
            check_resumed(stack, statuses)
        run3 = restarted_worker_run(deployment, stack)
        with timed("checks from outside: Prefect, MLflow, the DVC cache volume"):
            check_prefect([run2])
            check_mlflow()
            check_dvc_cache()
        say(f"  run 3 made no stage subflow: {len(subflows(run3))} subflows")
        check_serve(stack)
    except CheckFailed as e:
        if stack is not None:
            with contextlib.suppress(CheckFailed):
                say(
                    "the worker's last lines:\n"
                    + "\n".join(
                        run(
                            stack.compose + ["logs", "--no-color", "--tail", "30", "cpu-worker"], env=stack.env
                        ).splitlines()[-30:]
                    )
                )
        print(f"docker-check: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if stack is not None and not args.keep:
            with timed("tear down (containers, network, volumes)"), contextlib.suppress(CheckFailed):
                stack.down()
        for what, seconds in TIMINGS:
            print(f"  {seconds:7.1f} s  {what}")
        print(f"  {time.monotonic() - started:7.1f} s  in all")
    say("passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
