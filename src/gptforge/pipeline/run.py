"""The pipeline: `dvc repro` of every stage (or the named ones), recorded as one run.

DVC decides what is stale; this module only wraps it (the `dvc` commands and what they print:
gptforge.pipeline.dvc). One pipeline run is:

1. check the params and the stage names before any work;
2. apply the run's params file (an overlay merged whole) and `-S` overrides to `params.yaml` (DVC
   tracks that file, as `dvc exp run --set-param` does), so the stages see them and `dvc.lock` records them;
3. `dvc pull` when a default DVC remote is configured; a remote that cannot be reached is a
   warning, and the pipeline runs locally;
4. `dvc repro [STAGE ...]` in a child process, with the pipeline's MLflow run id in
   `GPTFORGE_PARENT_RUN_ID` so every stage's MLflow run nests under it (and, from the Prefect
   flow, the pipeline's flow run id so every stage's flow run is its subflow);
5. `dvc push` when a remote is configured; a failed push is reported, not fatal.

The result is a `PipelineReport`: each stage's status (ran, up to date, restored from DVC's
run cache, failed, not run), duration, headline metrics and MLflow run. A failed stage fails
the pipeline with the stage named. The library never imports Prefect: a typed pipeline
journals its flow run, tasks and markdown artifact (`gptforge.pipeline.recorded`), and
`flows/pipeline.py` makes them in Prefect's engine for a deployment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from gptforge.config.load import DEFAULT_PARAMS, EXTENDS, apply_overrides, bases, read_params, read_yaml, validate
from gptforge.config.schema import Config, variant_paths
from gptforge.errors import BadInput, StageFailed
from gptforge.io import atomic_file, read_json
from gptforge.pipeline.dvc import (
    ReproOutcome,
    best_error,
    check_stage_names,
    child_env,
    default_remote,
    dvc_pull,
    dvc_push,
    dvc_repro,
    dvc_stages,
    stage_metrics_files,
)
from gptforge.pipeline.kept_lock import kept_dvc_lock
from gptforge.runtime import locks, mlflow_values, tracking
from gptforge.runtime.steps import DIRECT, Steps

log = logging.getLogger("gptforge")

STATUS_ICONS = {"ran": "✅", "up to date": "⏭️", "restored": "♻️", "failed": "❌", "not run": "⏸️"}


@dataclass
class StageReport:
    name: str
    status: str = "not run"  # ran | up to date | restored | failed | not run
    seconds: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    run_id: str | None = None
    run_url: str | None = None


@dataclass
class PipelineReport:
    stages: list[StageReport]
    seconds: float = 0.0
    remote: str | None = None
    pulled: str | None = None  # what happened to `dvc pull` (None: no remote)
    pushed: str | None = None
    failed_stage: str | None = None
    error: str | None = None
    run_id: str | None = None
    run_url: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def raise_for_failure(self) -> None:
        if self.error is not None:
            raise StageFailed(self.error)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.stages:
            out[s.status] = out.get(s.status, 0) + 1
        return out

    def markdown(self) -> str:
        head = "succeeded" if self.ok else f"FAILED at stage `{self.failed_stage}`" if self.failed_stage else "FAILED"
        lines = [
            f"## gptforge pipeline {head}",
            "",
            f"{len(self.stages)} stages in {self.seconds:.1f} s: "
            + ", ".join(f"{n} {status}" for status, n in self.counts().items()),
            "",
        ]
        if self.error:
            lines += [f"**Error:** {self.error}", ""]
        lines += ["| stage | status | duration | headline metrics | MLflow run |", "| --- | --- | --- | --- | --- |"]
        for s in self.stages:
            seconds = f"{s.seconds:.1f} s" if s.seconds is not None else ""
            metrics = ", ".join(f"{k} {_fmt(v)}" for k, v in s.metrics.items())
            run = f"[{s.run_id[:8]}]({s.run_url})" if s.run_url else (f"`{s.run_id}`" if s.run_id else "")
            lines.append(
                f"| `{s.name}` | {STATUS_ICONS.get(s.status, '')} {s.status} | {seconds} | {metrics} | {run} |"
            )
        lines.append("")
        if self.remote:
            lines.append(f"DVC remote `{self.remote}`: pull {self.pulled}; push {self.pushed}.")
        else:
            lines.append("No DVC remote configured: nothing pulled or pushed.")
        if self.run_url or self.run_id:
            lines.append(f"Pipeline MLflow run: {f'[{self.run_id}]({self.run_url})' if self.run_url else self.run_id}")
        return "\n".join(lines) + "\n"

    def summary_lines(self) -> list[str]:
        out = []
        for s in self.stages:
            seconds = f" in {s.seconds:.1f} s" if s.seconds is not None else ""
            metrics = "  " + ", ".join(f"{k}={_fmt(v)}" for k, v in s.metrics.items()) if s.metrics else ""
            out.append(f"{s.name:<18} {s.status}{seconds}{metrics}")
        return out


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def stage_reports(outcome: ReproOutcome, scope: Sequence[str]) -> tuple[list[StageReport], str | None]:
    """Each stage DVC mentioned, in order, then the stages in `scope` it never reached.
    Returns the reports and the stage that failed (the one running when dvc stopped)."""
    reports: dict[str, StageReport] = {}
    current: tuple[str, float] | None = None
    for when, kind, stage in outcome.events:
        if kind == "locked":
            if current:
                reports[current[0]].seconds = when - current[1]
                current = None
            continue
        report = reports.setdefault(stage, StageReport(stage))
        if current:  # a new stage started before the lock file update: the previous one ended
            reports[current[0]].seconds = when - current[1]
            current = None
        if kind == "running":
            report.status = "ran"
            current = (stage, when)
        else:
            report.status = "up to date" if kind == "skipped" else "restored"
    failed = None
    if current:
        reports[current[0]].seconds = outcome.end - current[1]
        if outcome.returncode != 0:
            failed = current[0]
            reports[failed].status = "failed"
    for stage in scope:
        reports.setdefault(stage, StageReport(stage))
    return list(reports.values()), failed


# ---------------------------------------------------------------------------------------------
# The run


def resolve_params(params: str | os.PathLike | None, overrides: Sequence[str], target: Path) -> tuple[dict, Config]:
    """The params tree a run will use (`params`, else `target`, plus overrides) and its
    validated config."""
    source = Path(params) if params is not None else target
    if source.is_file() and target.is_file() and source.resolve() == target.resolve() and EXTENDS in read_yaml(target):
        raise BadInput(
            f"{target} is an overlay ({EXTENDS}), but DVC reads it itself and needs every key there: keep "
            f"the overlay in configs/ and pass it as --params, the pipeline writes the merged whole here"
        )
    tree = read_params(source) if source.is_file() or params is not None else {}
    tree = apply_overrides(tree, list(overrides))
    cfg = validate(tree, f"{source}{' with -S overrides' if overrides else ''}")
    check_start_folders(cfg, target.parent)
    check_evaluations_made(cfg)
    return tree, cfg


PRETRAIN_OUT = "checkpoints/pretrain"
BASE_OUT = "checkpoints/base"
INSTRUCT_OUT = "checkpoints/instruct"
PREFERENCE_OUT = "checkpoints/preference"
REWARD_OUT = "checkpoints/reward"
PRETRAIN_STAGES = ("prepare_pretrain", "pretrain")


def start_folders(cfg: Config) -> dict[str, str]:
    """The folders the fine-tuning and evaluation stages start from, by param: dvc.yaml names
    each `*.init_from` and `rl.reward_model` as dependencies."""
    return {
        "classify.init_from": cfg.classify.init_from,
        "instruct.init_from": cfg.instruct.init_from,
        "preference.init_from": cfg.preference.init_from,
        "reward.init_from": cfg.reward.init_from,
        "rl.init_from": cfg.rl.init_from,
        "rl.reward_model": cfg.rl.reward_model,
        **{f"evaluate.models.{k}": v for k, v in cfg.evaluate.models.items()},
        **{
            f"instruct_variants.models.{k}.init_from": cfg.instruct_variant(k).init_from
            for k in cfg.instruct_variants.models
        },
    }


# The folders a stage of the chain makes before the stage that reads them (param -> folders).
MADE_BEFORE = {
    "preference.init_from": (INSTRUCT_OUT,),
    "reward.init_from": (INSTRUCT_OUT,),
    "rl.init_from": (INSTRUCT_OUT, PREFERENCE_OUT),
    "rl.reward_model": (REWARD_OUT,),
}


def _inside(path: str, folder: str) -> bool:
    parts, top = Path(path).parts, Path(folder).parts
    return parts[: len(top)] == top


def check_start_folders(cfg: Config, root: Path = Path(".")) -> None:
    """dvc.yaml makes each `*.init_from` and `rl.reward_model` a dependency, so each must be a
    folder: made by a stage (checkpoints/pretrain/..., one of MADE_BEFORE's for the stages after
    the SFT, checkpoints/base/NAME for a NAME in base.models) or already there. A hub name is
    refused with the way to fetch it."""
    folders = start_folders(cfg)
    for param in (
        "classify.init_from",
        "instruct.init_from",
        "preference.init_from",
        "reward.init_from",
        "rl.init_from",
        "rl.reward_model",
        *(p for p in folders if p.startswith("instruct_variants.")),
    ):
        value = folders[param]
        made = MADE_BEFORE.get(param, ())
        if param in MADE_BEFORE:  # the chain after an SFT may start from an instruct variant's
            made += tuple(variant_paths(name)["out_dir"] for name in cfg.instruct_variants.models)
        made_before = any(_inside(value, out) for out in made)
        if made_before or _inside(value, PRETRAIN_OUT) or (root / value).exists():
            continue
        if _inside(value, BASE_OUT):
            name = Path(value).relative_to(BASE_OUT).parts[0]
            if name in cfg.base.models:
                continue
            raise BadInput(f"{param}: {value} is fetched by no stage: add `{name}: HUB_ID_OR_FOLDER` under base.models")
        raise BadInput(
            f"{param}: {value!r} is not a folder, and dvc.yaml tracks it as the stage's input: for hub "
            f"weights add `NAME: {value}` under base.models and set {param} to {BASE_OUT}/NAME"
        )


def check_evaluations_made(cfg: Config) -> None:
    """dvc.yaml makes each `registry.evaluations` file a dependency of its register@MODEL: an
    evaluate@NAME file needs NAME in evaluate.models, or no stage writes it."""
    for model, path in cfg.registry.evaluations.items():
        name = Path(path).stem
        if Path(path).parent.as_posix() == "metrics/evaluate" and name not in cfg.evaluate.models:
            raise BadInput(
                f"registry.evaluations.{model}: {path} is written by no stage (evaluate.models has no "
                f"{name}: {', '.join(cfg.evaluate.models) or 'none'}); name one of them, or metrics/{model}.json"
            )


def default_targets(cfg: Config, known: Mapping[str, dict]) -> list[str]:
    """What `dvc repro` runs when no stage is named: every stage (none, meaning all) unless no
    stage starts from the pretrained checkpoint, as when a config fine-tunes hub weights; then
    every stage but the pretraining ones: the foreach groups (synthesize, index, evaluate_qa,
    instruct variants) by their group name when the config gives them entries, prepare_base@NAME
    as the dependency of the stages that read its folder."""
    if any(_inside(v, PRETRAIN_OUT) for v in start_folders(cfg).values()):
        return []
    targets = []
    for name, stage in known.items():
        if name in PRETRAIN_STAGES or name == "prepare_base":
            continue
        if "foreach" in (stage or {}) and not _foreach_entries(cfg, stage["foreach"]):
            continue  # an empty group: `dvc repro NAME` would find no stage
        targets.append(name)
    return targets


def _foreach_entries(cfg: Config, expr) -> int:
    """How many entries a dvc.yaml `foreach: ${a.b}` has in `cfg` (a literal list or table:
    its length)."""
    if not isinstance(expr, str):
        return len(expr or ())
    value = cfg
    for part in expr.strip().removeprefix("${").removesuffix("}").split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return len(value or ())


def check_request(
    stages: Sequence[str], params: str | os.PathLike | None, overrides: Sequence[str], root: Path = Path(".")
) -> None:
    """Everything about a pipeline request that can be checked before any work (BadInput)."""
    check_stage_names(stages, dvc_stages(root))
    resolve_params(params, overrides, root / DEFAULT_PARAMS)


def apply_params(params: str | os.PathLike | None, overrides: Sequence[str], target: Path) -> Config:
    """Validate `params` + `overrides` and, when they differ from `target` (params.yaml),
    write them there atomically. Returns the config the run uses."""
    source = Path(params) if params is not None else target
    tree, cfg = resolve_params(params, overrides, target)
    current = read_yaml(target) if target.is_file() else None
    if current == tree:
        return cfg
    chain = bases(source) if source.is_file() else []
    merged = f" merged over {' over '.join(map(str, chain))}" if chain else ""
    origin = f"{source}{merged}" + (f" with {' '.join(overrides)}" if overrides else "")
    with atomic_file(target, "w", encoding="utf-8") as f:
        f.write(f"# Written by `gptforge pipeline` from {origin}.\n")
        yaml.safe_dump(tree, f, sort_keys=False, default_flow_style=None)
    log.info("params.yaml now holds %s", origin)
    return cfg


def run_pipeline(
    stages: Sequence[str] = (),
    *,
    params: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    pull: bool = True,
    push: bool = True,
    force: bool = False,
    steps: Steps = DIRECT,
    env: Mapping[str, str] | None = None,
    tags: Mapping[str, Any] | None = None,
    late_tags: Callable[[], Mapping[str, Any]] | None = None,
    root: Path = Path("."),
) -> PipelineReport:
    """Run the pipeline in `root` (the repository). Bad params or stage names raise BadInput
    before any work; a failed stage is reported in the result (`raise_for_failure()`).
    `late_tags` gives tags of the pipeline's MLflow run known only once its stages' records are
    delivered (its journaled flow run)."""
    start = time.monotonic()
    known = dvc_stages(root)
    check_stage_names(stages, known)
    # One pipeline at a time, and none while a DVC command runs here: checked before
    # params.yaml is touched, so a refused run changes nothing (apply_params validates first).
    with locks.hold("pipeline", "a gptforge pipeline", root):
        locks.check_dvc_idle(root)
        cfg = apply_params(params, overrides, root / DEFAULT_PARAMS)
        with kept_dvc_lock(root):
            return _run(
                stages,
                known,
                cfg,
                overrides=overrides,
                pull=pull,
                push=push,
                force=force,
                steps=steps,
                env=env,
                tags=tags,
                late_tags=late_tags,
                root=root,
                start=start,
            )


def _wait_for_stage_records(root: Path, timeout: float = 120.0) -> None:
    """The stages' MLflow runs are read back for the summary: wait (bounded) until the recorder
    has delivered the journals of the stages that just ran."""
    from gptforge.runtime import recording

    journals = recording.pending(root)
    api = os.environ.get("PREFECT_API_URL")
    if journals and api and not recording.answers(api):
        # The recorder holds each journal whole while its Prefect side cannot go out: waiting
        # would only delay the summary, which then lacks the stages' MLflow links.
        log.warning(
            "the Prefect API at %s does not answer: %d stage journal(s) wait in %s and are delivered when it is back",
            api,
            len(journals),
            recording.RECORDS_DIR,
        )
        return
    if journals and not recording.wait_delivered(journals, timeout):
        log.warning(
            "the recorder has not delivered %d stage journal(s) within %.0f s; the summary may lack "
            "their MLflow links (they are delivered in the background)",
            len(recording.pending(root)),
            timeout,
        )


def _run(
    stages: Sequence[str],
    known: dict[str, dict],
    cfg: Config,
    *,
    overrides: Sequence[str],
    pull: bool,
    push: bool,
    force: bool,
    steps: Steps,
    env: Mapping[str, str] | None,
    tags: Mapping[str, Any] | None,
    late_tags: Callable[[], Mapping[str, Any]] | None,
    root: Path,
    start: float,
) -> PipelineReport:
    with tracking.start_run(
        enabled=cfg.tracking.enabled,
        experiment=cfg.tracking.experiment,
        stage="pipeline",
        params={
            "stages": ",".join(stages) or "all",
            "force": force,
            **{f"override.{i}": o for i, o in enumerate(overrides)},
        },
        tags=tags,
    ) as run:
        extra = dict(env or {})
        if run.run_id:
            extra[mlflow_values.PARENT_ENV] = run.run_id
        child = child_env(extra)
        report = PipelineReport(stages=[], run_id=run.run_id, run_url=tracking.run_url(run.run_id))
        report.remote = default_remote(child) if (pull or push) else None
        if report.remote and pull:
            report.pulled = steps(dvc_pull, report.remote, child)
        elif report.remote:
            report.pulled = "skipped (--no-pull)"

        targets = list(stages) or default_targets(cfg, known)
        if targets and not stages:
            log.info("no stage starts from %s: not pretraining (dvc repro %s)", PRETRAIN_OUT, " ".join(targets))
        outcome = steps(dvc_repro, targets, child, force)
        scope = targets or [n for n in known if "foreach" not in (known[n] or {})]
        report.stages, report.failed_stage = stage_reports(outcome, scope)
        if outcome.returncode != 0:
            reason = best_error(outcome.errors) or f"dvc repro exited with code {outcome.returncode}"
            report.error = (
                f"stage {report.failed_stage} failed: {reason}"
                if report.failed_stage
                else f"dvc repro failed: {reason}"
            )
        _wait_for_stage_records(root)
        if late_tags is not None:
            run.set_tags(late_tags())
        _add_metrics_and_runs(report, known, root, run.run_id)

        if report.remote and push and report.ok:
            report.pushed = steps(dvc_push, report.remote, child)
        elif report.remote:
            report.pushed = "skipped" + (" (--no-push)" if not push else " (the pipeline failed)")
        report.seconds = time.monotonic() - start

        counts = report.counts()
        run.log_metrics(
            {
                "pipeline_seconds": report.seconds,
                "stages_ran": counts.get("ran", 0),
                "stages_up_to_date": counts.get("up to date", 0) + counts.get("restored", 0),
                "stages_failed": counts.get("failed", 0),
            }
        )
        run.log_text(report.markdown(), "pipeline.md")
        run.set_tags(
            {
                "gptforge.pipeline.status": "ok" if report.ok else "failed",
                "gptforge.pipeline.failed_stage": report.failed_stage,
            }
        )
        if not report.ok:
            run.mark_failed()
    for line in report.summary_lines():
        log.info("%s", line)
    log.info("pipeline %s in %.1f s", "done" if report.ok else "FAILED", report.seconds)
    return report


def _add_metrics_and_runs(
    report: PipelineReport, known: dict[str, dict], root: Path, parent_run_id: str | None
) -> None:
    from gptforge.pipeline.stages import STAGES

    children = tracking.child_runs(parent_run_id) if parent_run_id else {}
    for s in report.stages:
        if s.status in ("ran", "up to date", "restored"):
            values: dict[str, float] = {}
            for path in stage_metrics_files(known.get(s.name) or {}, root):
                with contextlib.suppress(Exception):  # a stage may not have written it (yet)
                    values.update({k: v for k, v in read_json(path).items() if isinstance(v, (int, float))})
            group = s.name.partition("@")[0]  # evaluate@NAME: the evaluate stage's
            wanted = STAGES[group].headline if group in STAGES else ()
            picked = [k for k in wanted if k in values] or list(values)[:3]
            s.metrics = {k: values[k] for k in picked}
        if s.name in children:
            s.run_id, s.run_url = children[s.name]
