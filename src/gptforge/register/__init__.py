"""Stage `register`: every model the pipeline made, versioned in the MLflow Model Registry.

For each model of `registry.names` whose folder exists (the pretrained LM, the spam classifier,
the instruction model, the preference-tuned model, the reward model, the RL model) the stage
logs it as an MLflow model in the stage's run and registers it as a new version of its
registered model, unless a version with the same weights already exists (the weights' hash is a
version tag: re-running with nothing changed adds no version). Language models go through
MLflow's transformers flavor (a gptforge checkpoint is exported to a Hugging Face folder first),
the reward model through the same flavor as a text-classification pipeline whose score is the
raw logit, the classifier as a pyfunc that takes texts (`pyfunc.py`). Every version
carries its lineage as tags (git commit, the dvc.lock hashes of the stage that made it and of its
data, the Prefect flow run and MLflow run that trained it, its evaluation metrics:
`lineage.py`) and a description saying how to reproduce it. The promotion gate
(`registry.promote`, `gate.py`) gives a version that meets its conditions the alias `champion`
(the previous champion keeps its version number) and one that does not `challenger`. With
`registry.gguf` (a quantization: f16, q8_0, ...) each language model's version also gets a GGUF
file and Ollama Modelfile for llama.cpp (`gguf.py`; `gptforge models gguf` pulls them).

Writes `metrics/register.json` (`<model>.version`, `<model>.new`, `<model>.champion`) and
`reports/register.md` (which version each model got, and whether it passed the gate and why). A
language model whose tokenizer transformers cannot hold (a `.tiktoken` rank file: the tests'
small tokenizers) is left out with a warning and a row in the report.
`gptforge models list|promote` (models.py) reads and moves the aliases afterwards.

`registry.only=MODEL` (dvc.yaml's register@MODEL, one stage per model) registers that model alone
and writes its outcome only (`metrics/register/MODEL.json`, `reports/register/MODEL.json`:
`collect.py`); stage `register_report` then writes the two files above over every model. Without
it the stage does both.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from gptforge.config.chain import MODEL_FOLDERS, chain
from gptforge.errors import BadInput, StageFailed
from gptforge.io import entry_path
from gptforge.register.collect import (
    ABSENT,
    CHALLENGER,
    CHAMPION,
    NOT_REGISTERED,
    OFF,
    REGISTERED,
    Registered,
    selected_models,
    write_model_outcome,
    write_report,
)
from gptforge.runtime import run_context, tracking
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun

log = logging.getLogger("gptforge")

# model -> (the DVC stage that makes it, its folder (config.chain's), the metrics file of that stage)
STAGES = {
    "pretrain": "pretrain",
    "classify": "finetune_classify",
    "instruct": "finetune_instruct",
    "preference": "finetune_preference",
    "reward": "train_reward",
    "rl": "finetune_rl",
}
MODELS = {model: (stage, MODEL_FOLDERS[model], model) for model, stage in STAGES.items()}
PROMPT_EXAMPLE = "Once upon a time"


class NotRegistrable(Exception):
    """A model the registry cannot hold as an MLflow model (the stage warns and goes on)."""


def metrics_of(model: str, metrics_dir: Path, evaluation: str | None = None) -> dict[str, float]:
    """The metrics a version carries as tags: its stage's file whole, and its evaluation, keyed
    `<file>.<key>` as the gate names them (`evaluate.<name>.<task>.<metric>`). The evaluation is
    `evaluation` (registry.evaluations.MODEL) when it is an evaluate@NAME file
    (metrics/evaluate/NAME.json); with no `evaluation`, metrics/evaluate/<model>.json, else the
    model's rows of metrics/evaluate.json."""
    found: dict[str, float] = {}
    own = metrics_dir / "evaluate" / f"{model}.json"
    sources = [(MODELS[model][2], "", MODELS[model][2])]
    if evaluation is not None:
        name = Path(evaluation).stem
        if Path(evaluation).parent.name == "evaluate":
            sources.append((f"evaluate/{name}", "", f"evaluate.{name}"))
    else:
        sources.append(
            (f"evaluate/{model}", "", f"evaluate.{model}") if own.is_file() else ("evaluate", f"{model}.", "evaluate")
        )
    for file, prefix, named in sources:
        path = metrics_dir / f"{file}.json"
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        found.update(
            {
                f"{named}.{k}": float(v)
                for k, v in values.items()
                if k.startswith(prefix) and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
        )
    return found


# A text-generation model's MLflow signature (a string in, a string out, and the number of new
# tokens as a parameter whose default is the pipeline's own, 256), as `ModelSignature.to_dict`
# writes it: what the flavor would infer by generating from the input example, which took 36 s of
# registering SmolLM2. A dict, since it travels through the journal.
TEXT_SIGNATURE = {
    "inputs": '[{"type": "string", "required": true}]',
    "outputs": '[{"type": "string", "required": true}]',
    "params": '[{"name": "max_new_tokens", "type": "long", "default": 256, "shape": null}]',
}
# MLflow checks that a logged model serves by generating from its input example: with these
# parameters 16 tokens (1.4 s for SmolLM2) instead of the default 256 (17.6 s of each registration).
EXAMPLE_PARAMS = {"max_new_tokens": 16}


def log_model(model: str, folder: Path, cfg, run) -> str:
    """Log the model in the stage's run as an MLflow model named `model`; its URI."""
    from gptforge.modeling.hf_causal import hf_source

    if model == "classify":
        from gptforge.register.pyfunc import log_classifier

        backbone_is_hf = hf_source(str(folder)) is not None
        info = log_classifier(folder, tokenizer_path=None if backbone_is_hf else cfg.tokenizer.path, name=model)
        return info.model_uri
    if model == "reward":  # a sequence classifier: its one logit is the reward
        uri = run.log_hf_model(
            folder,
            model,
            input_example=PROMPT_EXAMPLE,
            task="text-classification",
            model_config={"function_to_apply": "none"},
        )
    elif hf_source(str(folder)) is not None:
        uri = run.log_hf_model(
            folder, model, input_example=PROMPT_EXAMPLE, example_params=EXAMPLE_PARAMS, signature=TEXT_SIGNATURE
        )
    else:  # a gptforge checkpoint: the transformers flavor takes its Hugging Face export
        from gptforge.modeling.export import export_hf

        with tempfile.TemporaryDirectory(prefix="gptforge-register-") as tmp:
            try:
                export_hf(folder, Path(tmp) / "hf", cfg.tokenizer.path)
            except BadInput as e:  # e.g. a .tiktoken rank file: transformers has no tokenizer for it
                raise NotRegistrable(f"{folder} cannot become a Hugging Face model ({e})") from None
            uri = run.log_hf_model(
                Path(tmp) / "hf",
                model,
                input_example=PROMPT_EXAMPLE,
                example_params=EXAMPLE_PARAMS,
                signature=TEXT_SIGNATURE,
            )
    if uri is None:
        raise StageFailed(f"register: {folder} could not be logged as an MLflow model (the warning above says why)")
    return uri


def register_model(model: str, name: str, cfg, run, client, metrics_dir: Path) -> Registered:
    """One model: reuse the version with the same weights or log and register a new one, tag
    it with its lineage, then apply the gate."""
    from gptforge.register import gate, lineage
    from gptforge.register.gguf import GENERATIVE, attach_gguf, local_gguf

    stage, folder, _ = MODELS[model]
    folder = Path(folder)
    weights = lineage.folder_hash(folder)
    existing = [v for v in _versions(client, name) if v.tags.get("gptforge.weights_hash") == weights]
    if existing:
        version, new = existing[0].version, False
        log.info("register %s: %s version %s has these weights already: no new version", model, name, version)
    else:
        uri = log_model(model, folder, cfg, run)
        commit = run_context.git_commit()
        tags = lineage.version_tags(
            stage=stage,
            weights_hash=weights,
            commit=commit,
            lock=lineage.dvc_lock_hashes(stage),
            run=lineage.training_run(client, cfg.tracking.experiment, stage),
            metrics=metrics_of(model, metrics_dir, cfg.registry.evaluations.get(model)),
        )
        tags["gptforge.lineage"] = " -> ".join(chain(str(folder), cfg))  # e.g. base -> SFT -> DPO
        import mlflow

        mv = mlflow.register_model(uri, name, tags=tags)
        client.update_model_version(name, mv.version, description=lineage.description(stage, commit))
        version, new = mv.version, True
        log.info("register %s: %s version %s (from %s)", model, name, version, folder)
    gguf = gguf_file = ""
    if cfg.registry.gguf and model in GENERATIVE:
        gguf = attach_gguf(model, name, str(version), folder, cfg, client, run)
        gguf_file = local_gguf(client, gguf)
    result = gate.check(model, cfg.registry.promote.get(model, {}), metrics_dir)
    client.set_model_version_tag(
        name, version, "gptforge.gate", "passed" if result.passed else "failed: " + "; ".join(result.reasons)
    )
    alias = CHAMPION if result.passed else CHALLENGER
    client.set_registered_model_alias(name, alias, version)
    log.info("register %s: version %s is %s (%s)", model, version, alias, "; ".join(result.reasons))
    return Registered(model, name, str(version), new, result.passed, list(result.reasons), gguf, gguf_file)


def _versions(client, name: str) -> list:
    """Every version of a registered model, newest first ([] before it exists)."""
    versions = client.search_model_versions(f"name = '{name}'")
    return sorted(versions, key=lambda v: int(v.version), reverse=True)


def register(
    cfg,
    *,
    steps: Steps = DIRECT,
    run: NullRun = NullRun(),
    metrics_path="metrics/register.json",
    report_path="reports/register.md",
    metrics_dir="metrics",
    records_dir="reports/register",
) -> dict:
    """Stage `register`: see the module docstring. Returns the flat metrics it wrote: with
    `registry.only` (dvc.yaml's register@MODEL) that model's alone, unprefixed."""
    unknown = sorted(set(cfg.registry.names) - set(MODELS))
    if unknown:
        raise BadInput(f"registry.names.{unknown[0]}: unknown model; the pipeline makes {', '.join(MODELS)}")
    unknown = sorted(set(cfg.registry.promote) - set(MODELS))
    if unknown:
        raise BadInput(f"registry.promote.{unknown[0]}: unknown model; the pipeline makes {', '.join(MODELS)}")
    from gptforge.register import gate

    for model, conditions in cfg.registry.promote.items():  # malformed conditions fail before any work
        for key, text in conditions.items():
            gate.parse_condition(text, param=f"registry.promote.{model}.{key}")
    names = selected_models(cfg.registry)
    outcome = {"metrics_path": metrics_path, "records_dir": records_dir}
    results: list[Registered] = []
    skipped: dict[str, str] = {}  # model -> why it could not be registered
    figures: dict[str, dict] = {}  # model -> its metrics/register/MODEL.json
    if not isinstance(run, tracking.MlflowRun):
        log.warning(
            "register: tracking is disabled (tracking.enabled: false): the registry is MLflow's, nothing registered"
        )
        for model in names:
            figures[model] = write_model_outcome(model, OFF, **outcome)
    else:
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        for model, name in names.items():
            if not Path(MODELS[model][1]).is_dir():
                log.info("register: skipping %s: %s not found", model, MODELS[model][1])
                figures[model] = write_model_outcome(model, ABSENT, **outcome)
                continue
            try:
                results.append(steps(register_model, model, name, cfg, run, client, Path(metrics_dir)))
                figures[model] = write_model_outcome(model, REGISTERED, results[-1], **outcome)
            except NotRegistrable as e:
                log.warning("register: %s not registered: %s", model, e)
                skipped[model] = str(e)
                figures[model] = write_model_outcome(model, NOT_REGISTERED, why=str(e), **outcome)
    if cfg.registry.only is not None:
        mine = figures[cfg.registry.only]
        run.log_metrics(mine)
        run.log_artifact(entry_path(metrics_path, cfg.registry.only))
        return mine
    metrics: dict[str, float] = {}
    for r in results:
        metrics.update(
            {f"{r.model}.version": int(r.version), f"{r.model}.new": int(r.new), f"{r.model}.champion": int(r.passed)}
        )
    write_report(report_path, results, skipped)
    tracking.publish_metrics(run, metrics, metrics_path)
    run.log_artifact(report_path)
    return metrics
