"""A Prefect server that goes away during a training run never costs the run.

- Killed while `gptforge pretrain` is held mid-training (gptforge.runtime.pause), and started again once
  the run has trained (same port, same database): the training runs on and ends with the same
  weights as an undisturbed run, and the flow run and its task runs end Completed in the
  restarted server: what could not be sent meanwhile was sent when it was back.
- Killed and never started again: the training still finishes, exit 0, and its last warning
  says what could not be recorded.
- The pieces, without a server: a finished flow whose final state cannot be recorded keeps its
  result; a failure of the work itself is never mistaken for an outage.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable

import httpx
import pytest
import torch
from cli_support import BIN, cli_env, run_cli, set_params, stage_params
from process_support import Paused, free_port, prefect_home, records_delivered, wait_http
from safetensors.torch import load_file


class PrefectServer:
    """`prefect server start` on a fixed loopback port and database, that can be killed and
    started again."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        with open(self.home / "server.log", "a") as log:
            self.proc = subprocess.Popen(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_http(f"{self.url}/health", timeout=180, proc=self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def post(self, path: str, body: dict) -> list[dict]:
        req = urllib.request.Request(
            f"{self.url}/{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)


@pytest.fixture
def prefect_server(tmp_path):
    server = PrefectServer(prefect_home(tmp_path / "prefect-home"))
    server.start()
    yield server
    server.kill()


def _repo_with_data(tmp_path: Path, name: str, small_tokenizer, sms_file, alpaca_file, **params) -> Path:
    repo = tmp_path / name
    repo.mkdir()
    from cli_support import REPO

    for f in ("dvc.yaml", "params.yaml"):
        shutil.copy(REPO / f, repo / f)
    set_params(
        repo, **{**stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file), "tracking.enabled": False, **params}
    )
    out = run_cli(["prepare", "pretrain"], repo, cli_env(GPTFORGE_PREFECT="0"))
    assert out.returncode == 0, out.stderr[-2000:]
    return repo


TRAINING = {
    "pretrain.max_steps": 200,
    "pretrain.log_interval": 100,
    "pretrain.eval_interval": 1000,
    "pretrain.ckpt_interval": 1000,
    "pretrain.keep_last": 1,
    "model.dropout": 0.1,
}
PAUSE_AT = 100  # the server is killed while the run is held after this step


def _weights(repo: Path) -> dict[str, torch.Tensor]:
    return load_file(repo / "checkpoints/pretrain/final/model.safetensors")


def _until(condition: Callable[[], bool], proc: subprocess.Popen, log: Path, what: str, timeout: float = 600) -> None:
    """Wait for `condition()` while `proc` runs. The timeout is a bound against a hang only."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"pretrain ended (exit {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _pretrain_through(
    outage: Callable[[subprocess.Popen, Path, Paused], None], repo: Path, env: dict, log: Path
) -> tuple[subprocess.Popen, str]:
    """`gptforge pretrain`, held after step PAUSE_AT, where `outage(proc, log, paused)` acts
    (it releases the run); returns the ended process and its output."""
    paused = Paused(log.parent, PAUSE_AT)
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(BIN / "gptforge"), "pretrain"],
            cwd=repo,
            env={**env, **paused.env()},
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        paused.wait(proc, output=log.read_text)
        outage(proc, log, paused)
        proc.wait(timeout=600)  # a bound against a hang: Prefect's retries below may take minutes
    finally:
        paused.release()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, log.read_text()


@pytest.mark.slow
def test_prefect_server_restarted_mid_run(tmp_path, prefect_server, small_tokenizer, sms_file, alpaca_file):
    """The server is killed while the run is held, and started again only once the run has ended:
    the stage never talks to Prefect (its journal does), so it trains and ends as if nothing
    happened, and the recorder delivers its flow run and task runs once the server is back."""
    reference = _repo_with_data(tmp_path, "reference", small_tokenizer, sms_file, alpaca_file, **TRAINING)
    repo = _repo_with_data(tmp_path, "disturbed", small_tokenizer, sms_file, alpaca_file, **TRAINING)
    env = cli_env(PREFECT_API_URL=prefect_server.url, OMP_NUM_THREADS="1", GPTFORGE_WAIT_FOR_RECORDS="0")

    times = {}

    def outage(proc: subprocess.Popen, log: Path, paused: Paused) -> None:
        prefect_server.kill()
        times["down"] = time.monotonic()
        # The undisturbed run, while the disturbed one is paused (never two trainings at once).
        out = run_cli(["pretrain"], reference, cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1"))
        assert out.returncode == 0, out.stderr[-3000:]
        paused.release()
        proc.wait(timeout=600)  # it ends with the server away
        times["ended"] = time.monotonic()
        assert list((repo / ".gptforge" / "records").glob("*.jsonl")), "delivered with the server down?"
        prefect_server.start()
        times["up"] = time.monotonic()

    proc, output = _pretrain_through(outage, repo, env, tmp_path / "pretrain.log")
    records_delivered(repo)
    print(
        f"server down {times['up'] - times['down']:.1f} s; the records were delivered "
        f"{time.monotonic() - times['up']:.1f} s after it was back"
    )
    assert proc.returncode == 0, output[-3000:]
    a, b = _weights(reference), _weights(repo)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "Prefect" not in output and "Unable to connect" not in output and "Traceback" not in output, output[-3000:]

    [flow_run] = prefect_server.post("flow_runs/filter", {})
    assert flow_run["state"]["type"] == "COMPLETED", flow_run["state"]
    task_runs = {t["name"].rsplit("-", 1)[0]: t["state"]["type"] for t in prefect_server.post("task_runs/filter", {})}
    assert task_runs == {"setup": "COMPLETED", "train-loop": "COMPLETED", "finish": "COMPLETED"}, task_runs


@pytest.mark.slow
def test_prefect_server_that_stays_away(tmp_path, prefect_server, small_tokenizer, sms_file, alpaca_file):
    """A stage asked to wait for its records waits that long, says so in one line and succeeds;
    the records stay in its journal for when the server is back."""
    repo = _repo_with_data(tmp_path, "repo", small_tokenizer, sms_file, alpaca_file, **TRAINING)
    env = cli_env(PREFECT_API_URL=prefect_server.url, OMP_NUM_THREADS="1", GPTFORGE_WAIT_FOR_RECORDS="3")

    def outage(proc: subprocess.Popen, log: Path, paused: Paused) -> None:
        prefect_server.kill()  # while the run is held: the rest of it, and its end, happen with the server away
        paused.release()

    proc, output = _pretrain_through(outage, repo, env, tmp_path / "pretrain.log")
    assert proc.returncode == 0, output[-3000:]
    assert (repo / "checkpoints/pretrain/final/model.safetensors").is_file()
    [warning] = [line for line in output.splitlines() if "has not delivered" in line]
    assert warning.endswith("within 3 s; it goes on in the background"), warning
    [journal] = (repo / ".gptforge" / "records").glob("*.jsonl")
    assert journal.read_text().rstrip().endswith('"exit_code": 0}')  # whole, to its close
    recorder_log = (repo / ".gptforge" / "recorder" / "recorder.log").read_text()
    assert "unreachable" in recorder_log, recorder_log[-2000:]


def test_a_finished_flow_keeps_its_result_when_its_state_cannot_be_recorded():
    from flows.outage import UNRECORDED, Finished, run_recorded

    before = dict(UNRECORDED.counts)
    finished = Finished()

    def flow_run():
        finished.keep({"val_loss": 1.5})
        raise httpx.ConnectError("[Errno 111] Connection refused")

    assert run_recorded(flow_run, finished, "flow run x") == {"val_loss": 1.5}
    assert UNRECORDED.counts["final state of flow run x"] == before.get("final state of flow run x", 0) + 1

    # Unreachable before the work finished, or a failure of the work: raised as it is.
    with pytest.raises(httpx.ConnectError):
        run_recorded(lambda: (_ for _ in ()).throw(httpx.ConnectError("refused")), Finished(), "flow run y")
    done = Finished()
    done.keep(1)
    with pytest.raises(ValueError):
        run_recorded(lambda: (_ for _ in ()).throw(ValueError("bad")), done, "flow run z")


def test_api_unreachable_tells_outages_from_failures():
    from prefect.exceptions import PrefectHTTPStatusError

    from flows.outage import api_unreachable

    request = httpx.Request("POST", "http://127.0.0.1:1/api/x")
    assert api_unreachable(httpx.ConnectError("refused", request=request))
    assert api_unreachable(httpx.ReadTimeout("slow", request=request))
    assert api_unreachable(
        PrefectHTTPStatusError("503", request=request, response=httpx.Response(503, request=request))
    )
    assert not api_unreachable(
        PrefectHTTPStatusError("422", request=request, response=httpx.Response(422, request=request))
    )
    assert not api_unreachable(ValueError("a bad param"))
