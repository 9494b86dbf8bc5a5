"""`gptforge serve --engine vllm` (`gptforge.serve.vllm`) without vLLM, which is GPU software: the
command it builds for each kind of model, the one-line refusals (vllm not installed, a
classifier, two models), the export of a gptforge checkpoint (done once per weights, with the
instruct template as its chat template), and the run itself with a stand-in for vLLM's Python
that records what it was given and answers SIGTERM, as vLLM's server does."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gptforge.config.load import load_config
from gptforge.errors import BadInput
from gptforge.finetune.templates import ALPACA_NO_INPUT, PHI3
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.weights import save_model
from gptforge.samples import resolve as sample
from gptforge.serve import vllm
from gptforge.serve.sources import ModelSource

BLOCK = 48
GPT2_TOKENIZER = sample("sample://gpt2_tokenizer")
# Stands in for /opt/vllm/bin/python: writes its arguments, VLLM_API_KEY and its pid as JSON
# (whole, once its SIGTERM handler is in place), then serves until SIGTERM (exit 0, as vLLM's
# server does) or exits at once with STUB_EXIT.
STUB = """#!/usr/bin/env python3
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
out = os.environ["STUB_OUT"]
with open(out + ".tmp", "w") as f:
    json.dump({"argv": sys.argv[1:], "api_key": os.environ.get("VLLM_API_KEY"), "pid": os.getpid()}, f)
os.replace(out + ".tmp", out)
if "STUB_EXIT" in os.environ:
    sys.exit(int(os.environ["STUB_EXIT"]))
while True:
    time.sleep(0.1)
"""


@pytest.fixture
def stub(tmp_path, monkeypatch) -> Path:
    """GPTFORGE_VLLM_PYTHON = the stand-in; returns the file it writes."""
    python = tmp_path / "vllm-python"
    python.write_text(STUB.replace("/usr/bin/env python3", sys.executable))
    python.chmod(0o755)
    out = tmp_path / "stub.json"
    monkeypatch.setenv(vllm.PYTHON_ENV, str(python))
    monkeypatch.setenv("STUB_OUT", str(out))
    monkeypatch.setenv("STUB_EXIT", "0")
    monkeypatch.setenv("GPTFORGE_SERVE_CACHE", str(tmp_path / "cache"))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A gptforge checkpoint with the GPT-2 vocabulary (the export writes the GPT-2 tokenizer)."""
    torch.manual_seed(0)
    return save_model(
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=BLOCK)), tmp_path_factory.mktemp("ckpt") / "final"
    )


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, [f"tokenizer.path={GPT2_TOKENIZER}"])


def hf_folder(path: Path, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return path


# ---------------------------------------------------------------------------------------------
# The command


def test_vllm_command():
    assert vllm.vllm_command(
        "/opt/vllm/bin/python", "/m/instruct", name="gptforge-instruct", host="0.0.0.0", port=8000, max_model_len=1024
    ) == [
        "/opt/vllm/bin/python",
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        "/m/instruct",
        "--served-model-name",
        "gptforge-instruct",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--max-model-len",
        "1024",
    ]
    # The model folder's own tokenizer is not repeated; another one is named, as is a chat template.
    same = vllm.vllm_command("py", "/m", name="m", host="127.0.0.1", port=1, tokenizer="/m")
    assert "--tokenizer" not in same and "--max-model-len" not in same
    other = vllm.vllm_command(
        "py",
        "/m/model",
        name="m",
        host="127.0.0.1",
        port=1,
        tokenizer="/m/components/tokenizer",
        chat_template="/m/t.jinja",
    )
    assert other[-4:] == ["--tokenizer", "/m/components/tokenizer", "--chat-template", "/m/t.jinja"]


def test_context_length(tmp_path):
    assert vllm.context_length(hf_folder(tmp_path / "a", max_position_embeddings=2048, n_positions=7)) == 2048
    assert vllm.context_length(hf_folder(tmp_path / "b", n_positions=1024)) == 1024
    assert vllm.context_length(hf_folder(tmp_path / "c")) is None
    assert vllm.context_length(tmp_path / "none") is None


def test_without_vllm_one_line_says_so(monkeypatch, tmp_path):
    assert vllm.importlib.util.find_spec("vllm") is None, "this test is for machines without vllm"
    monkeypatch.delenv(vllm.PYTHON_ENV, raising=False)
    with pytest.raises(BadInput) as e:
        vllm.run_vllm(
            [ModelSource("m", "hf", hf_folder(tmp_path / "m"), None, "m")],
            host="127.0.0.1",
            port=8000,
            api_key=None,
            cfg=load_config(None),
        )
    message = str(e.value)
    assert "\n" not in message
    assert "vllm is not installed here" in message and "docker/Dockerfile" in message
    assert "`--engine gptforge` (the default)" in message
    monkeypatch.setenv(vllm.PYTHON_ENV, str(tmp_path / "nothing"))
    with pytest.raises(BadInput, match=f"{vllm.PYTHON_ENV}=.*nothing is not an executable"):
        vllm.vllm_python()


@pytest.mark.parametrize("case", ["classifier", "two models", "none"])
def test_one_language_model_only(case, tmp_path):
    lm = ModelSource("instruct", "hf", tmp_path, tmp_path, "x")
    given = {
        "classifier": [lm, ModelSource("classify", "classifier", tmp_path, None, "y")],
        "two models": [lm, ModelSource("base", "gptforge", tmp_path, None, "z")],
        "none": [],
    }[case]
    with pytest.raises(BadInput, match="serves one (language )?model per process") as e:
        vllm.pick_model(given)
    assert "\n" not in str(e.value)
    assert vllm.pick_model([lm]) is lm


CONVERSATIONS = [
    [{"role": "user", "content": "Name a colour."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": 'Say "hi" {{ twice }}\n'},
    ],
    [{"role": "developer", "content": "A"}, {"role": "system", "content": ""}, {"role": "user", "content": "é"}],
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from hf_models import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"), chat_template=None)


@pytest.mark.parametrize("template", ["alpaca", "phi3"])
def test_chat_template_renders_as_our_engine(template, tok):
    """What vLLM is given for an exported gptforge model prompts it as `gptforge serve` does."""
    import jinja2

    from gptforge.serve.loading import render_conversation

    jinja = vllm.chat_template(template)
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(
            messages, chat_template=jinja, tokenize=False, add_generation_prompt=True
        ) == render_conversation(messages, template)
    with pytest.raises(jinja2.TemplateError, match="messages must end with a user message"):
        tok.apply_chat_template(CONVERSATIONS[1][:3], chat_template=jinja, tokenize=False)
    assert PHI3.format(content="x") in render_conversation([{"role": "user", "content": "x"}], "phi3")
    assert vllm.chat_template("chat") is None


# ---------------------------------------------------------------------------------------------
# Running it (with the stand-in)


def test_a_hugging_face_folder_is_served_as_it_is(stub, tmp_path, cfg):
    folder = hf_folder(tmp_path / "model", max_position_embeddings=256)
    tokenizer = tmp_path / "components" / "tokenizer"
    source = ModelSource("gptforge-instruct", "hf", folder, tokenizer, "models:/gptforge-instruct@champion")
    rc = vllm.run_vllm([source], host="127.0.0.1", port=8123, api_key="s3cret", cfg=cfg)
    assert rc == 0
    got = json.loads(stub.read_text())
    assert got["argv"] == [
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(folder),
        "--served-model-name",
        "gptforge-instruct",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--max-model-len",
        "256",
        "--tokenizer",
        str(tokenizer),
    ]
    assert got["api_key"] == "s3cret"  # in vLLM's environment, not on its command line
    assert "s3cret" not in got["argv"]


@pytest.mark.slow
def test_a_checkpoint_is_exported_once_per_weights(stub, checkpoint, cfg, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from gptforge.register.lineage import folder_hash

    ckpt = Path(shutil.copytree(checkpoint, tmp_path / "final"))
    source = ModelSource("tiny", "gptforge", ckpt, Path(GPT2_TOKENIZER), str(ckpt))
    assert vllm.run_vllm([source], host="127.0.0.1", port=8124, api_key=None, cfg=cfg) == 0
    got = json.loads(stub.read_text())
    folder = Path(got["argv"][3])
    assert folder.parent == tmp_path / "cache" / "export"
    assert got["argv"][4:] == [
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8124",
        "--max-model-len",
        str(BLOCK),
        "--chat-template",
        str(folder / vllm.CHAT_TEMPLATE_FILE),
    ]
    assert got["api_key"] is None

    # The chat template renders a conversation as our own engine does (the instruct template).
    tok = AutoTokenizer.from_pretrained(folder)
    assert (folder / vllm.CHAT_TEMPLATE_FILE).read_text() == vllm.chat_template("alpaca")
    assert tok.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}],
        tokenize=False,
        chat_template=vllm.chat_template("alpaca"),
        add_generation_prompt=True,
    ) == ALPACA_NO_INPUT.format(instruction="Name a colour.")

    # Same weights: no second export. New weights in the same folder: exported again.
    weights = folder / "model.safetensors"
    first, before = weights.read_bytes(), weights.stat().st_mtime_ns
    assert vllm.run_vllm([source], host="127.0.0.1", port=8124, api_key=None, cfg=cfg) == 0
    assert weights.stat().st_mtime_ns == before
    torch.manual_seed(1)
    save_model(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=BLOCK)), ckpt)
    assert vllm.run_vllm([source], host="127.0.0.1", port=8124, api_key=None, cfg=cfg) == 0
    assert Path(json.loads(stub.read_text())["argv"][3]) == folder
    assert weights.read_bytes() != first
    assert json.loads((folder / vllm.EXPORT_MARKER).read_text())["weights"] == folder_hash(ckpt)


def test_exit_code_of_vllm_is_ours(stub, tmp_path, cfg, monkeypatch, caplog):
    monkeypatch.setenv("STUB_EXIT", "3")
    source = ModelSource("m", "hf", hf_folder(tmp_path / "m"), None, "m")
    assert vllm.run_vllm([source], host="127.0.0.1", port=8125, api_key="k", cfg=cfg) == 3
    assert "/invocations" not in caplog.text
    # vLLM leaves its /invocations route open whatever the key: said when it listens beyond loopback.
    vllm.run_vllm([source], host="0.0.0.0", port=8125, api_key="k", cfg=cfg)
    assert "/invocations route serves the model without it" in caplog.text


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught >> (sig - 1) & 1)


@pytest.mark.slow  # a subprocess that imports gptforge
def test_sigterm_reaches_vllm(stub, tmp_path):
    """vLLM runs as our child: a SIGTERM to gptforge (docker stop) stops it, and we exit 143."""
    folder = hf_folder(tmp_path / "m")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STUB_EXIT")
    code = (
        "import sys; from pathlib import Path; from gptforge.config.load import load_config; "
        "from gptforge.serve.sources import ModelSource; from gptforge.serve.vllm import run_vllm; "
        f"sys.exit(run_vllm([ModelSource('m', 'hf', Path({str(folder)!r}), None, 'm')], host='127.0.0.1', "
        "port=8126, api_key=None, cfg=load_config(None)))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    child = None
    try:
        # Sent once both ends are ready, not after a pause: the stand-in has started (its file is
        # written after its handler is set) and gptforge forwards SIGTERM (run_vllm called
        # directly sets no SIGTERM handler but forwarded_to's). The deadline is against a hang only.
        deadline = time.monotonic() + 120
        while not (stub.exists() and catches(proc.pid, signal.SIGTERM)):
            assert proc.poll() is None, f"gptforge exited with {proc.returncode} before vLLM's stand-in ran"
            assert time.monotonic() < deadline, "vLLM's stand-in never started under a forwarding gptforge"
            time.sleep(0.05)
        child = json.loads(stub.read_text())["pid"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):  # the stand-in is gone, not orphaned
            os.kill(child, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Through the CLI


@pytest.mark.slow  # the command line in a subprocess
def test_cli_without_vllm_one_line(checkpoint, tmp_path):
    from cli_support import cli_env, last_error_line, run_cli

    env = cli_env(GPTFORGE_SERVE_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    env.pop(vllm.PYTHON_ENV, None)
    out = run_cli(
        ["serve", "--engine", "vllm", f"tiny={checkpoint}", "-S", f"tokenizer.path={GPT2_TOKENIZER}"],
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    line = last_error_line(out.stderr)
    assert "vllm is not installed here" in line and "`--engine gptforge` (the default)" in line
    assert "Traceback" not in out.stderr
