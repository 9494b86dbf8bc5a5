"""Shared fixtures. Nothing here touches the network: real servers run on 127.0.0.1 only.

Expensive things are made once per session: a Prefect server (about 15-20 s to start) that
every CLI subprocess talks to through PREFECT_API_URL, and a migrated MLflow database (about
7 s of migrations) that CLI tests share.

The plain helpers that tests import live beside it: cli_support.py (running the command line
and reading what it left), process_support.py (processes, servers and waiting on them) and
fixture_data.py (the data these fixtures are made of, FakeRun and FakeJudge).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# absl (which rouge-score imports) makes a logging handler at import whose stream is the
# sys.stderr of that moment: inside a test, pytest's capture stream. Prefect's import runs
# logging.config.dictConfig, which closes every handler made so far, and absl's handler closes
# a stream that is not the current sys.stderr: pytest's capture, so the worker dies ("lost
# sys.stderr") in whatever test imports Prefect after one that imported rouge-score. Made here,
# before any test, on the real stderr (which absl never closes).
import absl.logging  # noqa: E402
import pytest

absl.logging.get_absl_handler().python_handler.setStream(sys.__stderr__)

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

# After the environment is set (fixture_data imports gptforge).
from cli_support import BIN, REPO, cli_env  # noqa: E402
from fixture_data import SMALL_MERGES, SMS_LINES, FakeJudge, write_tiktoken  # noqa: E402
from process_support import _SHARED_TMP, free_port, prefect_home, stop_process, wait_http  # noqa: E402


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down
def pytest_sessionfinish(session, exitstatus):
    """The recorders this session's tests started (one per test folder that ran a recorded
    stage) leave with it rather than after their idle time, and so does the CLI fork server.
    A passing xdist worker removes its temporary folder: pyproject's tmp_path_retention_policy
    ("failed") removes each passing test's tmp_path, but not the module and session fixtures'
    folders under a base temp that xdist names (~1 GB a green suite)."""
    import cli_zygote
    import psutil

    cli_zygote.close()
    base = str(session.config._tmp_path_factory.getbasetemp()) if hasattr(session.config, "_tmp_path_factory") else None
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        try:
            cmd = proc.info["cmdline"] or []
            if (
                {"flows.recorder", "flows.recorder_host"} & set(cmd)
                and base
                and (proc.info["cwd"] or "").startswith(base)
            ):
                proc.terminate()
        except (psutil.Error, OSError):
            pass
    if base and exitstatus == 0 and hasattr(session.config, "workerinput"):
        shutil.rmtree(base, ignore_errors=True)


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


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct dequantized from its packaged GGUF file by prepare_base's fetch (a
    path ending .gguf), once per test worker (tests/test_gguf_in.py checks it, test_gguf_out.py
    exports it)."""
    from gptforge.data.base_models import fetch
    from gptforge.modeling import gguf_in

    path = gguf_in.packaged_file("smollm2-135m-instruct", param="p")
    dest = tmp_path_factory.mktemp("gguf") / "checkpoints" / "base" / "smollm2"
    got = fetch(str(path), dest, param="base.models.smollm2")
    assert got["parameters"] == 134515008 and got["gguf_bytes"] == path.stat().st_size
    return dest


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory) -> Path:
    """A small byte-level BPE (280 tokens) in tiktoken's format, whose ids are easy to reason about."""
    tokens = []
    for t in SMALL_MERGES:
        if t == b" of":
            t = b" o" + b"f"
        tokens.append(t)
    return write_tiktoken(tmp_path_factory.mktemp("tok") / "small.tiktoken", tokens)


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
        {
            "instruction": f"Give a synonym for word number {i}.",
            "input": "" if i % 3 else f"word {i}",
            "output": f"synonym {i}",
        }
        for i in range(40)
    ]
    path = tmp_path / "alpaca_data.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# Servers and the CLI


@pytest.fixture(scope="session", autouse=True)
def _shared_tmp(tmp_path_factory) -> None:
    """The folder that every xdist worker of this run shares (a single process: its own base)."""
    base = tmp_path_factory.getbasetemp()
    _SHARED_TMP[:] = [base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base]


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real `prefect server start` on a free loopback port, shared by the session."""
    home = prefect_home(tmp_path_factory.mktemp("prefect-home"))
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    # The UI asks this URL for its data (its default is port 4200).
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": url,
    }
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
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


@pytest.fixture
def mlflow_server(tmp_path, mlflow_uri):
    """`mlflow server` on a free loopback port; its database starts as a copy of the session's
    migrated one (migrations cost ~7 s)."""
    folder = tmp_path / "mlflow-server"
    folder.mkdir()
    shutil.copy(mlflow_uri[len("sqlite:///") :], folder / "mlflow.db")
    port = free_port()
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{folder}/mlflow.db",
            "--artifacts-destination",
            str(folder / "artifacts"),
        ],
        cwd=folder,
        env=cli_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", timeout=120, proc=proc)
        yield url
    finally:
        stop_process(proc)
        log.close()


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
    shutil.copytree(REPO / "docs", dst / "docs")  # the quickstart's document set (synthesize@gptforge-docs)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dst, check=True)
    subprocess.run([*git, "commit", "-qm", "fixture"], cwd=dst, check=True)
    return dst


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
