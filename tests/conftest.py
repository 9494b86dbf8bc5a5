"""Shared fixtures. Nothing here touches the network: real servers run on 127.0.0.1 only.

Expensive things are made once per session: a Prefect server (about 15-20 s to start) that
every CLI subprocess talks to through PREFECT_API_URL, and a migrated MLflow database (about
7 s of migrations) that CLI tests share.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from chat_endpoint import ChatEndpoint  # noqa: F401  (tests import it from here too)

# absl (which rouge-score imports) makes a logging handler at import whose stream is the
# sys.stderr of that moment: inside a test, pytest's capture stream. Prefect's import runs
# logging.config.dictConfig, which closes every handler made so far, and absl's handler closes
# a stream that is not the current sys.stderr: pytest's capture, so the worker dies ("lost
# sys.stderr") in whatever test imports Prefect after one that imported rouge-score. Made here,
# before any test, on the real stderr (which absl never closes).
import absl.logging  # noqa: E402

absl.logging.get_absl_handler().python_handler.setStream(sys.__stderr__)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Before anything imports prefect, mlflow, datasets or transformers.
os.environ.update(
    DVC_NO_ANALYTICS="1",
    PREFECT_SERVER_ANALYTICS_ENABLED="false",
    DO_NOT_TRACK="1",
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    # A stage command returns once its records are delivered (runtime/recording.py), so a test
    # reads its MLflow run and Prefect flow run right after it; the recorder of a test's folder
    # leaves soon after the test is done with it.
    GPTFORGE_WAIT_FOR_RECORDS="120",
    GPTFORGE_RECORDER_IDLE_SECONDS="20",
    # `mlflow server` otherwise starts a job runner and seven huey consumers, each importing
    # mlflow, for GenAI jobs (scorers, prompt optimization) that gptforge never submits.
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on 2 cores: one thread each, for the worker and every process
    # it starts (CLI stages, torchrun ranks), or OpenMP oversubscribes the cores tenfold.
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

from gptforge.runtime.tracking import NullRun  # noqa: E402  (after the environment is set)


def pytest_sessionfinish(session, exitstatus):
    """The recorders this session's tests started (one per test folder that ran a recorded
    stage) leave with it rather than after their idle time."""
    import psutil

    base = str(session.config._tmp_path_factory.getbasetemp()) if hasattr(session.config, "_tmp_path_factory") else None
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        try:
            cmd = proc.info["cmdline"] or []
            if {"flows.recorder", "flows.recorder_host"} & set(cmd) and base and (proc.info["cwd"] or "").startswith(base):
                proc.terminate()
        except (psutil.Error, OSError):
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


# --------------------------------------------------------------------------------------------
# Real data: the package's embedded samples (gptforge.samples), so a clean clone needs nothing beside it


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir() -> Path:
    """OpenAI's GPT-2 encoder.json + vocab.bpe, as the package embeds them (sample://gpt2_tokenizer)."""
    from gptforge import samples

    path = Path(samples.resolve("sample://gpt2_tokenizer"))
    assert (path / "encoder.json").is_file() and (path / "vocab.bpe").is_file(), f"{path} lacks the GPT-2 files"
    return path


@pytest.fixture(autouse=True)
def _no_stale_cli_log_handler():
    """A test that runs `gptforge.cli.main` in-process leaves the CLI's log handler on the
    "gptforge" logger, writing to that test's captured stderr, which is closed after it: a
    later test's log line would be a "Logging error". The handler goes with the test."""
    yield
    import logging

    log = logging.getLogger("gptforge")
    for handler in [h for h in log.handlers if getattr(h, "gptforge_cli", False)]:
        log.removeHandler(handler)


# --------------------------------------------------------------------------------------------
# Fixture data the tests make


class FakeRun(NullRun):
    """Records what a recipe logs, instead of MLflow."""

    def __init__(self):
        self.metrics: list[dict] = []
        self.artifacts: list[Path] = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append(Path(path))



def write_tiktoken(path: Path, tokens: list[bytes]) -> Path:
    """A `.tiktoken` rank file: the 256 single bytes, then `tokens` in rank order."""
    ranks = [bytes([i]) for i in range(256)] + tokens
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return path


# Merges in rank order; each is the concatenation of two earlier tokens.
SMALL_MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"  ", b"\n\n", b"er", b" a", b"an",
                b"and", b" and", b"ou", b"is", b" is", b"re", b"on", b" o", b" of", b"e ", b".\n", b"\r\n"]


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory) -> Path:
    """A small byte-level BPE (280 tokens) in tiktoken's format, whose ids are easy to reason about."""
    tokens = []
    for t in SMALL_MERGES:
        if t == b" of":
            t = b" o" + b"f"
        tokens.append(t)
    return write_tiktoken(tmp_path_factory.mktemp("tok") / "small.tiktoken", tokens)


SMS_LINES = [
    ("ham", "Hey, are we still on for lunch tomorrow?"),
    ("spam", "WINNER!! You have won a 1000 cash prize. Call 09061701461 now"),
    ("ham", "I'll be home by 7, see you then"),
    ("spam", "Free entry in 2 a wkly comp to win FA Cup final tkts. Text FA to 87121"),
    ("ham", "Can you pick up some milk on the way?"),
    ("spam", "URGENT! Your mobile number has been awarded a 2000 prize. Call now"),
    ("ham", "Ok lar... Joking wif u oni..."),
    ("ham", "Sorry, I'll call later"),
    ("spam", "Congratulations ur awarded 500 of CD vouchers. Text GO to 83600"),
    ("ham", "Did you finish the report?"),
]


@pytest.fixture
def sms_file(tmp_path) -> Path:
    """A SMSSpamCollection-format file: label, TAB, message. 30 lines, 12 spam."""
    path = tmp_path / "SMSSpamCollection"
    lines = [f"{label}\t{text} #{i}" for i in range(3) for label, text in SMS_LINES]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def alpaca_file(tmp_path) -> Path:
    records = [
        {"instruction": f"Give a synonym for word number {i}.", "input": "" if i % 3 else f"word {i}",
         "output": f"synonym {i}"}
        for i in range(40)
    ]
    path = tmp_path / "alpaca_data.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# Servers and the CLI


_SHARED_TMP: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def _shared_tmp(tmp_path_factory) -> None:
    """The folder that every xdist worker of this run shares (a single process: its own base)."""
    base = tmp_path_factory.getbasetemp()
    _SHARED_TMP[:] = [base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base]


def prefect_home(folder: Path) -> Path:
    """`folder` as a PREFECT_HOME whose database has every migration applied: a copy of one made
    once per run for all workers (`prefect server database upgrade`), since migrations are ~6 s
    of a fresh server's ~9 s start. A fresh clone's first start (migrations included) is what
    benchmarks/bench_startup.py and bench_make_run.py time."""
    root = _SHARED_TMP[0]
    template = root / "prefect-template" / "prefect.db"
    with open(root / "prefect-template.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            work = root / "prefect-template.tmp"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            env = {**os.environ, "PREFECT_HOME": str(work)}
            env.pop("PREFECT_API_URL", None)
            subprocess.run([str(BIN / "prefect"), "server", "database", "upgrade", "-y"], env=env, check=True,
                           capture_output=True, timeout=300)
            work.rename(template.parent)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, folder / "prefect.db")
    return folder


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real `prefect server start` on a free loopback port, shared by the session."""
    home = prefect_home(tmp_path_factory.mktemp("prefect-home"))
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    # The UI asks this URL for its data (its default is port 4200).
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": url}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        wait_http(f"{url}/health", timeout=120, proc=proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """A migrated MLflow sqlite database for the session (migrations cost ~7 s once)."""
    from mlflow.tracking import MlflowClient

    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder}/mlflow.db"
    MlflowClient(tracking_uri=uri).search_experiments()
    return uri


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def mlflow_server(tmp_path, mlflow_uri):
    """`mlflow server` on a free loopback port; its database starts as a copy of the session's
    migrated one (migrations cost ~7 s)."""
    folder = tmp_path / "mlflow-server"
    folder.mkdir()
    shutil.copy(mlflow_uri[len("sqlite:///"):], folder / "mlflow.db")
    port = free_port()
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder}/mlflow.db", "--artifacts-destination", str(folder / "artifacts")],
        cwd=folder, env=cli_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", timeout=120, proc=proc)
        yield url
    finally:
        stop_process(proc)
        log.close()


def processes_in(folder: Path) -> list[str]:
    """The command lines of the processes (other than this one) whose working directory is
    `folder`, but for the folder's recorder and its children: it outlives the stages by design
    (runtime/recording.py) and leaves when idle."""
    import psutil

    found, recorders = [], set()
    for p in psutil.process_iter(["pid", "cwd", "cmdline"]):
        try:
            if {"flows.recorder", "flows.recorder_host"} & set(p.info["cmdline"] or []):
                recorders.add(p.pid)
                recorders.update(c.pid for c in p.children(recursive=True))
            elif p.info["cwd"] and Path(p.info["cwd"]).resolve() == folder.resolve() and p.pid != os.getpid():
                found.append((p.pid, " ".join(p.info["cmdline"] or [])))
        except (psutil.Error, OSError):
            pass
    return [cmd for pid, cmd in found if pid not in recorders]


def records_delivered(folder: Path, within: float = 120.0) -> None:
    """Until the recorder has delivered every journal of `folder` (a stopped stage does not wait
    for it; GPTFORGE_WAIT_FOR_RECORDS makes the others do)."""
    deadline = time.monotonic() + within
    records = folder / ".gptforge" / "records"
    while list(records.glob("*.jsonl")):
        log = folder / ".gptforge" / "recorder" / "recorder.log"
        assert time.monotonic() < deadline, (f"journals not delivered within {within:.0f} s: "
                                             f"{(log.read_text() if log.exists() else '(no recorder log)')[-3000:]}")
        time.sleep(0.1)


def cli_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(extra)
    return env


def run_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "gptforge"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def wait_until(condition, proc: subprocess.Popen, log: Path, what: str, within: float = 300.0,
               alive=None) -> None:
    """Until `condition()` holds; fails if `proc` (or what `alive()` watches) ends first, showing
    the end of `log`. `within` is a bound against a hang only (a command starting under load:
    imports, Prefect, MLflow)."""
    deadline = time.monotonic() + within
    alive = alive or (lambda: proc.poll() is None)
    while not condition():
        assert alive(), f"ended (exit {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not {what} within {within:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def logged(log: Path, text: str):
    return lambda: text in log.read_text()


@contextlib.contextmanager
def started(args: list[str], cwd: Path, env: dict, log: Path) -> Iterator[subprocess.Popen]:
    """`args` running in its own process group, output to `log` (a paused run is not read from
    while it waits); on the way out whatever it started that still runs is killed (its group,
    and processes it put in groups of their own: dvc under the pipeline, torchrun's workers) and
    the command reaped, so a failed test leaves no run behind, paused or not."""
    import psutil

    from gptforge.runtime.signals import group_alive

    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Paused:
    """A run (pretraining or the serve engine) held after step `step` (gptforge.runtime.pause): `env()`
    goes into the run's environment, `wait(proc)` returns once the loop is paused there (or
    fails if the process ended first), `release()` lets it go on. Tests act on a paused run
    instead of racing the machine's speed."""

    def __init__(self, folder: Path, step: int) -> None:
        self.path, self.step = Path(folder) / f"paused-at-{step}", step

    def env(self) -> dict[str, str]:
        return {"GPTFORGE_PAUSE_AT_STEP": str(self.step), "GPTFORGE_PAUSE_FILE": str(self.path)}

    def wait(self, proc: subprocess.Popen, timeout: float = 600, output=lambda: "") -> None:
        # A bound against a hang only: a run under load may need minutes to reach its step.
        deadline = time.monotonic() + timeout
        while not self.path.is_file():
            assert proc.poll() is None, f"ended (exit {proc.returncode}) before step {self.step}:\n{output()[-3000:]}"
            assert time.monotonic() < deadline, f"not paused at step {self.step} within {timeout:.0f} s"
            time.sleep(0.05)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

    def release_once_taken(self, proc: subprocess.Popen, log: Path, within: float = 30.0, alive=None) -> None:
        """After a stop signal sent to the paused run: once its loop has taken it (the handler
        logs "stopping after this step"), release it, so it stops after the next step. `within`:
        the stop bound users expect; `alive` for a run that may outlive `proc` (a stage under dvc)."""
        wait_until(logged(log, "stopping after this step"), proc, log, "taking the signal", within, alive)
        self.release()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("gptforge: error:")]


def last_error_line(stderr: str) -> str:
    """The last line printed, which must be the command's error. Under the pipeline, the failed
    stage's own error line comes before it, as `dvc repro` shows it."""
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("gptforge: error:"), stderr[-2000:]
    return last


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes, to show that a failed run changed nothing."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    """A fresh git + DVC repository with this project's dvc.yaml, params.yaml and code."""
    dst = tmp_path / "repo"
    dst.mkdir()
    for name in ("dvc.yaml", "params.yaml", ".dvcignore"):
        shutil.copy(REPO / name, dst / name)
    shutil.copytree(REPO / ".dvc", dst / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"))
    for code in ("src", "kernels"):  # the stages' code deps
        shutil.copytree(REPO / code, dst / code, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(REPO / ".gitignore", dst / ".gitignore")
    (dst / "data" / "synthetic").mkdir(parents=True)  # git carries it: prepare_instruct's dependency
    shutil.copy(REPO / "data" / "synthetic" / "README.md", dst / "data" / "synthetic" / "README.md")
    shutil.copytree(REPO / "data" / "qa", dst / "data" / "qa")  # git carries it: evaluate_qa's dependency
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dst, check=True)
    subprocess.run([*git, "commit", "-qm", "fixture"], cwd=dst, check=True)
    return dst


def set_params(repo: Path, **dotted) -> None:
    """Set dotted keys in a repository's params.yaml."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for key, value in dotted.items():
        node = params
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def stage_params(tmp_path: Path, small_tokenizer: Path, sms_file: Path, alpaca_file: Path) -> dict[str, Any]:
    """Params (dotted keys) that run every stage of the pipeline on local fixtures in seconds."""
    hellaswag = tmp_path / "hellaswag.jsonl"
    hellaswag.write_text("".join(json.dumps({
        "activity_label": "Cooking", "ctx_a": f"A man cuts onion number {i}.", "ctx_b": "he",
        "ctx": f"A man cuts onion number {i}. he", "label": i % 4,
        "endings": ["puts them in a pan.", "sings a song.", "rides a bike.", "reads a book."]}) + "\n"
        for i in range(6)))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat and the dog\n" * 400)
    return {
        "tokenizer.path": str(small_tokenizer),
        "data.pretrain.source": str(corpus),
        "data.pretrain.val_tokens": 500,
        "data.pretrain.shard_tokens": 2000,
        "data.pretrain.workers": 1,
        "data.classify.source": str(sms_file),
        "data.instruct.source": str(alpaca_file),
        # a small, short pretraining run on the small tokenizer (281 ids)
        "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 128, "model.vocab_size": 320,
        "pretrain.batch_size": 2, "pretrain.batch_tokens": 256, "pretrain.max_steps": 4, "pretrain.warmup_steps": 1,
        "pretrain.eval_interval": 2, "pretrain.eval_steps": 1, "pretrain.ckpt_interval": 2, "pretrain.log_interval": 1,
        # one short epoch of each fine-tuning on the fixtures
        "classify.epochs": 1, "classify.batch_size": 4, "classify.eval_interval": 2, "classify.eval_batches": 1,
        "instruct.epochs": 1, "instruct.batch_size": 4, "instruct.eval_interval": 2, "instruct.eval_batches": 1,
        "instruct.n_responses": 2, "instruct.max_new_tokens": 8,
        # DPO on a few of the embedded preference pairs (the data stage reads the whole sample)
        "preference.max_samples": 8, "preference.batch_size": 4, "preference.n_responses": 2,
        "preference.max_new_tokens": 8, "preference.eval_interval": 1000, "data.preference.splits": [0.97, 0.01, 0.02],
        # a reward model on the same few pairs, and two GRPO steps of 2 prompts x 2 short answers
        "reward.max_samples": 8, "reward.batch_size": 4, "reward.eval_interval": 1000,
        "rl.max_prompts": 4, "rl.batch_size": 4, "rl.num_generations": 2, "rl.max_completion_length": 8,
        "rl.max_new_tokens": 8, "rl.n_responses": 2,
        "benchmark.variants": ["baseline", "sdpa"], "benchmark.steps": 1, "benchmark.warmup": 1,
        "benchmark.attention_seq_lens": [16], "benchmark.ce_vocab_sizes": [512], "benchmark.ce_rows": 32,
        "benchmark.profile_steps": 1,
        "evaluate.tasks": ["hellaswag"], "evaluate.hellaswag.source": str(hellaswag), "evaluate.batch_size": 4,
        "instruct.template": "phi3",  # Alpaca's preamble is ~130 ids with the byte-level test tokenizer
        # the quickstart's real model (SmolLM2 from its GGUF file: tests/test_gguf_in.py) is left out;
        # an instruct variant of the tiny GPT stands in for its SFT, scored before and after
        "base.models": {},
        "instruct_variants.models": {"tiny": {"init_from": "checkpoints/pretrain/final", "max_samples": 8,
                                              "score_before": True, "n_responses": 1}},
    }


# --------------------------------------------------------------------------------------------
# Headless Chromium for the chat page (tests/browser.py); CI installs it


@pytest.fixture(scope="module")
def browser():
    from browser import Browser, find_chromium

    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium: the chat page is not checked (apt-get install -y chromium)")
    b = Browser(binary, free_port())
    yield b
    b.close()


# --------------------------------------------------------------------------------------------
# A fake LLM judge (an OpenAI-compatible chat completions endpoint on 127.0.0.1)


class FakeJudge(ChatEndpoint):
    """The instruct stage's judge: "85" when the response equals the reference, "I think 150"
    when the response mentions "overflow", "Score: 12" otherwise."""

    def answer(self, body: dict) -> str:
        prompt = body["messages"][0]["content"]
        reference = re.search(r"correct output `(.*?)`, score", prompt, re.S).group(1)
        response = re.search(r"model response `(.*?)` on a scale", prompt, re.S).group(1)
        return "85" if response == reference else "I think 150" if "overflow" in response else "Score: 12"


@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GPTFORGE_JUDGE_API_KEY", raising=False)
    monkeypatch.delenv("GPTFORGE_SYNTH_API_KEY", raising=False)


@pytest.fixture
def fake_judge(no_proxy):
    judge = FakeJudge()
    yield judge
    judge.close()
