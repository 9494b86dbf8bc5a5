"""The recorder's Prefect side: a stage's journal records (`gptforge.runtime.journal`) made into
a Prefect flow run with its task runs, logs and artifacts, through Prefect's synchronous client.
Log lines keep their records' times; states do not: Prefect's API (3.8) takes no time with a
state (`StateCreate` has no timestamp, the server stamps it on arrival), so a flow or task run's
start and end are when the recorder delivered them: a fraction of a second after the record
with a recorder that keeps up, later for records held through an outage.

`PrefectSink.apply(delivery, group)` applies one group of consecutive records of one journal
(consecutive `log` records go out as one `create_logs`). It raises what Prefect raised; the
recorder (`flows/recorder.py`) retries what is worth retrying and logs and skips the rest.
What it makes can be made again without a duplicate, so a recorder killed between a request
and saving its cursor does no harm: the flow run carries the journal's key as its idempotency
key, and a task run is keyed by (flow run, task key, dynamic key) on the server: the step's key
for a step, the journal's key for the tracker task run of a subflow.

A stage started by the pipeline is a subflow of the pipeline's flow run, as `run_stage_flow`
(`flows/stages.py`) makes it in-process: a tracker task run in the parent flow run, then the
flow run with it as `parent_task_run_id`; at `close` the tracker is settled like the flow run.
The parent is named by its flow run id (a pipeline in Prefect's engine: a deployment) or by its
journal's key (`gptforge pipeline` typed: its flow run is a journal too): the child's open waits
until the recorder has made the parent's flow run.

`OwnServer` is the recorder's own `prefect server start`, for journals with no API URL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gptforge.runtime.journal import Skip, Waiting

log = logging.getLogger("gptforge.recorder")

FINAL = {"COMPLETED": "Completed", "FAILED": "Failed", "CRASHED": "Crashed"}
LOG_BATCH = 200


def when(seconds: float) -> datetime:
    return datetime.fromtimestamp(float(seconds), tz=timezone.utc)


def level_number(level: Any) -> int:
    if isinstance(level, int):
        return level
    number = logging.getLevelName(str(level).upper())
    return number if isinstance(number, int) else logging.INFO


def _noop() -> None:
    """Stands for a stage's step or flow: the recorder never runs it."""


class PrefectSink:
    """Prefect clients (one per API URL) shared by every journal."""

    def __init__(self) -> None:
        from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

        self._clients: dict[str, Any] = {}
        self._tasks: dict[str, Any] = {}
        # The recorder retries with its own backoff, journal by journal: Prefect's retries (about a
        # minute for a server that went away) would hold every journal. For the recorder's life
        # (its one thread), unless the environment says otherwise.
        defaults = ((PREFECT_CLIENT_MAX_RETRIES, 0), (PREFECT_API_REQUEST_TIMEOUT, 30.0))
        updates = {setting: value for setting, value in defaults if setting.name not in os.environ}
        self._settings = temporary_settings(updates=updates)
        self._settings.__enter__()

    def client(self, url: str):
        """An entered synchronous client for `url` (`get_client` under temporary settings: the
        recorder serves several APIs, and without a URL Prefect would start a server of its own)."""
        if url not in self._clients:
            from prefect.client.orchestration import get_client
            from prefect.settings import PREFECT_API_URL, temporary_settings

            with temporary_settings(updates={PREFECT_API_URL: url}):
                client = get_client(sync_client=True)
            client.__enter__()
            self._clients[url] = client
        return self._clients[url]

    def drop(self, url: str) -> None:
        """Forget the client of `url` (after a failure: the next one starts afresh)."""
        client = self._clients.pop(url, None)
        if client is not None:
            try:
                client.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - closing a broken client
                pass

    def close(self) -> None:
        for url in list(self._clients):
            self.drop(url)
        with contextlib.suppress(Exception):
            self._settings.__exit__(None, None, None)

    def _task(self, name: str, key: str):
        from prefect import Task

        if key not in self._tasks:
            task = Task(fn=_noop, name=name)
            task.task_key = key
            self._tasks[key] = task
        return self._tasks[key]

    # ---------------------------------------------------------------------------------------

    def apply(self, d, url: str, group: list[dict]) -> None:
        from prefect import states

        client = self.client(url)
        first = group[0]
        kind = first["kind"]
        state = d.state
        if kind == "open":
            self._open(d, client, first)
            return
        flow_run_id = state.get("flow_run_id")
        if flow_run_id is None:
            raise Skip("no Prefect flow run in this journal (its open was not recorded)")
        if kind == "log":
            self._logs(d, client, group)
        elif kind == "step_start":
            step = str(first["step"])
            if step in state["tasks"]:
                return
            name = str(first.get("name") or step)
            task = self._task(name, f"gptforge.step.{d.state['open'].get('flow_name')}.{name}")
            # Named as Prefect's engine names task runs: the task's name, then a number.
            made = client.create_task_run(
                task=task,
                flow_run_id=uuid.UUID(flow_run_id),
                dynamic_key=step,
                name=f"{name}-{step.rsplit('-', 1)[-1]}",
                state=states.Running(),
            )
            state["tasks"][step] = str(made.id)
            d.save()
        elif kind == "step_retry":
            task_run_id = self._task_run(d, first)
            again = when(first["time"] + float(first.get("delay") or 0))
            message = first.get("message") or f"attempt {first.get('attempt')} failed"
            client.set_task_run_state(
                task_run_id, states.AwaitingRetry(scheduled_time=again, message=message), force=True
            )
            client.set_task_run_state(task_run_id, states.Retrying(), force=True)
        elif kind == "step_end":
            task_run_id = self._task_run(d, first)
            client.set_task_run_state(task_run_id, final_state(first.get("state"), first.get("message")), force=True)
            if str(first["step"]) not in state["ended_steps"]:
                state["ended_steps"].append(str(first["step"]))
        elif kind == "artifact_md":
            from prefect.client.schemas.actions import ArtifactCreate

            artifact = ArtifactCreate(
                key=first.get("key"),
                type="markdown",
                description=first.get("description"),
                data=str(first.get("markdown") or ""),
                flow_run_id=uuid.UUID(flow_run_id),
            )
            # The API itself, not client.create_artifact: that also emits an event through
            # Prefect's events worker, which would go to the process's own API setting.
            client.request("POST", "/artifacts/", json=artifact.model_dump(mode="json", exclude_unset=True))
        else:
            raise Skip(f"unknown Prefect record kind {kind!r}")

    def finish(self, d, url: str, state_name: str, message: str | None) -> None:
        """At `close` (or for a journal whose writer was killed): its task runs still open, the
        tracker task run in the parent flow run, then the flow run get the final state (forced)."""
        client = self.client(url)
        state = d.state
        for step, task_run_id in state["tasks"].items():
            if step not in state["ended_steps"]:
                client.set_task_run_state(uuid.UUID(task_run_id), final_state(state_name, message), force=True)
                state["ended_steps"].append(step)
                d.save()
        if state.get("tracker_task_run_id") and not state.get("tracker_settled"):
            client.set_task_run_state(
                uuid.UUID(state["tracker_task_run_id"]), final_state(state_name, message), force=True
            )
            state["tracker_settled"] = True
            d.save()
        if state.get("flow_run_id"):
            client.set_flow_run_state(uuid.UUID(state["flow_run_id"]), final_state(state_name, message), force=True)

    # ---------------------------------------------------------------------------------------

    def _task_run(self, d, record: dict) -> uuid.UUID:
        task_run_id = d.state["tasks"].get(str(record.get("step")))
        if task_run_id is None:
            raise Skip(f"no task run for step {record.get('step')!r} (its step_start was not recorded)")
        return uuid.UUID(task_run_id)

    def _open(self, d, client, rec: dict) -> None:
        """The flow run, Running since the record's time; first, for a subflow, its tracker task
        run in the parent flow run (a parent the server does not know: a flow run of its own)."""
        from prefect import Flow, states

        state = d.state
        if state.get("flow_run_id"):
            return
        name = str(rec.get("flow_name") or rec.get("stage") or "stage")
        prefect = rec.get("prefect") or {}
        parent = prefect.get("parent_flow_run_id") or parent_of(d.path.parent, prefect.get("parent_journal"))
        if parent and not state.get("tracker_task_run_id") and not state.get("no_tracker"):
            tracker = self._task(name, f"gptforge.stage.{name}")
            try:
                made = client.create_task_run(
                    task=tracker,
                    flow_run_id=uuid.UUID(str(parent)),
                    dynamic_key=d.key,
                    name=name,
                    state=states.Running(),
                )
                state["tracker_task_run_id"] = str(made.id)
            except Exception as e:
                if not _refused(e):
                    raise
                log.warning(
                    "journal %s: parent flow run %s not found (%s): a flow run of its own",
                    d.key,
                    parent,
                    " ".join(str(e).split())[:200],
                )
                state["no_tracker"] = True
            d.save()
        flow = Flow(_noop, name=name, description=rec.get("summary"))
        made = create_flow_run(
            client,
            flow,
            parameters=rec.get("parameters") or {},
            parent_task_run_id=state.get("tracker_task_run_id"),
            state=states.Running(),
            idempotency_key=f"gptforge-journal-{d.key}",
        )
        state["flow_run_id"], state["flow_run_name"] = str(made.id), made.name
        d.save()

    def _logs(self, d, client, group: list[dict]) -> None:
        from prefect.client.schemas.actions import LogCreate

        flow_run_id = uuid.UUID(d.state["flow_run_id"])
        logs = []
        for rec in group:
            task_run_id = d.state["tasks"].get(str(rec["step"])) if rec.get("step") is not None else None
            logs.append(
                LogCreate(
                    name=str(rec.get("logger") or "gptforge"),
                    level=level_number(rec.get("level")),
                    message=str(rec.get("message") or ""),
                    timestamp=when(rec["time"]),
                    flow_run_id=flow_run_id,
                    task_run_id=uuid.UUID(task_run_id) if task_run_id else None,
                )
            )
        for i in range(0, len(logs), LOG_BATCH):
            client.create_logs(logs[i : i + LOG_BATCH])


class OwnServer:
    """The recorder's own `prefect server start` on a free loopback port, started when first
    needed, in a session of its own and told to end with the recorder even when the recorder is
    killed (PR_SET_PDEATHSIG, through a short trampoline that then execs the server)."""

    TRAMPOLINE = (
        "import ctypes, os, signal, sys\n"
        "try:\n    ctypes.CDLL(None).prctl(1, signal.SIGTERM)\nexcept Exception:\n    pass\n"
        "if os.getppid() != int(sys.argv[1]):\n    sys.exit(1)\n"
        "os.execv(sys.argv[2], sys.argv[2:])\n"
    )

    def __init__(self, folder: Path, timeout: float, on_url) -> None:
        self.folder, self.timeout, self.on_url = folder, timeout, on_url
        self.proc = None
        self.url: str | None = None
        self.started_at = 0.0
        self.next_try = 0.0
        self.failures = 0
        self._probe = 0.0

    def want(self) -> None:
        if self.proc is None and time.monotonic() >= self.next_try:
            self._start()
        elif self.proc is not None:
            self.poll()

    def _start(self) -> None:
        import subprocess

        port = _free_port(self.folder / "prefect-port")
        exe = Path(sys.executable).parent / "prefect"
        exe = str(exe) if exe.is_file() else shutil.which("prefect") or "prefect"
        self._url = f"http://127.0.0.1:{port}/api"
        env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": self._url}
        env.pop("PREFECT_API_URL", None)
        with open(self.folder / "prefect-server.log", "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    self.TRAMPOLINE,
                    str(os.getpid()),
                    exe,
                    "server",
                    "start",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        log.info("starting a Prefect server at %s (pid %d)", self._url, self.proc.pid)

    def poll(self) -> None:
        """While starting: healthy yet? (at most every 0.5 s); failed or too slow: stopped, and
        tried again after a backoff. Once up: still there?"""
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            log.warning(
                "the Prefect server exited (%s); see %s", self.proc.returncode, self.folder / "prefect-server.log"
            )
            self._failed()
            return
        if self.url is not None or time.monotonic() - self._probe < 0.5:
            return
        self._probe = time.monotonic()
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self._url}/health", timeout=1) as r:
                ok = r.status == 200
        except OSError:
            ok = False
        if ok:
            self.url, self.failures = self._url, 0
            log.info("Prefect server up at %s after %.1f s", self.url, time.monotonic() - self.started_at)
            self.on_url(self.url)
        elif time.monotonic() - self.started_at > self.timeout:
            log.warning("the Prefect server at %s did not answer within %.0f s", self._url, self.timeout)
            self._failed()

    def _failed(self) -> None:
        self.stop()
        self.failures += 1
        self.next_try = time.monotonic() + min(30.0, 2.0 ** (self.failures - 1))

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if self.url is not None:
            self.url = None
            self.on_url(None)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - TimeoutExpired: killed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _free_port(remembered: Path) -> int:
    """The port the last server had, when it is free (a client that kept the URL finds the new
    server there), else a free one, remembered for next time."""
    import socket

    with contextlib.suppress(OSError, ValueError):
        port = int(remembered.read_text())
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
            s.bind(("127.0.0.1", port))
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remembered.write_text(str(port))
    return port


def parent_of(records: Path, key: str | None) -> str | None:
    """The flow run id of journal `key` in `records` once the recorder has made it; Waiting
    while that journal is there without one; None when it is gone (delivered, or never there:
    the child becomes a flow run of its own)."""
    import json

    if not key:
        return None
    with contextlib.suppress(OSError, ValueError):
        made = json.loads((records / f"{key}.state.json").read_text(encoding="utf-8")).get("flow_run_id")
        if made:
            return str(made)
    if (records / f"{key}.jsonl").exists():
        raise Waiting(f"the flow run of parent journal {key} is not made yet")
    log.warning("parent journal %s is gone before its flow run was made: a flow run of its own", key)
    return None


def final_state(name: str | None, message: str | None):
    """Completed / Failed / Crashed (an unknown name: Failed)."""
    from prefect import states

    make = getattr(states, FINAL.get(str(name or "").upper(), "Failed"))
    return make(message=message)


def create_flow_run(client, flow, *, parameters: dict, parent_task_run_id: str | None, state, idempotency_key: str):
    """`client.create_flow_run` (Prefect 3.8) with an idempotency key, which it does not take:
    made again with the same key, the server answers with the flow run it made the first time."""
    from prefect.client.schemas.actions import FlowCreate, FlowRunCreate
    from prefect.client.schemas.objects import Flow as FlowModel
    from prefect.client.schemas.objects import FlowRun, FlowRunPolicy
    from prefect.states import to_state_create

    response = client.request("POST", "/flows/", json=FlowCreate(name=flow.name).model_dump(mode="json"))
    flow_id = FlowModel.model_validate(response.json()).id
    create = FlowRunCreate(
        flow_id=flow_id,
        flow_version=flow.version,
        parameters=parameters,
        parent_task_run_id=uuid.UUID(parent_task_run_id) if parent_task_run_id else None,
        state=to_state_create(state),
        idempotency_key=idempotency_key,
        empirical_policy=FlowRunPolicy(retries=flow.retries, retry_delay=int(flow.retry_delay_seconds or 0)),
    )
    response = client.request("POST", "/flow_runs/", json=create.model_dump(mode="json", exclude_unset=True))
    return FlowRun.model_validate(response.json())


def _refused(e: BaseException) -> bool:
    """A 4xx answer (the parent flow run does not exist)."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    return isinstance(status, int) and 400 <= status < 500
