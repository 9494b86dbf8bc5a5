"""The stage commands (`prepare ...`, `synthesize`, `pretrain`, `finetune ...`, `benchmark`,
`evaluate`, `evaluate-report`, `register`, `register-report`) and `gptforge pipeline`.

A stage command runs its recipe at once and journals its records (the Prefect flow run with a
task run per step, the MLflow run), which the folder's recorder delivers
(`gptforge.pipeline.stages.run_recorded`): the process pays for neither Prefect nor MLflow.
`GPTFORGE_PREFECT=0` (or Prefect not being installed, as on a bare GPU box) leaves Prefect out,
`tracking.enabled: false` MLflow. `gptforge pipeline` journals its own flow run the same way
(`gptforge.pipeline.recorded`); `--pool` submits the deployment that a worker runs in Prefect's
engine (`flows.pipeline`).

The only library module that imports `flows` and Prefect.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from typing import Iterator

from gptforge.cli.parsing import Parser, config_args, params_file
from gptforge.errors import GptforgeError
from gptforge.runtime.signals import stop_with_launcher

log = logging.getLogger("gptforge")


def add_commands(sub) -> None:
    """The stage commands and `pipeline`."""
    prepare = sub.add_parser("prepare", help="data-preparation stages")
    prepare_sub = prepare.add_subparsers(dest="what", metavar="DATASET", parser_class=Parser)
    prepare_sub.required = True
    from gptforge.pipeline.stages import STAGES

    for what in ("pretrain", "classify", "instruct", "preference", "base"):
        stage = STAGES[f"prepare_{what}"]
        p = prepare_sub.add_parser(what, help=stage.summary, description=f"DVC stage {stage.name}: {stage.summary}.")
        config_args(p)
        p.set_defaults(func=cmd_stage, stage=stage.name)

    for command, name, dvc_name, more in (
        (
            "synthesize",
            "synthesize",
            "synthesize@NAME",
            "The endpoint's API key, if it needs one: GPTFORGE_SYNTH_API_KEY.",
        ),
        (
            "index",
            "index",
            "index@NAME",
            "Reads data/synthetic/NAME/chunks.jsonl (stage synthesize@NAME); -S synthesize.only=NAME picks one "
            "entry of synthesize.documents (default: all). Reports recall@1/5/10 and MRR of the source chunk over "
            "the synthesized questions.",
        ),
        (
            "evaluate-qa",
            "evaluate_qa",
            "evaluate_qa@NAME",
            "-S synthesize.only=NAME picks one entry of synthesize.documents (default: all).",
        ),
        (
            "pretrain",
            "pretrain",
            "pretrain",
            "With pretrain.nproc_per_node or distributed.nnodes above 1 it launches itself under torchrun (DDP); "
            "under torchrun (e.g. `torchrun --nproc_per_node=2 $(which gptforge) pretrain`) it trains with DDP.",
        ),
    ):
        stage = STAGES[name]
        p = sub.add_parser(command, help=stage.summary, description=f"DVC stage {dvc_name}: {stage.summary}. {more}")
        config_args(p)
        p.set_defaults(func=cmd_stage, stage=name)

    finetune = sub.add_parser("finetune", help="fine-tuning stages")
    finetune_sub = finetune.add_subparsers(dest="what", metavar="TASK", parser_class=Parser)
    finetune_sub.required = True
    for what, name in (
        ("classify", "finetune_classify"),
        ("instruct", "finetune_instruct"),
        ("preference", "finetune_preference"),
        ("reward", "train_reward"),
        ("rl", "finetune_rl"),
    ):
        stage = STAGES[name]
        p = finetune_sub.add_parser(
            what,
            help=stage.summary,
            description=f"DVC stage {stage.name}: {stage.summary}. "
            f"With {what}.nproc_per_node or distributed.nnodes above 1 it launches itself under "
            f"torchrun ({what}.strategy: ddp or fsdp), each process training on its part of "
            "every batch.",
        )
        config_args(p)
        p.set_defaults(func=cmd_stage, stage=stage.name)
    stage = STAGES["finetune_instruct_variant"]
    p = finetune_sub.add_parser(
        "instruct-variant",
        help=stage.summary,
        description=f"DVC stage finetune_instruct_variant@NAME: {stage.summary}. -S "
        "instruct_variants.only=NAME picks one entry of instruct_variants.models (default: all).",
    )
    config_args(p)
    p.set_defaults(func=cmd_stage, stage=stage.name)

    stage = STAGES["benchmark"]
    p = sub.add_parser(
        "benchmark", help=stage.summary, describe=lambda summary=stage.summary: _benchmark_description(summary)
    )
    config_args(p)
    p.set_defaults(func=cmd_stage, stage="benchmark")

    for command, name, dvc_name, more in (
        (
            "evaluate",
            "evaluate",
            "evaluate@NAME",
            "-S evaluate.only=NAME picks one entry of evaluate.models (default: all).",
        ),
        ("evaluate-report", "evaluate_report", "evaluate_report", "Reads what evaluate@NAME wrote; evaluates nothing."),
        (
            "register",
            "register",
            "register@MODEL",
            "-S registry.only=MODEL picks one entry of registry.names (default: all).",
        ),
        (
            "register-report",
            "register_report",
            "register_report",
            "Reads what register@MODEL wrote; registers nothing.",
        ),
    ):
        stage = STAGES[name]
        p = sub.add_parser(command, help=stage.summary, description=f"DVC stage {dvc_name}: {stage.summary}. {more}")
        config_args(p)
        p.set_defaults(func=cmd_stage, stage=name)

    p = sub.add_parser(
        "pipeline",
        help="run every stage that is stale (dvc repro) as one tracked run",
        description="Run `dvc repro` for the named stages (default: all) as one Prefect flow run and "
        "one MLflow run, each stage nested under it. --params and -S are written to params.yaml first "
        "(DVC tracks that file). With a default DVC remote: dvc pull before, dvc push after (a remote "
        "that cannot be reached is a warning). --pool runs it on a worker of that Prefect work pool "
        "through the deployment pipeline/POOL instead of in this process.",
    )
    p.add_argument("stages", nargs="*", metavar="STAGE", help="DVC stages to reproduce, with what they depend on")
    config_args(p)
    p.add_argument("--no-pull", dest="pull", action="store_false", help="do not dvc pull first")
    p.add_argument("--no-push", dest="push", action="store_false", help="do not dvc push after")
    p.add_argument("--force", action="store_true", help="re-run the stages even when up to date (dvc repro --force)")
    p.add_argument("--pool", metavar="POOL", help="run on a worker of this work pool (needs PREFECT_API_URL)")
    p.set_defaults(func=cmd_pipeline)


def _benchmark_description(summary: str) -> str:
    from gptforge.bench.grid import variant_grid  # imports torch: only for `gptforge benchmark --help`

    grid = "; ".join(f"{name}: {change}" for name, change, _ in variant_grid())
    return (
        f"DVC stage benchmark: {summary}. Variants, each adding its change to the fastest kept so far "
        f"(one that slows the step is not kept): {grid}."
    )


def use_prefect() -> bool:
    if os.environ.get("GPTFORGE_PREFECT", "1").lower() in ("0", "false", "no", "off"):
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return False  # a torchrun worker: the launching flow (or shell) owns the Prefect run
    return importlib.util.find_spec("prefect") is not None


def cmd_stage(args) -> int:
    from gptforge.config.load import load_config
    from gptforge.pipeline.stages import check_inputs, run_recorded, run_stage
    from gptforge.runtime import recording

    params = params_file(args)
    cfg = load_config(params, args.set)
    check_inputs(args.stage, cfg)  # cheap checks of local inputs, before any flow starts
    if "WORLD_SIZE" not in os.environ:  # torchrun's workers are stopped by torchrun
        stop_with_launcher()  # `kill` of the `dvc repro` that started this stage stops it too
    prefect = use_prefect()
    if "WORLD_SIZE" in os.environ:  # a torchrun worker: its launcher's journal has the records
        with recording.attached():
            run_stage(args.stage, cfg)
    elif prefect or cfg.tracking.enabled:
        run_recorded(args.stage, cfg, params=params, overrides=list(args.set), prefect=prefect)
    else:
        run_stage(args.stage, cfg)
    return 0


def cmd_pipeline(args) -> int:
    from gptforge.pipeline.run import check_request, run_pipeline
    from gptforge.pipeline.summary import closing_summary
    from gptforge.runtime import locks

    check_request(args.stages, args.params, args.set)  # before any server starts
    options = {"pull": args.pull, "push": args.push, "force": args.force}
    if args.pool:
        from flows.submit import submit_pipeline

        with _prefect_console():
            submit_pipeline(
                args.pool, {"stages": args.stages, "params": args.params, "overrides": list(args.set), **options}
            )
        return 0
    # A second pipeline (or one while a DVC command runs here) is refused now, before Prefect
    # starts; the library takes the same lock again (a no-op in this process).
    with locks.hold("pipeline", "a gptforge pipeline"):
        locks.check_dvc_idle()
        if use_prefect():
            from gptforge.pipeline.recorded import run_pipeline_recorded

            summary = run_pipeline_recorded(args.stages, params=args.params, overrides=list(args.set), **options)
        else:
            report = run_pipeline(args.stages, params=args.params, overrides=args.set, **options)
            report.raise_for_failure()
            summary = closing_summary(report)
    print("\n".join(summary), flush=True)  # after Prefect's own closing lines: what a user reads last
    return 0


class _NoExpectedErrors(logging.Filter):
    """Drops console records about a GptforgeError: the CLI states it once, as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], GptforgeError))


class _NoTraceback(logging.Formatter):
    """Formats a record without its traceback (Prefect logs one for every failed try)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def _quiet_prefect_console(debug: bool) -> None:
    """Keep Prefect's run and task lines on the terminal, but not its tracebacks: expected
    errors end in one line from the CLI, unexpected ones too unless GPTFORGE_DEBUG is set.
    Prefect's API handler is left alone, so the UI keeps the full record."""
    if debug:
        return
    for name in ("prefect", ""):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.addFilter(_NoExpectedErrors())
                handler.setFormatter(_NoTraceback(handler.formatter))


@contextlib.contextmanager
def _prefect_console() -> Iterator[None]:
    """Around a flow call: Prefect's console quieted, and its temporary server (the one it
    starts when no PREFECT_API_URL is set) stopped as soon as the flow ends instead of at
    interpreter exit, so that its "Stopping temporary server" comes before the CLI's error
    line and the error is the last line a user reads."""
    _quiet_prefect_console(debug=bool(os.environ.get("GPTFORGE_DEBUG")))
    from flows.outage import watch_prefect_records
    from flows.stages import temporary_server_in_own_session

    temporary_server_in_own_session()
    watch_prefect_records()
    try:
        yield
    finally:
        _stop_temporary_server()


def _stop_temporary_server(timeout: float = 5.0) -> None:
    """What Prefect does at exit, done now: the log and event workers deliver what they hold
    (they need the server; a few seconds at most), then the server process stops."""
    server_module = sys.modules.get("prefect.server.api.server")
    if server_module is None:
        return  # never loaded: a real server (PREFECT_API_URL) took the calls
    server = server_module.SubprocessASGIServer._instances.get(None)
    if server is None or server.server_process is None:
        return
    if server.running:  # else it never answered: nothing was sent, or can be
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        for worker in (APILogWorker, EventsWorker):
            try:
                worker.drain_all(timeout=timeout)
            except Exception as e:  # undelivered logs or events must not hide the run's own outcome
                log.debug("draining Prefect's %s failed: %s", worker.__name__, e)
    server.stop()
