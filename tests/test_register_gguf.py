"""The register stage's GGUF copies (registry.gguf; gptforge.register.gguf) and `gptforge models
gguf`, which pulls the champion's back.

A tiny Llama folder (tests/hf_models.py) as the instruct model, a sqlite store: the version is
tagged with its GGUF files' artifact URI; the pulled file, read by transformers' own GGUF loader,
gives the folder's logits (f16, within 1e-2 relative) and a Modelfile comes with it; the same
weights registered again reuse the version and its file (no second export); a gptforge GPT with
a .tiktoken tokenizer (no Hugging Face form) gets a report row saying why it has none, and the
stage goes on. Pulling what does not exist is one line, exit 2, nothing written.
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest
import torch
from cli_support import REPO
from hf_models import make_tiny_causal_lm

from gptforge.config.load import load_config

pytestmark = pytest.mark.slow  # models exported, logged and loaded: seconds


@pytest.fixture
def store(tmp_path, mlflow_uri, monkeypatch) -> str:
    from gptforge.runtime import mlflow_values

    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_uri[len("sqlite:///") :], db)
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv(mlflow_values.PARENT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    return uri


def _register(sets: list[str]):
    from gptforge.register import register
    from gptforge.runtime import tracking

    cfg = load_config(REPO / "params.yaml", sets)
    with tracking.start_run(enabled=True, experiment="t", stage="register") as run:
        return register(cfg, run=run)


def test_registered_llama_has_a_gguf_that_pulls_back_with_its_logits(store, tmp_path, capsys, monkeypatch):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from gptforge.cli import main

    folder = make_tiny_causal_lm(tmp_path / "checkpoints/instruct/final", "llama", seed=4)
    metrics = _register(["registry.gguf=f16"])
    assert metrics["instruct.version"] == 1 and metrics["instruct.new"] == 1
    client = MlflowClient(store)
    tags = client.get_model_version("gptforge-instruct", "1").tags
    uri = tags["gptforge.gguf.f16"]
    assert uri.startswith("runs:/") and uri.endswith("/gguf/instruct-v1-f16")
    report = Path("reports/register.md").read_text()
    assert f"| {uri} |" in report

    rc = main(["models", "gguf", "instruct", "--out", str(tmp_path / "pulled")])
    assert rc == 0, capsys.readouterr().err
    pulled = sorted(p.name for p in (tmp_path / "pulled").iterdir())
    assert pulled == ["Modelfile", "gptforge-instruct-v1-f16.gguf"]
    # Readable as plain files are (Ollama's service runs as another user): the umask's mode.
    from gptforge.io import umask

    for path, base in ((tmp_path / "pulled", 0o777), *((p, 0o666) for p in (tmp_path / "pulled").iterdir())):
        assert stat.S_IMODE(path.stat().st_mode) == base & ~umask(), path
    modelfile = (tmp_path / "pulled/Modelfile").read_text()
    assert modelfile.startswith("FROM ./gptforge-instruct-v1-f16.gguf\n") and "<|im_start|>" in modelfile
    source = AutoModelForCausalLM.from_pretrained(folder).eval()
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "pulled"), gguf_file="gptforge-instruct-v1-f16.gguf", dtype=torch.float32
    ).eval()
    ids = torch.arange(3, 80).unsqueeze(0) * 613 % 50257
    with torch.no_grad():
        want, got = source(ids).logits, model(ids).logits
    assert ((want - got).abs().amax(-1) / want.abs().amax(-1)).max() < 1e-2

    # The same weights again: the version and its GGUF are reused, nothing is exported or logged.
    import gptforge.modeling.gguf_out as gguf_out

    calls = []
    original = gguf_out.export_gguf
    monkeypatch.setattr(gguf_out, "export_gguf", lambda *a, **k: calls.append(a) or original(*a, **k))
    metrics = _register(["registry.gguf=f16"])
    assert calls == []
    assert metrics["instruct.version"] == 1 and metrics["instruct.new"] == 0
    assert client.get_model_version("gptforge-instruct", "1").tags["gptforge.gguf.f16"] == uri

    # Another quantization of the same version: a second copy beside the first, pulled by --quant.
    _register(["registry.gguf=q8_0"])
    tags = client.get_model_version("gptforge-instruct", "1").tags
    assert len(calls) == 1  # the q8_0 copy is new
    assert tags["gptforge.gguf.f16"] == uri and tags["gptforge.gguf.q8_0"].endswith("/gguf/instruct-v1-q8_0")
    assert main(["models", "gguf", "instruct", "--quant", "q8_0", "--out", str(tmp_path / "q8")]) == 0
    assert (tmp_path / "q8/gptforge-instruct-v1-q8_0.gguf").is_file()


def test_a_model_without_a_hugging_face_form_is_reported_and_the_stage_goes_on(store, tmp_path, small_tokenizer):
    from test_export import checkpoint as gpt_checkpoint

    gpt_checkpoint(tmp_path / "checkpoints/pretrain/final")
    make_tiny_causal_lm(tmp_path / "checkpoints/instruct/final", "llama", seed=5)
    metrics = _register(["registry.gguf=q8_0", f"tokenizer.path={small_tokenizer}"])
    report = Path("reports/register.md").read_text()
    assert "| pretrain | | | not registered |" in report  # the .tiktoken tokenizer: no HF form at all
    assert metrics["instruct.version"] == 1
    row = next(line for line in report.splitlines() if line.startswith("| instruct |"))
    assert "/gguf/instruct-v1-q8_0 |" in row


@pytest.mark.parametrize(
    "args, message",
    [
        (["gptforge-nope"], "no registered model 'gptforge-nope'"),
        (["instruct", "--alias", "challenger"], "alias"),
        (["instruct", "--quant", "q4_0"], "has no q4_0 GGUF copy (it has f16)"),
    ],
)
def test_pulling_what_is_not_there_is_one_line(args, message, store, tmp_path, capsys):
    from gptforge.cli import main

    make_tiny_causal_lm(tmp_path / "checkpoints/instruct/final", "llama", seed=6)
    _register(["registry.gguf=f16"])
    capsys.readouterr()
    rc = main(["models", "gguf", *args, "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and message in lines[-1], lines[-3:]
    assert not (tmp_path / "out").exists()
