"""What `gptforge serve MODEL ...` serves: each MODEL (`NAME=SPEC` or `SPEC`) resolved to a local
folder and the kind of model in it.

A SPEC is a registry URI (`models:/gptforge-instruct@champion`, `models:/gptforge-classify/3`;
a key of `registry.names` works as the name: `models:/instruct@champion`), or a folder: a spam
classifier (the head files of `gptforge.finetune.classify` beside its backbone), a Hugging Face
causal LM (a config.json of transformers; GPT-2 folders too, `gptforge export`'s output), or a
gptforge checkpoint (model.safetensors + config.json of `gptforge.modeling.weights`), checked in that
order: a classifier folder holds one of the other two as its backbone. With no MODEL the
pipeline's results are served (`default_specs`): the aligned model first when it is a Hugging
Face model (`rl=checkpoints/rl/final`, the quickstart's SmolLM2 after GRPO; else the DPO
one), each instruct variant (`smollm2=checkpoints/instruct_smollm2/final`, the
quickstart's fine-tuned SmolLM2), then
`instruct=checkpoints/instruct/final` and `classify=checkpoints/classify/final`, each only when
its folder exists. A model's NAME is the
part before `=`, else the registered model's name for a registry URI and the SPEC itself for a
folder; two models with one name are refused.

A registry version is downloaded once, with MLflow's client from the tracking server of
`mlflow_values.tracking_uri()`, into `cache_dir()/<name>/<version>` (a marker file says from which
registry and run, so a second start reuses it and a version of another registry is fetched
again), and read as MLflow wrote it: the transformers flavor (how `gptforge register` logs
language models) is `model/` with the tokenizer in `components/tokenizer/`, whose files are also
copied into `model/` so that the model folder loads on its own (transformers, vLLM); the spam
classifier's pyfunc keeps its artifacts `classifier` (the folder) and `tokenizer` (optional)
under `artifacts/`. mlflow is imported only for registry URIs: a folder resolves without it
(a serving image need not have it). Every error is a one-line BadInput (SourceUnreachable for a
tracking server that does not answer, after `gptforge.register.models`' 2 retries).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from gptforge.config.schema import variant_paths
from gptforge.errors import BadInput, GptforgeError, SourceUnreachable
from gptforge.finetune.classifier import HEAD_CONFIG, HEAD_FILE
from gptforge.modeling.hf_causal import _CAUSAL_ARCHITECTURES, CONFIG_FILE, hf_config_dict, hf_source
from gptforge.modeling.weights import WEIGHTS_FILE, load_config

log = logging.getLogger("gptforge")

Kind = Literal["gptforge", "hf", "classifier"]
DEFAULT_SPECS = ("instruct=checkpoints/instruct/final", "classify=checkpoints/classify/final")
ALIGNED_SPECS = ("rl=checkpoints/rl/final", "preference=checkpoints/preference/final")
REGISTRY_SCHEME = "models:/"
CACHE_ENV = "GPTFORGE_SERVE_CACHE"
MARKER = ".gptforge-source.json"  # written last into a downloaded version: the download is whole
_NAME = re.compile(r"^[^\s=]+$")
_REGISTRY_URI = re.compile(r"^models:/(?P<name>[^@/]+)(?:@(?P<alias>[^@/]+)|/(?P<version>[0-9]+))$")


@dataclass
class ModelSource:
    """One model to serve.

    `path` is the folder to load: a gptforge checkpoint, a Hugging Face causal-LM folder (with
    its tokenizer files) or a classifier folder. `tokenizer` is what its text is encoded with:
    for kind "hf" the Hugging Face tokenizer folder (the model folder itself for a local
    folder); for "gptforge" and a classifier on our GPT, a `tokenizer.path` for
    `gptforge.modeling.tokenizer.load_tokenizer` (a folder with encoder.json + vocab.bpe or a .tiktoken
    file; None means tiktoken's gpt2); None for a classifier with a Hugging Face backbone (it
    brings its own). `spec` is the SPEC as given, without `NAME=`."""

    name: str
    kind: Kind
    path: Path
    tokenizer: Path | None
    spec: str


def cache_dir() -> Path:
    """Where registry versions and vLLM's exports are kept: $GPTFORGE_SERVE_CACHE, else
    $XDG_CACHE_HOME/gptforge/serve, else ~/.cache/gptforge/serve."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gptforge" / "serve"


def split_model(model: str) -> tuple[str | None, str]:
    """`NAME=SPEC` -> (NAME, SPEC); a SPEC alone -> (None, SPEC). A folder whose own name holds
    `=` is taken whole when it exists."""
    if "=" not in model or Path(model).expanduser().exists():
        return None, model
    name, spec = model.split("=", 1)
    if not _NAME.match(name) or not spec:
        raise BadInput(
            f"MODEL {model!r}: expected NAME=SPEC or SPEC, with a NAME without spaces "
            "(e.g. instruct=checkpoints/instruct/final)"
        )
    return name, spec


def resolve(spec: str, cfg) -> ModelSource:
    """One MODEL (`NAME=SPEC` or `SPEC`) as a ModelSource; see the module docstring."""
    name, spec = split_model(spec)
    if spec.startswith(REGISTRY_SCHEME):
        return _from_registry(spec, name, cfg)
    return _from_folder(name or spec, Path(spec).expanduser(), spec, cfg)


def default_specs(cfg, *, language_models_only: bool = False) -> list[str]:
    """The pipeline's models whose folder exists: the end of the alignment course (the RL model,
    then the DPO one) when it is a Hugging Face model (the quickstart's aligned SmolLM2; a tiny
    GPT's aligned copies answer no better than its SFT), the instruct variants' (real models
    such as SmolLM2's SFT), the instruct model, the classifier."""
    aligned = [s for s in ALIGNED_SPECS if hf_source(split_model(s)[1]) is not None]
    specs = aligned[:1] + [f"{name}={variant_paths(name)['out_dir']}/final" for name in cfg.instruct_variants.models]
    specs += DEFAULT_SPECS[:1] if language_models_only else DEFAULT_SPECS
    return [s for s in specs if Path(split_model(s)[1]).is_dir()]


def resolve_all(specs: Sequence[str], cfg) -> list[ModelSource]:
    """Every MODEL resolved, in order; no MODEL: `default_specs`. Names must differ."""
    if not specs:
        present = default_specs(cfg)
        if not present:
            folders = " nor ".join(split_model(s)[1] for s in DEFAULT_SPECS)
            raise BadInput(
                f"no MODEL given and neither {folders} exists: run the pipeline (make run) or name "
                "models (gptforge serve models:/gptforge-instruct@champion, or a model folder)"
            )
        specs = present
    sources: list[ModelSource] = []
    for spec in specs:
        source = resolve(spec, cfg)
        same = next((s for s in sources if s.name == source.name), None)
        if same is not None:
            raise BadInput(
                f"two models are named {source.name!r} ({same.spec} and {source.spec}): "
                f"name one of them with NAME=SPEC (e.g. other={source.spec})"
            )
        sources.append(source)
    return sources


# ---------------------------------------------------------------------------------------------
# Folders


def _tokenizer_path(cfg) -> Path | None:
    path = cfg.tokenizer.path
    return Path(path) if path is not None else None


def _from_folder(name: str, path: Path, spec: str, cfg) -> ModelSource:
    """The kind of model in `path`: classifier, Hugging Face causal LM or gptforge checkpoint."""
    if not path.exists():
        hub = (
            "; a Hugging Face hub id is not fetched: download the model where the hub is reachable and name its folder"
            if hf_source(spec) is not None
            else ""
        )
        raise BadInput(
            f"{spec}: no such folder (a MODEL is a registry URI models:/NAME@ALIAS or models:/NAME/VERSION, "
            f"a gptforge checkpoint, a Hugging Face causal-LM folder or a classifier folder){hub}"
        )
    if not path.is_dir():
        raise BadInput(f"{spec}: not a folder (a model folder holds config.json and the weights)")
    head = [(path / f).is_file() for f in (HEAD_CONFIG, HEAD_FILE)]
    if any(head) and not all(head):
        missing = HEAD_FILE if head[0] else HEAD_CONFIG
        raise BadInput(
            f"{path / missing}: not found (a classifier folder holds {HEAD_FILE} and {HEAD_CONFIG} beside the model)"
        )
    if all(head):
        hf_backbone = hf_config_dict(path / CONFIG_FILE) is not None
        return ModelSource(name, "classifier", path, None if hf_backbone else _tokenizer_path(cfg), spec)
    # Any Hugging Face config (what `hf_source` takes, and GPT-2 folders such as `gptforge export`'s
    # output, which training converts to our GPT but transformers serves as they are).
    config = hf_config_dict(path / CONFIG_FILE)
    if config is not None:
        archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
        if archs and not any(a.endswith(_CAUSAL_ARCHITECTURES) for a in archs):
            raise BadInput(
                f"{spec}: a {', '.join(archs)} model, not a causal language model (*ForCausalLM) or a classifier folder"
            )
        return ModelSource(name, "hf", path, path, spec)
    if (path / CONFIG_FILE).is_file():
        load_config(path)  # BadInput naming the file when it is not a gptforge model config
        if not (path / WEIGHTS_FILE).is_file():
            raise BadInput(
                f"{path / WEIGHTS_FILE}: not found (a gptforge checkpoint holds {WEIGHTS_FILE} and {CONFIG_FILE})"
            )
        return ModelSource(name, "gptforge", path, _tokenizer_path(cfg), spec)
    hint = f"; did you mean {path / 'final'}?" if (path / "final").is_dir() else ""
    raise BadInput(
        f"{spec}: not a model folder: no {CONFIG_FILE} (a gptforge checkpoint holds {WEIGHTS_FILE} + "
        f"{CONFIG_FILE}, a Hugging Face model its config.json, a classifier also {HEAD_CONFIG}){hint}"
    )


# ---------------------------------------------------------------------------------------------
# The MLflow Model Registry


def _from_registry(spec: str, name: str | None, cfg) -> ModelSource:
    match = _REGISTRY_URI.match(spec)
    if match is None:
        raise BadInput(
            f"{spec}: expected models:/NAME@ALIAS or models:/NAME/VERSION "
            "(e.g. models:/gptforge-instruct@champion, models:/gptforge-classify/3)"
        )
    registered = cfg.registry.names.get(match["name"], match["name"])  # models:/instruct@champion
    from gptforge.register import models as registry
    from gptforge.runtime import mlflow_values

    uri = mlflow_values.tracking_uri()
    client = registry._client(uri)  # MLflow's retries bounded as `gptforge models` bounds them
    if client is None:
        raise BadInput(
            f"{spec}: no model registry at {uri} (the file does not exist): set MLFLOW_TRACKING_URI to "
            f"the tracking server, or {registry.HOW_TO_REGISTER}"
        )
    try:
        with registry._registry_errors(uri):
            model = registry._model(client, registered, uri)
            version = _version(client, model, registered, match["alias"], match["version"])
            folder = _download(client, registered, version, uri)
    except GptforgeError as e:  # MLflow's messages can span lines: the CLI prints one
        raise type(e)(" ".join(str(e).split())) from None
    return _mlflow_model(name or registered, folder, spec)


def _version(client, model, registered: str, alias: str | None, version: str | None) -> str:
    """The version number an alias points at, or the given version once it is known to exist."""
    from mlflow.exceptions import MlflowException

    if alias is not None:
        aliases = model.aliases or {}
        if alias not in aliases:
            held = ", ".join(f"@{a} (version {v})" for a, v in sorted(aliases.items())) or "none"
            raise BadInput(
                f"{registered} has no alias @{alias}; its aliases: {held} (gptforge models list --name {registered})"
            )
        return str(aliases[alias])
    try:
        return str(client.get_model_version(registered, str(int(version))).version)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{registered}'"))
    raise BadInput(
        f"{registered} has no version {int(version)}; its versions: "
        f"{', '.join(map(str, versions)) or 'none'} (gptforge models list --name {registered})"
    )


def _download(client, registered: str, version: str, uri: str) -> Path:
    """The version's MLflow model in the cache, downloaded unless the cache holds it whole."""
    import mlflow
    import requests

    from gptforge.io import atomic_dir, write_json

    mv = client.get_model_version(registered, version)
    # Which registry (hashed: a tracking URI can hold credentials) and which logged model.
    marker = {
        "registry": hashlib.sha256(uri.encode("utf-8")).hexdigest()[:16],
        "name": registered,
        "version": str(version),
        "source": mv.source,
        "run_id": mv.run_id,
    }
    target = cache_dir() / re.sub(r"[^A-Za-z0-9._-]", "_", registered) / str(version)
    try:
        if json.loads((target / MARKER).read_text(encoding="utf-8")) == marker:
            log.info("serve: models:/%s/%s from the cache %s", registered, version, target)
            return target
    except (OSError, ValueError):
        pass
    log.info("serve: downloading models:/%s/%s from %s into %s", registered, version, uri, target)
    try:
        with atomic_dir(target) as tmp:
            mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{registered}/{version}", dst_path=str(tmp), tracking_uri=uri
            )
            _complete_hf_folder(tmp)
            write_json(tmp / MARKER, marker)
    except (OSError, requests.RequestException) as e:
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise SourceUnreachable(
            f"cannot download models:/{registered}/{version} from {uri} into {target} ({reason})"
        ) from None
    return target


def _flavors(folder: Path) -> dict:
    import yaml

    try:
        flavors = yaml.safe_load((folder / "MLmodel").read_text(encoding="utf-8"))["flavors"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise BadInput(f"{folder}: not an MLflow model folder ({type(e).__name__}: {e})") from None
    if not isinstance(flavors, dict):
        raise BadInput(f"{folder / 'MLmodel'}: no flavors")
    return flavors


def _transformers_parts(folder: Path, flavor: dict) -> tuple[Path, Path | None]:
    """(weights folder, tokenizer folder) of MLflow's transformers flavor."""
    model = folder / str(flavor.get("model_binary") or "model")
    tokenizer = folder / "components" / "tokenizer" if "tokenizer" in (flavor.get("components") or []) else None
    return model, tokenizer


def _complete_hf_folder(folder: Path) -> None:
    """Copy the transformers flavor's tokenizer files into its model folder (where transformers
    and vLLM look for them), leaving any file the model folder has."""
    flavor = _flavors(folder).get("transformers")
    if flavor is None:
        return
    model, tokenizer = _transformers_parts(folder, flavor)
    if tokenizer is None or not tokenizer.is_dir() or not model.is_dir():
        return
    for file in tokenizer.iterdir():
        if file.is_file() and not (model / file.name).exists():
            shutil.copy2(file, model / file.name)


def _mlflow_model(name: str, folder: Path, spec: str) -> ModelSource:
    """The downloaded MLflow model as the folder to serve: transformers flavor -> "hf", the spam
    classifier's pyfunc -> "classifier"."""
    flavors = _flavors(folder)
    if "transformers" in flavors:
        model, tokenizer = _transformers_parts(folder, flavors["transformers"])
        if not (model / CONFIG_FILE).is_file():
            raise BadInput(f"{spec}: the transformers flavor's model folder {model} has no {CONFIG_FILE}")
        return ModelSource(name, "hf", model, tokenizer if tokenizer is not None else model, spec)
    artifacts = (flavors.get("python_function") or {}).get("artifacts") or {}
    if "classifier" in artifacts:
        classifier = folder / artifacts["classifier"]["path"]
        if not (classifier / HEAD_CONFIG).is_file():
            raise BadInput(f"{spec}: its classifier artifact {classifier} has no {HEAD_CONFIG}")
        tokenizer = folder / artifacts["tokenizer"]["path"] if "tokenizer" in artifacts else None
        return ModelSource(name, "classifier", classifier, tokenizer, spec)
    raise BadInput(
        f"{spec}: an MLflow model of flavor {', '.join(sorted(flavors)) or 'none'}; gptforge serve serves "
        "the transformers flavor (language models) and gptforge's spam classifier pyfunc, as "
        "`gptforge register` logs them"
    )
