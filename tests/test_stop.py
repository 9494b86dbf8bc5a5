"""Stop means stop, at every stage and at every level: stage command, `dvc repro`, pipeline.

Each stage runs as users run it (`gptforge ...` under Prefect, tracked in MLflow) in a copy of
a repository where every stage's inputs were made by a quick run of the stages before it. Its
work is made long, the way real runs are long, and so that no machine is fast enough to finish
it first: requests to a server that never answers (the data stages, the hub fetch, the model
registry), endless epochs (fine-tuning, the benchmark), a big evaluation set (two models on
3000 examples). Once its MLflow run is open and its work under way (a condition the stage
itself shows: its request reached the server, a line it logs, pretraining paused at a step by
gptforge.runtime.pause), the command gets SIGTERM (what a Prefect worker cancelling the run,
`docker stop` or `kill` send). Then, within 30 s: the command has exited with 143 and says it
was stopped in its last line, its MLflow run is KILLED, its Prefect flow run is Crashed or
Cancelled, no process it started is left, and the outputs of the earlier run are intact
(pretrain also leaves a checkpoint of the step after the one it was paused at).
Also here: a second Ctrl-C, which stops a stage at once instead of after its step and
checkpoint, and, in-process, a stop that a library turned into another error or that Python
dropped. Pretraining is paused where a test must act on it (process_support.Paused), never
raced; the benchmark, which cannot be paused, is signalled once it logs that it is timing its
variants. Above the stages (`gptforge pipeline`, `dvc repro`): tests/test_stop_pipeline.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from cli_support import BIN, REPO, cli_env, run_cli, set_params, snapshot, stage_params
from fixture_data import SMS_LINES
from process_support import Paused, logged, prefect_home, records_delivered, started, wait_until

from gptforge.runtime.signals import group_alive

# Seconds from the signal to a process-free folder: the bound users expect, and the point of
# these tests. The stage's own deadline (STOP_GRACE_SECONDS, 20 s) ends it sooner whatever it
# still waits for; the rest is margin for a machine busy with another process.
STOP_WITHIN = 30.0
# A bound against a hang only (a stage starting under load: imports, Prefect, MLflow).
START_WITHIN = 300.0


class StallingServer:
    """Accepts HTTP connections on 127.0.0.1 and never answers: a download that hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture(scope="module")
def stalling_server():
    server = StallingServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def prepared_repo(tmp_path_factory, small_tokenizer) -> tuple[Path, dict]:
    """A repository in which every stage has run once, quickly, with tracking off: the inputs of
    every stage exist, and so do the outputs a stopped run must not damage. Made once per test
    session and shared by the pytest-xdist workers (a file lock; 25 s here); tests copy it."""
    from filelock import FileLock

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    root = tmp_path_factory.getbasetemp().parent / f"stop-{run}" if run else tmp_path_factory.getbasetemp() / "stop"
    with FileLock(f"{root}.lock"):
        if not (root / "extra.json").is_file():
            extra = _prepare_every_stage(root, small_tokenizer)
            (root / "extra.json").write_text(json.dumps(extra))
    return root / "repo", json.loads((root / "extra.json").read_text())


def _prepare_every_stage(root: Path, small_tokenizer: Path) -> dict:
    from cli_support import REPO

    shutil.rmtree(root, ignore_errors=True)  # what a failed attempt left
    repo = root / "repo"
    repo.mkdir(parents=True)
    for name in ("dvc.yaml", "params.yaml", ".dvcignore"):
        shutil.copy(REPO / name, repo / name)
    sms = root / "SMSSpamCollection"
    sms.write_text("".join(f"{label}\t{text} #{i}\n" for i in range(3) for label, text in SMS_LINES), encoding="utf-8")
    alpaca = root / "alpaca_data.json"
    alpaca.write_text(
        json.dumps(
            [
                {"instruction": f"Give a synonym for word number {i}.", "input": "", "output": f"synonym {i}"}
                for i in range(40)
            ]
        ),
        encoding="utf-8",
    )
    params = {**stage_params(root, small_tokenizer, sms, alpaca), "tracking.enabled": False}
    set_params(repo, **params)
    env = cli_env(GPTFORGE_PREFECT="0")
    for args in (
        ["prepare", "pretrain"],
        ["prepare", "classify"],
        ["prepare", "instruct"],
        ["prepare", "preference"],
        ["pretrain"],
        ["finetune", "classify"],
        ["finetune", "instruct"],
        ["finetune", "reward"],
    ):
        out = run_cli(args, repo, env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    # A large HellaSwag file makes the evaluation last: 3000 distinct examples (repeated ones
    # share their requests), tens of seconds of scoring per model here.
    rows = [json.loads(line) for line in Path(params["evaluate.hellaswag.source"]).read_text().splitlines()]
    big = root / "hellaswag_big.jsonl"
    with open(big, "w") as f:
        for i in range(3000):
            row = {**rows[i % len(rows)], "ctx_a": f"A man cuts onion number {i}."}
            f.write(json.dumps({**row, "ctx": f"{row['ctx_a']} {row['ctx_b']}"}) + "\n")
    return {"hellaswag_big": str(big)}


# One variant timed for 100,000 steps; the baseline left out, so that the stage logs that it
# skipped it once it is timing the variants, on any device.
BENCHMARK_FOREVER = {"benchmark.steps": 100_000, "benchmark.variants": ["sdpa"]}


def _slow_params(stage: str, stall: str, extra: dict) -> tuple[list[str], dict, dict]:
    """The command of `stage`, the params that make its work long, and extra environment."""
    download = {"data.download.timeout": 600, "data.download.retries": 0}
    https = stall.replace("http://", "https://")  # the TLS handshake never gets an answer
    table = {
        "prepare_pretrain": (["prepare", "pretrain"], {"data.pretrain.source": f"{https}/corpus.txt", **download}),
        "prepare_classify": (["prepare", "classify"], {"data.classify.source": f"{https}/sms.zip", **download}),
        "prepare_instruct": (["prepare", "instruct"], {"data.instruct.source": f"{https}/alpaca.json", **download}),
        "prepare_preference": (
            ["prepare", "preference"],
            {"data.preference.source": f"{https}/pairs.json", **download},
        ),
        "prepare_base": (["prepare", "base", "-S", "base.only=tiny"], {"base.models": {"tiny": "gptforge-test/tiny"}}),
        "pretrain": (["pretrain"], {"pretrain.max_steps": 100_000, "pretrain.resume": "never"}),
        "finetune_classify": (["finetune", "classify"], {"classify.epochs": 100_000}),
        "finetune_instruct": (["finetune", "instruct"], {"instruct.epochs": 100_000}),
        "finetune_instruct_variant": (
            ["finetune", "instruct-variant", "-S", "instruct_variants.only=tiny"],
            {"instruct_variants.models.tiny.epochs": 100_000, "instruct_variants.models.tiny.max_samples": None},
        ),
        "finetune_preference": (
            ["finetune", "preference"],
            {"preference.epochs": 100_000, "preference.max_samples": None},
        ),
        "train_reward": (["finetune", "reward"], {"reward.epochs": 100_000, "reward.max_samples": None}),
        "finetune_rl": (["finetune", "rl"], {"rl.epochs": 100_000, "rl.max_prompts": None}),
        "evaluate": (["evaluate"], {"evaluate.hellaswag.source": extra["hellaswag_big"], "evaluate.limit": None}),
        "register": (["register"], {}),
        "benchmark": (["benchmark"], BENCHMARK_FOREVER),
        # every request of the first chunks waits on the stalling endpoint (the project's docs/ as the documents)
        "synthesize": (
            ["synthesize"],
            {
                "synthesize.documents": {"manual": str(REPO / "docs")},
                "synthesize.endpoint.url": f"{stall}/v1",
                "synthesize.endpoint.model": "m",
                "synthesize.endpoint.timeout": 600,
                "synthesize.endpoint.retries": 0,
            },
        ),
    }
    args, params = table[stage]
    # The hub fetch and the registry (its run stays in the test's database) go to the stalling
    # server too, with timeouts far beyond the test.
    env = {
        "prepare_base": {
            "HF_HUB_OFFLINE": "0",
            "HF_ENDPOINT": stall,
            "HF_HUB_ETAG_TIMEOUT": "600",
            "HF_HUB_DOWNLOAD_TIMEOUT": "600",
        },
        "register": {
            "MLFLOW_REGISTRY_URI": stall,
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "600",
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        },
    }.get(stage, {})
    return args, params, env


# The stages whose work is a request to the stalling server: under way once it has connected.
STALLED = {
    "prepare_pretrain",
    "prepare_classify",
    "prepare_instruct",
    "prepare_preference",
    "prepare_base",
    "register",
    "synthesize",
}
# What the others log once their work is under way (an epoch or a step done, the scoring or the
# timing started); pretrain is paused instead.
READY = {
    "finetune_classify": "steps so far",
    "finetune_instruct": "steps so far",
    "finetune_instruct_variant": "steps so far",
    "finetune_preference": "margin=",
    "train_reward": "acc=",
    "finetune_rl": "reward=",
    "evaluate": "pretrain loglikelihood",
    "benchmark": "benchmark baseline: skipped",
}
PAUSE_AT = 2  # pretrain's pause: a checkpointed step (pretrain.ckpt_interval 2 in stage_params)


def _runs(uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def _flow_run_state(api: str, flow_run_id: str) -> str:
    with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}", timeout=10) as r:
        return json.load(r)["state"]["type"]


def stopped_step(output: str, sig: str, repo: Path) -> int:
    """The step pretrain says it stopped at, after checking that its checkpoint is complete."""
    stopped = [line for line in output.splitlines() if f"pretrain stopped by {sig} at step" in line]
    assert stopped, output[-3000:]
    step = int(stopped[0].split(" at step ")[1].split(";")[0])
    assert (repo / f"checkpoints/pretrain/step_{step:08d}/checksums.json").is_file()
    return step


def wait_gone(proc: subprocess.Popen, within: float, since: float) -> float:
    """Seconds from `since` (a time.monotonic()) until `proc` and every process of its group have
    exited (or `within` passed)."""
    start = since
    while time.monotonic() - start < within and (proc.poll() is None or group_alive(proc.pid)):
        time.sleep(0.1)
    return time.monotonic() - start


STAGES = [
    "prepare_pretrain",
    "prepare_classify",
    "prepare_instruct",
    "prepare_preference",
    "prepare_base",
    "pretrain",
    "finetune_classify",
    "finetune_instruct",
    "finetune_instruct_variant",
    "finetune_preference",
    "train_reward",
    "finetune_rl",
    "evaluate",
    "register",
    "benchmark",
    "synthesize",
]


# Stages added on 2026-11-27 whose stop is not exercised here yet (they stop through the same
# `cmd_stage` and signal handling as every stage; each needs its inputs made in this test's
# repo: a synthesized document set and its index). Listed, not silent: the gap is in the note
# of issue 32.
NOT_YET_STOP_TESTED = {"index", "evaluate_qa"}
# The reports over the per-model stages' files (evaluate@NAME, register@MODEL): they read JSON
# and write markdown in well under a second, no work a stop could interrupt.
NOTHING_TO_STOP = {"evaluate_report", "register_report"}


def test_every_stage_is_in_the_table():
    """A table check (not slow): every stage of gptforge.pipeline.stages is stopped by a test here,
    or named in NOT_YET_STOP_TESTED."""
    from gptforge.pipeline.stages import STAGES as TABLE

    assert sorted(STAGES) == sorted(set(TABLE) - NOT_YET_STOP_TESTED - NOTHING_TO_STOP)
    assert NOT_YET_STOP_TESTED | NOTHING_TO_STOP <= set(TABLE)


def _stop_turned_into(error_type: type[Exception]) -> Exception:
    """What Prefect's task engine raises when SIGTERM lands as a task run starts: its crash
    handler fails on the half-made run (ValueError('Task run is not set')) while handling the stop."""
    from gptforge.runtime.signals import Terminated

    try:
        try:
            raise Terminated(signal.SIGTERM)
        except BaseException:
            raise error_type("Task run is not set")
    except error_type as e:
        return e


def test_a_stop_that_a_library_turned_into_another_error_is_still_a_stop(monkeypatch, capsys):
    import tasks
    from gptforge import cli
    from gptforge.runtime.signals import Terminated, stop_cause, stop_signal

    error = _stop_turned_into(ValueError)
    assert stop_signal(error) is None and isinstance(stop_cause(error), Terminated)
    assert stop_cause(ValueError("a real failure")) is None

    # A step: the stop itself comes out, so the flow run ends Crashed and the MLflow run KILLED.
    monkeypatch.setattr(tasks, "task", lambda fn, **options: fn)
    with pytest.raises(Terminated):
        tasks.PrefectSteps()(lambda: (_ for _ in ()).throw(_stop_turned_into(ValueError)))
    with pytest.raises(ValueError, match="a real failure"):
        tasks.PrefectSteps()(lambda: (_ for _ in ()).throw(ValueError("a real failure")))

    # The command: exit 143 and a stop line, not a failure's exit 1.
    monkeypatch.setattr(
        cli,
        "build_parser",
        lambda: type(
            "P",
            (),
            {
                "parse_args": lambda self, argv: type(
                    "A", (), {"func": staticmethod(lambda args: (_ for _ in ()).throw(_stop_turned_into(RuntimeError)))}
                )()
            },
        )(),
    )
    assert cli.main([]) == 128 + signal.SIGTERM
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("gptforge: stopped by SIGTERM (RuntimeError on the way out: "), last


def test_a_stop_raised_where_python_drops_exceptions_is_sent_again(monkeypatch):
    """A signal handler's stop raised inside a weakref callback (a garbage collection) is
    printed as "Exception ignored" and dropped by Python: the hook sends the signal again."""
    import sys
    import weakref

    from gptforge.runtime import signals

    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    monkeypatch.setattr(sys, "unraisablehook", lambda u: pytest.fail(f"not a stop: {u.exc_value!r}"))
    monkeypatch.setattr(sys, "unraisablehook", signals._redelivering(sys.unraisablehook))
    try:

        class Collected:
            pass

        thing = Collected()
        ref = weakref.ref(thing, lambda r: (_ for _ in ()).throw(signals.Terminated(signal.SIGTERM)))
        del thing  # the callback raises the stop; Python drops it and calls the hook
        deadline = time.monotonic() + 60  # a bound against a hang only
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs in this (main) thread, between these sleeps
        assert got == [signal.SIGTERM] and ref() is None
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_sigterm_stops_the_stage(stage, tmp_path, prepared_repo, stalling_server, prefect_api, mlflow_uri):
    source, extra = prepared_repo
    repo = tmp_path / "repo"
    shutil.copytree(source, repo, symlinks=True)
    args, params, env_extra = _slow_params(stage, stalling_server.url, extra)
    experiment = f"stop-{stage}"
    set_params(repo, **{**params, "tracking.enabled": True, "tracking.experiment": experiment})
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_uri[len("sqlite:///") :], db)
    uri = f"sqlite:///{db}"
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=uri, GPTFORGE_PREFECT="1", **env_extra)
    before = {k: v for k, v in snapshot(repo).items() if not k.startswith((".gptforge/", "checkpoints/pretrain/step_"))}

    pause = Paused(tmp_path, PAUSE_AT)
    if stage == "pretrain":
        env.update(pause.env())
    connections = len(stalling_server.held)

    log = tmp_path / "stage.log"
    with started([str(BIN / "gptforge"), *args], repo, env, log) as proc:
        wait_until(
            lambda: [r for r in _runs(uri, experiment) if r.info.status == "RUNNING"],
            proc,
            log,
            "its MLflow run started",
        )
        if stage in STALLED:
            wait_until(lambda: len(stalling_server.held) > connections, proc, log, "waiting for the server")
        elif stage in READY:
            wait_until(logged(log, READY[stage]), proc, log, f"logging {READY[stage]!r}")
        elif stage == "pretrain":
            pause.wait(proc, output=log.read_text)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        if stage == "pretrain":  # the signal is taken while paused, then acted on after the next step
            pause.release_once_taken(proc, log, STOP_WITHIN)
        took = wait_gone(proc, STOP_WITHIN, since=start)
    output = log.read_text()
    print(f"{stage}: gone {took:.1f} s after SIGTERM")
    assert took < STOP_WITHIN, f"{stage}: processes left {STOP_WITHIN:.0f} s after SIGTERM:\n{output[-3000:]}"
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("gptforge: ") and "SIGTERM" in last, output[-3000:]
    assert "Traceback" not in output, output[-5000:]

    records_delivered(repo)  # a stopped stage leaves its records to the recorder
    runs = _runs(uri, experiment)  # evaluate nests a run per model under its own
    [run] = [r for r in runs if r.data.tags.get("gptforge.stage") == stage]
    assert run.info.status == "KILLED", output[-3000:]
    assert [r.info.status for r in runs if r.info.status == "RUNNING"] == [], output[-3000:]
    assert _flow_run_state(prefect_api, run.data.tags["prefect.flow_run_id"]) in ("CRASHED", "CANCELLED")

    after = snapshot(repo)
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert changed == [], f"{stage}: a stopped run changed what the earlier run wrote: {changed[:5]}"
    if stage == "pretrain":
        assert stopped_step(output, "SIGTERM", repo) == PAUSE_AT + 1, output[-3000:]


def _tracked_env(tmp_path: Path, mlflow_uri: str, **extra: str) -> tuple[dict, str]:
    """CLI environment with a private copy of the session's MLflow database, and its URI. With
    no PREFECT_API_URL in `extra` Prefect starts its temporary server (in a private PREFECT_HOME)."""
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_uri[len("sqlite:///") :], db)
    uri = f"sqlite:///{db}"
    home = prefect_home(tmp_path / "prefect-home")
    env = cli_env(MLFLOW_TRACKING_URI=uri, GPTFORGE_PREFECT="1", PREFECT_HOME=str(home), **extra)
    if "PREFECT_API_URL" not in extra:
        env.pop("PREFECT_API_URL", None)
    return env, uri


def _statuses(uri: str, experiment: str) -> dict[str, str]:
    return {r.data.tags.get("gptforge.stage"): r.info.status for r in _runs(uri, experiment)}


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once(tmp_path, prepared_repo, prefect_api, mlflow_uri):
    """The first SIGINT asks pretrain to finish its step and checkpoint; a second one stops it at
    once: no checkpoint is started, none is left half-written. The run is paused after its
    checkpointed step 2 and never released, so the first SIGINT alone would never end it: what
    ends it is the second."""
    source, _ = prepared_repo
    repo = tmp_path / "repo"
    shutil.copytree(source, repo, symlinks=True)
    experiment = "stop-twice"
    set_params(
        repo,
        **{
            "pretrain.max_steps": 1000,
            "pretrain.resume": "never",
            "tracking.enabled": True,
            "tracking.experiment": experiment,
        },
    )
    pause = Paused(tmp_path, PAUSE_AT)
    # The stop deadline (an exit with the same code, STOP_GRACE_SECONDS after the first signal)
    # is put beyond the test, so that it cannot pass for the second Ctrl-C.
    env, uri = _tracked_env(
        tmp_path,
        mlflow_uri,
        PREFECT_API_URL=prefect_api,
        OMP_NUM_THREADS="1",
        GPTFORGE_STOP_GRACE_SECONDS="600",
        **pause.env(),
    )
    log = tmp_path / "pretrain.log"
    with started([str(BIN / "gptforge"), "pretrain"], repo, env, log) as proc:
        pause.wait(proc, output=log.read_text)
        proc.send_signal(signal.SIGINT)
        wait_until(logged(log, "stopping after this step"), proc, log, "taking the first Ctrl-C", STOP_WITHIN)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        try:
            proc.wait(timeout=STOP_WITHIN)  # a bound against a hang: paused, only the signal can end it
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_WITHIN:.0f} s after the second Ctrl-C:\n{log.read_text()[-3000:]}")
        print(f"exited {time.monotonic() - start:.1f} s after the second Ctrl-C")
    output = log.read_text()
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    assert pause.path.is_file()  # never released: it ended in the pause
    assert "stopped by SIGINT at step" not in output and "still busy" not in output, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("gptforge: "), output[-3000:]
    steps = sorted((repo / "checkpoints/pretrain").glob("step_*"))
    assert [p.name for p in steps] == [f"step_{PAUSE_AT:08d}"], steps  # none started for a later step
    assert (steps[0] / "checksums.json").is_file()
    assert [
        p.name for p in (repo / "checkpoints/pretrain").iterdir() if not p.name.startswith(("step_", "final"))
    ] == []
    records_delivered(repo)
    assert _statuses(uri, experiment)["pretrain"] == "KILLED"
