"""What `gptforge serve` serves (`gptforge.serve.sources`): every kind of model folder, NAME=SPEC,
duplicate names, missing folders and the default MODELs; the MLflow Model Registry end to end
against a real `mlflow server` (a Hugging Face LM in the transformers flavor and the spam
classifier's pyfunc, downloaded once into the cache and loaded from there as the server loads
them), and its one-line errors: unknown model, alias or version, a registry that does not exist,
a tracking server that does not answer."""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path

import pytest
import torch
from hf_models import make_tiny_causal_lm
from process_support import free_port

from gptforge.config.load import load_config
from gptforge.errors import BadInput, SourceUnreachable
from gptforge.finetune import classifier as clf
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.weights import save_model
from gptforge.serve import sources
from gptforge.serve.sources import ModelSource, resolve, resolve_all

BLOCK = 32
TEXTS = ["WINNER!! Claim your free prize now", "see you at lunch"]


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=320, n_vocab=281))


@pytest.fixture(scope="module")
def cfg(small_tokenizer):
    return load_config(None, [f"tokenizer.path={small_tokenizer}"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One folder of each kind (weights are only read where a test loads them)."""
    root = tmp_path_factory.mktemp("models")
    gpt = save_model(tiny_gpt(), root / "gpt")
    classifier = root / "classifier"
    clf.save_classifier(clf.GPTClassifier(tiny_gpt(1), 2, max_length=BLOCK), classifier)
    # Hugging Face folders as far as resolving reads them: config.json (the tiny Llama of
    # hf_models is made, and loaded, in the registry test).
    llama = root / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    gpt2 = root / "gpt2-export"  # what `gptforge export` writes: a GPT-2 folder
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    hf_classifier = root / "hf-classifier"  # a classifier on a Hugging Face backbone
    hf_classifier.mkdir()
    for name in ("config.json", clf.HEAD_CONFIG, clf.HEAD_FILE):
        (hf_classifier / name).write_bytes((llama / "config.json").read_bytes() if name == "config.json" else b"{}")
    bert = root / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    return {
        "gpt": gpt,
        "classifier": classifier,
        "llama": llama,
        "gpt2": gpt2,
        "hf_classifier": hf_classifier,
        "bert": bert,
    }


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message, message
    return message


# ---------------------------------------------------------------------------------------------
# Folders


def test_every_kind_of_folder(folders, cfg, small_tokenizer):
    got = {key: resolve(str(path), cfg) for key, path in folders.items() if key != "bert"}
    assert got["gpt"] == ModelSource(
        str(folders["gpt"]), "gptforge", folders["gpt"], small_tokenizer, str(folders["gpt"])
    )
    assert got["classifier"].kind == "classifier" and got["classifier"].tokenizer == small_tokenizer
    assert got["llama"].kind == "hf" and got["llama"].tokenizer == folders["llama"]
    assert got["gpt2"].kind == "hf"  # training converts GPT-2 folders to our GPT; serving takes them as they are
    # A Hugging Face backbone brings its own tokenizer; the head files make it a classifier first.
    assert got["hf_classifier"].kind == "classifier" and got["hf_classifier"].tokenizer is None
    for key, source in got.items():
        assert source.name == source.spec == str(folders[key])


def test_tokenizer_none_is_tiktokens_gpt2(folders):
    source = resolve(str(folders["gpt"]), load_config(None))
    assert source.kind == "gptforge" and source.tokenizer is None


def test_name_equals_spec(folders, cfg, tmp_path, monkeypatch):
    source = resolve(f"tiny={folders['gpt']}", cfg)
    assert (source.name, source.spec, source.path) == ("tiny", str(folders["gpt"]), folders["gpt"])
    # A folder whose own name holds `=` is a SPEC when it exists.
    odd = tmp_path / "lr=3e-4"
    save_model(tiny_gpt(), odd)
    monkeypatch.chdir(tmp_path)
    assert resolve("lr=3e-4", cfg).name == "lr=3e-4"
    for bad in ("=" + str(folders["gpt"]), "a b=" + str(folders["gpt"]), "name="):
        with pytest.raises(BadInput, match="NAME=SPEC") as e:
            resolve(bad, cfg)
        one_line(e)


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "hub id",
        "file",
        "empty",
        "checkpoints root",
        "bert",
        "no weights",
        "foreign config",
        "half a classifier",
    ],
)
def test_folders_that_are_no_model(case, folders, cfg, tmp_path):
    path = tmp_path / "m"
    if case == "file":
        path.write_text("x")
    elif case in ("empty", "no weights", "foreign config", "half a classifier"):
        path.mkdir()
    if case == "checkpoints root":
        save_model(tiny_gpt(), path / "final")
    if case == "bert":
        path = folders["bert"]
    if case == "hub id":
        path = Path("Qwen/Qwen2.5-0.5B-Instruct")
    if case == "no weights":
        save_model(tiny_gpt(), path)
        (path / "model.safetensors").unlink()
    if case == "foreign config":
        (path / "config.json").write_text(json.dumps({"hidden": 3}))
    if case == "half a classifier":
        save_model(tiny_gpt(), path)
        (path / clf.HEAD_CONFIG).write_text("{}")
    expected = {
        "missing": "no such folder",
        "hub id": "a Hugging Face hub id is not fetched",
        "file": "not a folder",
        "empty": "not a model folder",
        "checkpoints root": f"did you mean {path / 'final'}",
        "bert": "BertModel model, not a causal",
        "no weights": "model.safetensors: not found",
        "foreign config": "not a gptforge model config",
        "half a classifier": f"{clf.HEAD_FILE}: not found",
    }[case]
    with pytest.raises(BadInput) as e:
        resolve(str(path), cfg)
    assert expected in one_line(e)


def test_duplicate_names_are_refused(folders, cfg):
    with pytest.raises(BadInput, match="two models are named 'lm'") as e:
        resolve_all([f"lm={folders['gpt']}", f"lm={folders['llama']}"], cfg)
    one_line(e)
    with pytest.raises(BadInput, match="two models are named"):
        resolve_all([str(folders["gpt"]), str(folders["gpt"])], cfg)
    got = resolve_all([str(folders["gpt"]), f"again={folders['gpt']}"], cfg)
    assert [s.name for s in got] == [str(folders["gpt"]), "again"]


def test_default_models(folders, cfg, tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        BadInput, match="no MODEL given and neither checkpoints/instruct/final nor checkpoints/classify/final exists"
    ) as e:
        resolve_all([], cfg)
    one_line(e)
    shutil.copytree(folders["classifier"], tmp_path / "checkpoints/classify/final")
    got = resolve_all([], cfg)  # the missing instruct model is skipped without an error
    assert [(s.name, s.kind, s.spec) for s in got] == [("classify", "classifier", "checkpoints/classify/final")]
    shutil.copytree(folders["gpt"], tmp_path / "checkpoints/instruct/final")
    assert [(s.name, s.kind) for s in resolve_all([], cfg)] == [("instruct", "gptforge"), ("classify", "classifier")]


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(sources.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert sources.cache_dir() == tmp_path / "xdg" / "gptforge" / "serve"
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "mine"))
    assert sources.cache_dir() == tmp_path / "mine"


def test_local_folders_resolve_without_mlflow(folders, small_tokenizer):
    """The serving image may lack mlflow: resolving a folder must not import it."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['mlflow'] = None; "  # any `import mlflow` now fails
        "from gptforge.config.load import load_config; from gptforge.serve.sources import resolve_all; "
        f"print([s.kind for s in resolve_all({[str(p) for p in folders.values() if p.name != 'bert']!r}, "
        f"load_config(None, ['tokenizer.path={small_tokenizer}']))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["['gptforge',", "'classifier',", "'hf',", "'hf',", "'classifier']"]


# ---------------------------------------------------------------------------------------------
# The registry


@pytest.mark.parametrize(
    "spec", ["models:/", "models:/x", "models:/x@", "models:/x/latest", "models:/x/1/2", "models:/m-79ce3da1"]
)
def test_malformed_registry_uris(spec, cfg):
    with pytest.raises(BadInput, match="expected models:/NAME@ALIAS or models:/NAME/VERSION") as e:
        resolve(spec, cfg)
    one_line(e)


def test_a_registry_that_does_not_exist(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/none.db")
    with pytest.raises(BadInput, match="no model registry at sqlite:///") as e:
        resolve("models:/gptforge-instruct@champion", cfg)
    one_line(e)
    assert not (tmp_path / "none.db").exists()  # reading creates no database


def test_an_unreachable_tracking_server_fails_in_one_line_within_seconds(cfg, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    # Unset, so that gptforge's own bound (gptforge.register.models) is what is checked; set first
    # so that monkeypatch also removes what gptforge sets, after the test.
    for name in (
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
        "MLFLOW_HTTP_REQUEST_TIMEOUT",
    ):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    importlib.import_module("mlflow")  # its import (seconds on a loaded machine) is not what is timed

    start = time.monotonic()
    with pytest.raises(SourceUnreachable, match=f"the MLflow tracking server {url} cannot be reached") as e:
        resolve("models:/gptforge-instruct@champion", cfg)
    took = time.monotonic() - start
    one_line(e)
    # gptforge.register.models bounds MLflow's retries to 2 (a few seconds); MLflow's own 7, with
    # their backoff, take minutes. 60 s tells the two apart on any machine, however loaded.
    print(f"unreachable tracking server reported after {took:.1f} s")
    assert took < 60


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "llama")


@pytest.mark.slow
def test_registry_versions_are_downloaded_once_and_load(
    llama, folders, cfg, small_tokenizer, mlflow_server, tmp_path, monkeypatch
):
    import mlflow
    from mlflow.tracking import MlflowClient

    from gptforge.modeling.hf_causal import load_causal_lm
    from gptforge.modeling.tokenizer import load_tokenizer
    from gptforge.register.pyfunc import log_classifier
    from gptforge.runtime.tracking import start_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    for name in ("GPTFORGE_PARENT_RUN_ID", "DVC_STAGE", "GPTFORGE_RUN_TAGS", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    with start_run(enabled=True, experiment="serve-sources", stage="register") as run:
        lm_uri = run.log_hf_model(llama, "instruct")  # no input example: its signature inference costs 14 s
        clf_uri = log_classifier(folders["classifier"], tokenizer_path=small_tokenizer, name="classify").model_uri
    assert lm_uri is not None
    client = MlflowClient(mlflow_server)
    for uri, name in ((lm_uri, "gptforge-instruct"), (clf_uri, "gptforge-classify")):
        version = mlflow.register_model(uri, name).version
        client.set_registered_model_alias(name, "champion", version)

    got = resolve_all(["models:/instruct@champion", "spam=models:/gptforge-classify/1"], cfg)
    lm, classifier = got
    assert (lm.name, lm.kind, lm.spec) == ("gptforge-instruct", "hf", "models:/instruct@champion")
    assert lm.path == tmp_path / "cache" / "gptforge-instruct" / "1" / "model"
    assert lm.tokenizer == tmp_path / "cache" / "gptforge-instruct" / "1" / "components" / "tokenizer"
    assert (classifier.name, classifier.kind) == ("spam", "classifier")
    assert classifier.tokenizer is not None and classifier.tokenizer.name == small_tokenizer.name

    # The model folder loads on its own (its tokenizer files were copied in), as the one logged.
    model, tokenizer = load_causal_lm(str(lm.path), param="serve")
    want, want_tokenizer = load_causal_lm(str(llama), param="serve")
    ids = want_tokenizer("The quick brown fox", return_tensors="pt").input_ids
    assert tokenizer("The quick brown fox", return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want(ids).logits)
    loaded = clf.load_classifier(classifier.path)
    local = clf.load_classifier(folders["classifier"])
    enc = load_tokenizer(str(classifier.tokenizer))
    assert torch.equal(
        clf.class_probabilities(loaded, TEXTS, enc),
        clf.class_probabilities(local, TEXTS, load_tokenizer(str(small_tokenizer))),
    )

    # A second start reads the cache: no download.
    def no_download(**kwargs):
        raise AssertionError(f"downloaded again: {kwargs}")

    with monkeypatch.context() as m:
        m.setattr(mlflow.artifacts, "download_artifacts", no_download)
        again = resolve_all(["models:/gptforge-instruct@champion", "models:/gptforge-classify@champion"], cfg)
    assert [s.path for s in again] == [lm.path, classifier.path]
    # A cache entry of another registry (or a half download: no marker) is fetched again; a
    # download that fails leaves the entry as it was.
    marker = lm.path.parent / sources.MARKER
    marker.write_text(marker.read_text().replace('"registry": "', '"registry": "0'))
    calls = []

    def failing_download(**kwargs):
        calls.append(kwargs["artifact_uri"])
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(mlflow.artifacts, "download_artifacts", failing_download)
        with pytest.raises(SourceUnreachable, match="cannot download models:/gptforge-instruct/1 .*disk full") as e:
            resolve("models:/gptforge-instruct@champion", cfg)
    one_line(e)
    assert calls == ["models:/gptforge-instruct/1"]
    assert json.loads(marker.read_text())["registry"].startswith("0") and (lm.path / "config.json").is_file()

    # Unknown model, alias and version: one line each, saying what there is.
    for spec, expected in (
        ("models:/gptforge-nothing@champion", "no registered model 'gptforge-nothing'"),
        (
            "models:/gptforge-instruct@staging",
            "gptforge-instruct has no alias @staging; its aliases: @champion (version 1)",
        ),
        ("models:/gptforge-classify/7", "gptforge-classify has no version 7; its versions: 1"),
    ):
        with pytest.raises(BadInput) as e:
            resolve(spec, cfg)
        assert expected in one_line(e)
