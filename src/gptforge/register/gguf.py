"""GGUF copies of registered language models: written by the `register` stage, pulled back by
`gptforge models gguf`.

With `registry.gguf` set to a quantization (f16, q8_0, ...), the stage exports each registered
language model (pretrain, instruct, preference, rl: the classifier and the reward model are not
causal LMs) with `modeling.gguf_out.export_gguf`, logs the file and its Ollama Modelfile as
artifacts of the stage's MLflow run (`gguf/<model>-v<version>-<quant>/`) and tags the model
version with where they are (`gptforge.gguf.<quant>`), so a version reached by its alias
(`champion`) can be pulled as a GGUF as well as loaded as an MLflow model. A version that has
the tag already (the same weights registered again) is not exported again. A model that GGUF
cannot hold (a gptforge GPT whose tokenizer is a .tiktoken rank file: it has no Hugging Face
form) gets a warning and a row in the report; the stage goes on.

`pull_gguf` downloads a version's files into a folder, which appears whole or not at all.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from gptforge.errors import BadInput

log = logging.getLogger("gptforge")

GENERATIVE = ("pretrain", "instruct", "preference", "rl")
TAG_PREFIX = "gptforge.gguf."


def attach_gguf(model: str, name: str, version: str, folder: Path, cfg, client, run) -> str:
    """The artifact URI of `version`'s GGUF files (written and logged now unless its tag says
    they are there), or a sentence saying why there is none."""
    from gptforge.finetune.templates import ollama_template, prompt_template
    from gptforge.modeling.gguf_out import export_gguf

    quant = cfg.registry.gguf
    tag = TAG_PREFIX + quant
    existing = client.get_model_version(name, version).tags.get(tag)
    if existing:
        log.info("register %s: version %s has its %s GGUF already (%s)", model, version, quant, existing)
        return existing
    where = f"gguf/{model}-v{version}-{quant}"
    with tempfile.TemporaryDirectory(prefix="gptforge-gguf-") as tmp:
        try:
            export_gguf(
                folder,
                Path(tmp) / f"{name}-v{version}-{quant}.gguf",
                quant,
                cfg.tokenizer.path,
                ollama_template(prompt_template(cfg.instruct.template)),
            )
        except BadInput as e:
            log.warning("register %s: no GGUF for version %s: %s", model, version, e)
            return f"none: {e}"
        client.log_artifacts(run.run_id, tmp, where)  # sent now: the files go with the folder
    uri = f"runs:/{run.run_id}/{where}"
    client.set_model_version_tag(name, version, tag, uri)
    log.info("register %s: version %s as GGUF (%s) at %s", model, version, quant, uri)
    return uri


def local_gguf(client, uri: str) -> str:
    """The .gguf file behind `uri` (runs:/RUN/PATH) when the run's artifacts are a local folder
    (a file: store, as the quickstart's), else ""."""
    from urllib.parse import unquote, urlparse

    if not uri.startswith("runs:/"):
        return ""
    run_id, _, where = uri.removeprefix("runs:/").partition("/")
    try:
        root = client.get_run(run_id).info.artifact_uri
    except Exception as e:  # noqa: BLE001 - only a convenience for the closing summary
        log.debug("no local GGUF for %s: %s", uri, e)
        return ""
    parsed = urlparse(root)
    if parsed.scheme not in ("", "file"):
        return ""
    files = sorted((Path(unquote(parsed.path)) / where).glob("*.gguf"))
    return str(files[0]) if len(files) == 1 else ""


def pull_gguf(cfg, name: str, out: str | Path, alias: str = "champion", quant: str | None = None) -> Path:
    """Download the GGUF file and Modelfile of `name`@`alias` (a version number works too) into
    the folder `out`; the .gguf path."""
    from gptforge.io import atomic_dir
    from gptforge.register.models import _client, _model, _registry_errors, _resolve
    from gptforge.runtime import mlflow_values

    name, uri = _resolve(cfg, name), mlflow_values.tracking_uri()
    client = _client(uri)
    if client is None:
        raise BadInput(f"no registered model {name!r}: {uri} does not exist yet")
    with _registry_errors(uri):
        _model(client, name, uri)
        mv = (
            client.get_model_version(name, alias) if alias.isdigit() else client.get_model_version_by_alias(name, alias)
        )
        tags = {k[len(TAG_PREFIX) :]: v for k, v in mv.tags.items() if k.startswith(TAG_PREFIX)}
        if not tags or (quant is not None and quant not in tags):
            have = f"it has {', '.join(sorted(tags))}" if tags else "it has none"
            raise BadInput(
                f"{name} version {mv.version} has no {quant or ''} GGUF copy ({have}): set registry.gguf "
                f"(e.g. q8_0) and run `gptforge register`, or export it with `gptforge export --format gguf`"
            )
        if quant is None:
            quant = cfg.registry.gguf if cfg.registry.gguf in tags else sorted(tags)[0]
        import mlflow

        with atomic_dir(out) as tmp:
            got = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=tags[quant], dst_path=str(tmp / ".get"), tracking_uri=uri
                )
            )
            for f in got.iterdir():  # the files themselves in `out`, not the artifact's folder
                f.rename(tmp / f.name)
            shutil.rmtree(tmp / ".get")
            files = sorted(p.name for p in tmp.glob("*.gguf"))
            if len(files) != 1:
                raise BadInput(f"{tags[quant]} holds {len(files)} .gguf files, expected one")
    return Path(out) / files[0]
