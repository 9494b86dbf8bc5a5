"""`gptforge`: the command line. Every stage command runs its Prefect flow.

Exit codes: 0 success, 2 bad input (params, files, arguments), 1 failure of the run itself.
Errors are one line on stderr, the last line the command prints; `GPTFORGE_DEBUG=1` adds the
traceback. `GPTFORGE_PREFECT=0` (or Prefect not being installed, as on a bare GPU box) runs the
recipe without Prefect.

Each stage is its own process (dvc starts it), so start-up counts: this module imports only
what parsing arguments needs, and each command imports what it uses when it runs. `--help`
loads no torch, Prefect, MLflow or pydantic; the data stages never load torch.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import importlib.util
import logging
import os
import signal
import sys
import traceback
from typing import Callable, Iterator, Sequence

import gptforge
from gptforge.allocator import keep_freed_memory
from gptforge.signals import exit_within, stop_cause, stop_signal, stop_with_launcher, terminate_as_interrupt
from gptforge.errors import BadInput, GptforgeError

log = logging.getLogger("gptforge")

# Stage -> the module of its Prefect flow (the flow object has the stage's name).
FLOW_MODULES = {
    "prepare_pretrain": "flows.prepare",
    "prepare_classify": "flows.prepare",
    "prepare_instruct": "flows.prepare",
    "prepare_preference": "flows.prepare",
    "prepare_base": "flows.prepare",
    "synthesize": "flows.synthesize",
    "pretrain": "flows.pretrain",
    "finetune_classify": "flows.finetune",
    "finetune_instruct": "flows.finetune",
    "finetune_preference": "flows.finetune",
    "benchmark": "flows.benchmark",
    "evaluate": "flows.evaluate",
    "register": "flows.register",
}


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2 through BadInput.

    `describe`: a function that returns the description, called only when the help is shown
    (the benchmark's grid lives in a module that imports torch)."""

    def __init__(self, *args, describe: Callable[[], str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.describe = describe

    def format_help(self) -> str:
        if self.describe is not None:
            self.description, self.describe = self.describe(), None
        return super().format_help()

    def error(self, message: str):
        raise BadInput(f"{self.prog}: {message} (see --help)")


# gptforge.config.DEFAULT_PARAMS, spelled out so that --help does not load the config module
# (pydantic); tests/test_startup.py checks that the two agree.
DEFAULT_PARAMS_HELP = "params.yaml"


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default=None, metavar="FILE",
                   help=f"params file (default: {DEFAULT_PARAMS_HELP} if present, else the built-in defaults)")
    p.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a param with DVC's dotted keys, value parsed as YAML; repeatable")


def build_parser() -> Parser:
    parser = Parser(prog="gptforge", description="GPT-2 from raw text to an evaluated, registered model.")
    parser.add_argument("--version", action="version", version=f"gptforge {gptforge.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    config = sub.add_parser("config", help="inspect the resolved configuration")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", parser_class=Parser)
    config_sub.required = True
    show = config_sub.add_parser("show", help="print the resolved config (params file + overrides) as YAML")
    _config_args(show)
    show.set_defaults(func=cmd_config_show)

    prepare = sub.add_parser("prepare", help="data-preparation stages")
    prepare_sub = prepare.add_subparsers(dest="what", metavar="DATASET", parser_class=Parser)
    prepare_sub.required = True
    from gptforge.stages import STAGES

    for what in ("pretrain", "classify", "instruct", "preference", "base"):
        stage = STAGES[f"prepare_{what}"]
        p = prepare_sub.add_parser(what, help=stage.summary, description=f"DVC stage {stage.name}: {stage.summary}.")
        _config_args(p)
        p.set_defaults(func=cmd_stage, stage=stage.name)

    stage = STAGES["synthesize"]
    p = sub.add_parser("synthesize", help=stage.summary, description=f"DVC stage synthesize@NAME: {stage.summary}. "
                       "The endpoint's API key, if it needs one: GPTFORGE_SYNTH_API_KEY.")
    _config_args(p)
    p.set_defaults(func=cmd_stage, stage="synthesize")

    stage = STAGES["pretrain"]
    p = sub.add_parser("pretrain", help=stage.summary, description=f"DVC stage pretrain: {stage.summary}. "
                       "With pretrain.nproc_per_node or pretrain.nnodes above 1 it launches itself under torchrun "
                       "(DDP); under torchrun (e.g. `torchrun --nproc_per_node=2 $(which gptforge) pretrain`) it "
                       "trains with DDP.")
    _config_args(p)
    p.set_defaults(func=cmd_stage, stage="pretrain")

    finetune = sub.add_parser("finetune", help="fine-tuning stages")
    finetune_sub = finetune.add_subparsers(dest="what", metavar="TASK", parser_class=Parser)
    finetune_sub.required = True
    for what in ("classify", "instruct", "preference"):
        stage = STAGES[f"finetune_{what}"]
        p = finetune_sub.add_parser(what, help=stage.summary, description=f"DVC stage {stage.name}: {stage.summary}.")
        _config_args(p)
        p.set_defaults(func=cmd_stage, stage=stage.name)

    stage = STAGES["benchmark"]
    p = sub.add_parser("benchmark", help=stage.summary,
                       describe=lambda summary=stage.summary: _benchmark_description(summary))
    _config_args(p)
    p.set_defaults(func=cmd_stage, stage="benchmark")

    stage = STAGES["evaluate"]
    p = sub.add_parser("evaluate", help=stage.summary, description=f"DVC stage evaluate: {stage.summary}.")
    _config_args(p)
    p.set_defaults(func=cmd_stage, stage="evaluate")

    stage = STAGES["register"]
    p = sub.add_parser("register", help=stage.summary, description=f"DVC stage register: {stage.summary}.")
    _config_args(p)
    p.set_defaults(func=cmd_stage, stage="register")

    p = sub.add_parser("pipeline", help="run every stage that is stale (dvc repro) as one tracked run",
                       description="Run `dvc repro` for the named stages (default: all) as one Prefect flow run and "
                       "one MLflow run, each stage nested under it. --params and -S are written to params.yaml first "
                       "(DVC tracks that file). With a default DVC remote: dvc pull before, dvc push after (a remote "
                       "that cannot be reached is a warning). --pool runs it on a worker of that Prefect work pool "
                       "through the deployment pipeline/POOL instead of in this process.")
    p.add_argument("stages", nargs="*", metavar="STAGE", help="DVC stages to reproduce, with what they depend on")
    _config_args(p)
    p.add_argument("--no-pull", dest="pull", action="store_false", help="do not dvc pull first")
    p.add_argument("--no-push", dest="push", action="store_false", help="do not dvc push after")
    p.add_argument("--force", action="store_true", help="re-run the stages even when up to date (dvc repro --force)")
    p.add_argument("--pool", metavar="POOL", help="run on a worker of this work pool (needs PREFECT_API_URL)")
    p.set_defaults(func=cmd_pipeline)

    c = sub.add_parser("classify", help="label texts with the fine-tuned classifier",
                       description="Print the label and its probability for TEXT, or for every line of stdin "
                       "when TEXT is omitted or '-'.")
    c.add_argument("text", nargs="?", default="-")
    c.add_argument("--checkpoint", default="checkpoints/classify/final", metavar="DIR",
                   help="a classifier folder (default: %(default)s)")
    c.add_argument("--device", default="auto", help="auto | cpu | cuda (default: %(default)s)")
    _config_args(c)
    c.set_defaults(func=cmd_classify)

    g = sub.add_parser("generate", help="continue a prompt with a trained model (KV-cached sampling)",
                       description="Print the continuation of PROMPT on stdout and the generation's tokens/s "
                       "(model loading excluded) on stderr. DIR is a gptforge checkpoint, a Hugging Face "
                       "GPT-2 folder, or any Hugging Face causal-LM folder (Llama, Qwen2, ...: generated by "
                       "transformers, with the folder's own tokenizer).")
    g.add_argument("prompt")
    g.add_argument("--checkpoint", default="checkpoints/pretrain/final", metavar="DIR",
                   help="a model folder (default: %(default)s)")
    g.add_argument("--chat", action="store_true",
                   help="send PROMPT as one user message through the tokenizer's chat template and print the "
                   "answer (Hugging Face causal-LM folders whose tokenizer has a chat template)")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    g.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=200, metavar="K", help="0 = no top-k cut (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None, metavar="S")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda (default: %(default)s)")
    _config_args(g)
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("export", help="export a checkpoint as a Hugging Face folder (model + tokenizer)",
                       description="Write a folder that transformers' AutoModelForCausalLM and AutoTokenizer load.")
    e.add_argument("--checkpoint", required=True, metavar="DIR")
    e.add_argument("--out", required=True, metavar="DIR")
    _config_args(e)
    e.set_defaults(func=cmd_export)

    s = sub.add_parser("serve", help="serve models behind an OpenAI-compatible API with a chat page",
                       description="Serve language models (OpenAI's /v1/completions and /v1/chat/completions, "
                       "streamed or not, with continuous batching) and spam classifiers (/v1/classify), with "
                       "/v1/models, /health, /metrics and a chat page at /. MODEL is [NAME=]SPEC, SPEC a registry "
                       "URI (models:/gptforge-instruct@champion), a gptforge checkpoint, a Hugging Face causal-LM "
                       "folder or a classifier folder; none: the pipeline's instruct model and classifier "
                       "(docs/serving.md).")
    s.add_argument("models", nargs="*", metavar="MODEL")
    s.add_argument("--host", default="127.0.0.1", help="(default: %(default)s: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $GPTFORGE_API_KEY, else none)")
    s.add_argument("--engine", choices=("gptforge", "vllm"), default="gptforge",
                   help="gptforge: this server; vllm: vLLM's OpenAI server for one Hugging Face model "
                   "(GPU workers) (default: %(default)s)")
    s.add_argument("--max-batch", type=int, default=16, metavar="N",
                   help="requests decoded together per model (default: %(default)s)")
    s.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting per model before 429 (default: %(default)s)")
    s.add_argument("--device", default="auto", help="auto | cpu | cuda (default: %(default)s)")
    _config_args(s)
    s.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="the registered models: list their versions, promote one",
                            description="The MLflow Model Registry at MLFLOW_TRACKING_URI (default: "
                            "sqlite:///mlflow.db), as the register stage fills it (docs/registry.md).")
    models_sub = models.add_subparsers(dest="models_command", metavar="ACTION", parser_class=Parser)
    models_sub.required = True
    m = models_sub.add_parser("list", help="every version of every registered model, newest first",
                              description="One row per version: aliases, creation time, the promotion gate's "
                              "verdict and the key metrics.")
    m.add_argument("--name", metavar="NAME", help="only this model (registered name, or a key of registry.names)")
    _config_args(m)
    m.set_defaults(func=cmd_models_list)
    m = models_sub.add_parser("promote", help="give a model version an alias (default: champion)",
                              description="Move ALIAS to VERSION of NAME and say which version held it before.")
    m.add_argument("name", metavar="NAME", help="registered name, or a key of registry.names (classify)")
    m.add_argument("version", metavar="VERSION")
    m.add_argument("--alias", default="champion", help="(default: %(default)s)")
    _config_args(m)
    m.set_defaults(func=cmd_models_promote)
    return parser


def _benchmark_description(summary: str) -> str:
    from gptforge.bench import variant_grid  # imports torch: only for `gptforge benchmark --help`

    grid = "; ".join(f"{name}: {change}" for name, change, _ in variant_grid())
    return f"DVC stage benchmark: {summary}. Variants, each adding its change to the fastest kept so far (one that slows the step is not kept): {grid}."


def cmd_generate(args) -> int:
    import time

    import torch

    from gptforge.decoding import generate
    from gptforge.tokenizer import load_tokenizer
    from gptforge.weights import load_model

    if args.max_new_tokens <= 0:
        raise BadInput(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise BadInput(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise BadInput(f"--top-k must be >= 0 (0 = no cut), got {args.top_k}")
    from gptforge.hf_causal import hf_source

    if hf_source(args.checkpoint) is not None:
        return _generate_hf(args)
    if args.chat:
        raise BadInput(f"--chat needs a Hugging Face causal-LM folder whose tokenizer has a chat template; "
                       f"{args.checkpoint} is a gptforge checkpoint (leave out --chat to continue PROMPT as text)")
    from gptforge.config import load_config

    cfg = load_config(params_file(args), args.set)
    enc = load_tokenizer(cfg.tokenizer.path)
    device = _device(args.device)
    model = load_model(args.checkpoint, map_location=device)
    if model.config.n_vocab != enc.n_vocab:
        raise BadInput(f"{args.checkpoint} has a vocabulary of {model.config.n_vocab}, the tokenizer "
                       f"{enc.n_vocab}: set tokenizer.path to the tokenizer it was trained with")
    ids = enc.encode_ordinary(args.prompt) or [enc.eot_token]
    idx = torch.tensor([ids], device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed) if args.seed is not None else gen.seed()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(model, idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                   eot_id=enc.eot_token, generator=gen)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    text = enc.decode([t for t in new if t != enc.eot_token])
    sys.stdout.write(text + "\n")
    print(f"gptforge: {len(new)} tokens in {seconds:.3f} s ({len(new) / seconds:.1f} tokens/s, {device})",
          file=sys.stderr)
    return 0


def _generate_hf(args) -> int:
    """`gptforge generate` for a Hugging Face causal-LM folder: its tokenizer, transformers' generate."""
    import time

    import torch

    from gptforge.decoding import generate_hf
    from gptforge.hf_causal import load_causal_lm

    model, tok = load_causal_lm(args.checkpoint, param="--checkpoint")
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise BadInput(f"--chat: the tokenizer in {args.checkpoint} has no chat template (chat_template.jinja "
                           "or tokenizer_config.json's chat_template); leave out --chat to continue PROMPT as text")
        enc = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(enc if isinstance(enc, list) else enc["input_ids"])  # transformers 5: a BatchEncoding
    else:
        ids = tok(args.prompt)["input_ids"]
    ids = ids or [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]
    device = _device(args.device)
    model.to(device)
    idx = torch.tensor([ids], device=device)
    if args.seed is None:
        torch.seed()  # transformers samples with the global generator: a fresh seed, as gen.seed() above
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate_hf(model, tok, idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                      seed=args.seed)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    sys.stdout.write(tok.decode(new, skip_special_tokens=True) + "\n")
    print(f"gptforge: {len(new)} tokens in {seconds:.3f} s ({len(new) / seconds:.1f} tokens/s, {device})",
          file=sys.stderr)
    return 0


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cmd_classify(args) -> int:
    from gptforge.config import load_config
    from gptforge.finetune.classify import classify_texts, load_classifier
    from gptforge.tokenizer import load_tokenizer

    cfg = load_config(params_file(args), args.set)
    texts = [line.rstrip("\n") for line in sys.stdin] if args.text == "-" else [args.text]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise BadInput("no text to classify (give TEXT or lines on stdin)")
    device = _device(args.device)
    classifier = load_classifier(args.checkpoint, map_location=device)
    labels = classifier.labels
    for text, (label, prob) in zip(texts, classify_texts(classifier, texts, load_tokenizer(cfg.tokenizer.path),
                                                         device)):
        print(f"{labels[label]}\t{prob:.4f}" + (f"\t{text}" if len(texts) > 1 else ""))
    return 0


def cmd_export(args) -> int:
    from gptforge.config import load_config
    from gptforge.export import export_hf

    cfg = load_config(params_file(args), args.set)
    out = export_hf(args.checkpoint, args.out, cfg.tokenizer.path)
    print(f"gptforge: exported {args.checkpoint} to {out}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    import os

    from gptforge.config import load_config
    from gptforge.serve.sources import resolve_all

    if not 0 < args.port < 65536:
        raise BadInput(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch < 1 or args.max_queue < 1:
        raise BadInput(f"--max-batch and --max-queue must be >= 1, got {args.max_batch} and {args.max_queue}")
    api_key = args.api_key if args.api_key is not None else (os.environ.get("GPTFORGE_API_KEY") or None)
    cfg = load_config(params_file(args), args.set)
    if args.engine == "vllm":
        from gptforge.serve.sources import DEFAULT_SPECS
        from gptforge.serve.vllm import run_vllm, vllm_python

        vllm_python()  # a missing vLLM is said before any model is fetched
        # vLLM serves one language model: with no MODEL, the pipeline's instruct model alone.
        sources = resolve_all(args.models or [DEFAULT_SPECS[0]], cfg)
        return run_vllm(sources, host=args.host, port=args.port, api_key=api_key, cfg=cfg)
    from gptforge.serve import listen, run_server
    from gptforge.serve.loading import load_served

    sock = listen(args.host, args.port)
    sources = resolve_all(args.models, cfg)
    device = _device(args.device)
    models = [load_served(src, cfg, max_batch=args.max_batch, max_queue=args.max_queue, device=device)
              for src in sources]
    return run_server(models, sock=sock, host=args.host, port=args.port, api_key=api_key)


def cmd_models_list(args) -> int:
    from gptforge.config import load_config
    from gptforge.register.models import format_table, list_models, no_models_line

    cfg = load_config(params_file(args), args.set)
    rows = list_models(cfg, args.name)
    print(format_table(rows) if rows else no_models_line(args.name and cfg.registry.names.get(args.name, args.name)))
    return 0


def cmd_models_promote(args) -> int:
    from gptforge.config import load_config
    from gptforge.register.models import promote

    print(promote(load_config(params_file(args), args.set), args.name, args.version, args.alias))
    return 0


def params_file(args) -> str | None:
    """An explicit --params must exist; without one, ./params.yaml is used when present."""
    from gptforge.config import DEFAULT_PARAMS

    if args.params is not None:
        return args.params
    return DEFAULT_PARAMS if os.path.exists(DEFAULT_PARAMS) else None


def cmd_config_show(args) -> int:
    from gptforge.config import dump_yaml, load_config

    cfg = load_config(params_file(args), args.set)
    sys.stdout.write(dump_yaml(cfg))
    return 0


def use_prefect() -> bool:
    if os.environ.get("GPTFORGE_PREFECT", "1").lower() in ("0", "false", "no", "off"):
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return False  # a torchrun worker: the launching flow (or shell) owns the Prefect run
    return importlib.util.find_spec("prefect") is not None


def cmd_stage(args) -> int:
    from gptforge.config import load_config
    from gptforge.stages import check_inputs, run_stage

    params = params_file(args)
    cfg = load_config(params, args.set)
    check_inputs(args.stage, cfg)  # cheap checks of local inputs, before any flow starts
    if "WORLD_SIZE" not in os.environ:  # torchrun's workers are stopped by torchrun
        stop_with_launcher()  # `kill` of the `dvc repro` that started this stage stops it too
    if use_prefect():
        from flows import run_stage_flow
        from flows.outage import say_unrecorded

        flow = getattr(importlib.import_module(FLOW_MODULES[args.stage]), args.stage)
        with _prefect_console():
            run_stage_flow(flow, {"params": params, "overrides": list(args.set)})
            say_unrecorded(os.environ.get("PREFECT_API_URL"), flow.gptforge_finished.flow_run_id)
    else:
        log.info("running %s without Prefect", args.stage)
        run_stage(args.stage, cfg)
    return 0


def cmd_pipeline(args) -> int:
    from gptforge import locks
    from gptforge.pipeline import check_request, closing_summary, run_pipeline

    check_request(args.stages, args.params, args.set)  # before any server starts
    options = {"pull": args.pull, "push": args.push, "force": args.force}
    if args.pool:
        from flows.submit import submit_pipeline

        with _prefect_console():
            submit_pipeline(args.pool, {"stages": args.stages, "params": args.params, "overrides": list(args.set),
                                        **options})
        return 0
    # A second pipeline (or one while a DVC command runs here) is refused now, before Prefect
    # starts; the library takes the same lock again (a no-op in this process).
    with locks.hold("pipeline", "a gptforge pipeline"):
        locks.check_dvc_idle()
        if use_prefect():
            from flows.outage import run_recorded, say_unrecorded
            from flows.pipeline import FINISHED, pipeline

            with _prefect_console():
                result = run_recorded(lambda: pipeline(stages=args.stages, params=args.params,
                                                       overrides=list(args.set), **options),
                                      FINISHED, "flow run pipeline")
                say_unrecorded(os.environ.get("PREFECT_API_URL"), FINISHED.flow_run_id)
            summary = result["summary"]
        else:
            report = run_pipeline(args.stages, params=args.params, overrides=args.set, **options)
            report.raise_for_failure()
            summary = closing_summary(report)
    print("\n".join(summary), flush=True)  # after Prefect's own closing lines: what a user reads last
    return 0


def _setup_logging() -> None:
    # Prefect forwards these loggers to the flow run's logs in its UI.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "gptforge")
    # Telemetry cannot reach its host offline and was seen to cause "database is locked".
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # Prefect's temporary server gets 20 s to answer; its first start in a fresh PREFECT_HOME
    # (database migrations) on a busy machine was seen to take longer and fail the stage.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    # Our closing lines come after the flow run: not for its log in the UI (a warning each, else).
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    for old in [h for h in log.handlers if getattr(h, "gptforge_cli", False)]:
        log.removeHandler(old)  # main() may run more than once in a process (tests, notebooks)
    handler = logging.StreamHandler(sys.stderr)
    handler.gptforge_cli = True
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s gptforge: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(os.environ.get("GPTFORGE_LOG_LEVEL", "INFO").upper())
    log.propagate = False


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
    from flows import temporary_server_in_own_session
    from flows.outage import watch_prefect_records

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


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _skip_exit_gc() -> None:
    """Let the process end without the interpreter's last garbage collections: with torch,
    MLflow and Prefect loaded they walk millions of objects for 1-4 s after the work is done
    (measured: 4.0 s -> 0.35 s). Registered first, so it runs after every other exit handler
    (Prefect's server stop, MLflow's flushes, logging's shutdown); objects are still freed by
    reference counting, only the cycle search over the heap is skipped."""
    atexit.unregister(gc.freeze)  # main() may run more than once in a process
    atexit.register(gc.freeze)


def _silence_module_teardown() -> None:
    """Keep the last line printed the command's own: once every exit handler has run, stderr
    goes to /dev/null for the interpreter's module teardown, where Triton's bindings (imported
    by torch's optimizers) print a 70-line nanobind "leaked instances" report on every exit.
    Registered first (by `main`), so it runs after every other exit handler."""
    if "triton._C.libtriton" not in sys.modules:
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def entry() -> None:
    """The `gptforge` command: `main`, then an exit that takes a bounded time.

    What is left to send at exit (Prefect's events and logs, MLflow's queued metrics) is sent
    by threads and exit handlers that wait for a server: one that went away (a stopped
    temporary Prefect server, a tracking server down) was seen to hold a stopped stage for over
    4 minutes in retries, and the pipeline waiting on it. GPTFORGE_EXIT_GRACE_SECONDS (5) bound it."""
    code = main()
    seconds = float(os.environ.get("GPTFORGE_EXIT_GRACE_SECONDS", "5"))
    exit_within(seconds, code, f"gptforge: exiting {seconds:g} s after the command ended: what was left to send to "
                               "the Prefect API or the MLflow tracking server is dropped")
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    atexit.unregister(_silence_module_teardown)  # main() may run more than once in a process
    atexit.register(_silence_module_teardown)
    _skip_exit_gc()
    keep_freed_memory()  # CPU steps reuse their freed buffers instead of page-faulting them back
    terminate_as_interrupt()  # SIGTERM stops like Ctrl-C: MLflow runs end KILLED, exit 143
    _setup_logging()
    debug = bool(os.environ.get("GPTFORGE_DEBUG"))
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except GptforgeError as e:
        if debug:
            traceback.print_exc()
        print(f"gptforge: error: {_one_line(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        # Stopped: a loop that saved its state on SIGINT/SIGTERM says where; else plain Ctrl-C.
        print(f"gptforge: {_one_line(e) or 'interrupted'}", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)
    except Exception as e:  # an unexpected failure: still one line unless debugging
        stop = stop_cause(e)
        if stop is not None:  # stopped, and a library's cleanup raised on the way out
            signum = stop_signal(stop)
            print(f"gptforge: stopped by {signal.Signals(signum).name} ({type(e).__name__} on the way out: "
                  f"{_one_line(e)})", file=sys.stderr)
            return 128 + signum
        if debug:
            traceback.print_exc()
        print(f"gptforge: error: {type(e).__name__}: {_one_line(e)} (GPTFORGE_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1
    except BaseException as e:
        signum = stop_signal(e)
        if signum is None:
            raise
        # Prefect's SIGTERM bridge inside a flow run (TerminationSignal): the run was stopped.
        print(f"gptforge: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    entry()
