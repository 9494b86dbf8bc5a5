"""`gptforge serve`: models behind an OpenAI-compatible API with a chat page, or vLLM's server."""

from __future__ import annotations

from gptforge.cli.inference import pick_device
from gptforge.cli.parsing import config_args, params_file
from gptforge.errors import BadInput
from gptforge.modeling.hf_causal import INFERENCE_DTYPES


def add_commands(sub) -> None:
    """`serve`."""
    s = sub.add_parser(
        "serve",
        help="serve models behind an OpenAI-compatible API with a chat page",
        description="Serve language models (OpenAI's /v1/completions and /v1/chat/completions, "
        "streamed or not, with continuous batching) and spam classifiers (/v1/classify), with "
        "/v1/models, /health, /metrics and a chat page at /. MODEL is [NAME=]SPEC, SPEC a registry "
        "URI (models:/gptforge-instruct@champion), a gptforge checkpoint, a Hugging Face causal-LM "
        "folder or a classifier folder; none: the pipeline's instruct model and classifier "
        "(docs/serving.md).",
    )
    s.add_argument("models", nargs="*", metavar="MODEL")
    s.add_argument("--host", default="127.0.0.1", help="(default: %(default)s: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    s.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/* (default: $GPTFORGE_API_KEY, else none)",
    )
    s.add_argument(
        "--engine",
        choices=("gptforge", "vllm"),
        default="gptforge",
        help="gptforge: this server; vllm: vLLM's OpenAI server for one Hugging Face model "
        "(GPU workers) (default: %(default)s)",
    )
    s.add_argument(
        "--max-batch",
        type=int,
        default=16,
        metavar="N",
        help="requests decoded together per model (default: %(default)s)",
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests waiting per model before 429 (default: %(default)s)",
    )
    s.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens prefilled per engine step, beside the running streams' decode (default: 256)",
    )
    s.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=256.0,
        metavar="MB",
        help="memory for reused prompt prefixes per model, least recently used out; 0: off (default: %(default)s)",
    )
    s.add_argument(
        "--engine-process",
        choices=("on", "off"),
        default="on",
        help="on: each model's engine in a process of its own; off: in a thread of the API "
        "process (default: %(default)s)",
    )
    s.add_argument("--device", default="auto", help="auto | cpu | cuda (default: %(default)s)")
    s.add_argument(
        "--dtype",
        choices=INFERENCE_DTYPES,
        default="auto",
        help="weights: auto = Hugging Face models in bfloat16 on CUDA and float32 on the CPU, gptforge "
        "checkpoints in their own dtype; bfloat16 on a CPU with native bf16 (AVX-512 BF16, AMX) decodes "
        "faster (default: %(default)s)",
    )
    s.add_argument(
        "--quantize",
        choices=("none", "int8", "int4"),
        default="none",
        help="int8 / int4: weight-only int8 / groupwise int4 linears (an int8 head) in the decode step of "
        "gptforge checkpoints and Hugging Face Llama-family models (int4 on the CPU only; prefill runs over "
        "the same rounded weights); with "
        "--dtype auto the activations are bfloat16 on CUDA and on CPUs with native bf16 (default: %(default)s)",
    )
    s.add_argument(
        "--speculate",
        type=int,
        default=0,
        metavar="K",
        help="a lone greedy request drafts up to K tokens by prompt lookup in its prompt and answer and "
        "verifies them in one forward (Llama-family models; pays where answers quote their context, as "
        "RAG answers do); 0: off (default: %(default)s)",
    )
    s.add_argument(
        "--rag",
        default=None,
        metavar="INDEX",
        help="retrieval-augmented chat: put the top chunks of this index (data/index/NAME, from "
        "`gptforge index`) in front of the question of every chat request to the language models "
        "(`rag: false` in a request turns it off); answers carry a `sources` list (default: off)",
    )
    s.add_argument(
        "--rag-top-k",
        type=int,
        default=None,
        metavar="K",
        help="chunks retrieved per question (default: index.top_k, 4)",
    )
    config_args(s)
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import os

    from gptforge.config.load import load_config
    from gptforge.serve.sources import resolve_all

    if not 0 < args.port < 65536:
        raise BadInput(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch < 1 or args.max_queue < 1:
        raise BadInput(f"--max-batch and --max-queue must be >= 1, got {args.max_batch} and {args.max_queue}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise BadInput(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if args.speculate < 0:
        raise BadInput(f"--speculate must be >= 0 (0 = off), got {args.speculate}")
    if args.prefix_cache_mb < 0:
        raise BadInput(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    api_key = args.api_key if args.api_key is not None else (os.environ.get("GPTFORGE_API_KEY") or None)
    if args.rag_top_k is not None and args.rag is None:
        raise BadInput("--rag-top-k needs --rag INDEX")
    if args.rag is not None and args.engine == "vllm":
        raise BadInput("--rag works with --engine gptforge only (vLLM's server does its own prompts)")
    cfg = load_config(params_file(args), args.set)
    retrieval = None
    if args.rag is not None:  # read once, before any model is fetched or loaded
        from gptforge.serve.rag import load_retrieval

        retrieval = load_retrieval(args.rag, args.rag_top_k if args.rag_top_k is not None else cfg.index.top_k)
    if args.engine == "vllm":
        from gptforge.serve.sources import DEFAULT_SPECS, default_specs
        from gptforge.serve.vllm import run_vllm, vllm_python

        vllm_python()  # a missing vLLM is said before any model is fetched
        # vLLM serves one language model: with no MODEL, the pipeline's first one alone.
        sources = resolve_all(
            args.models or (default_specs(cfg, language_models_only=True) or [DEFAULT_SPECS[0]])[:1], cfg
        )
        return run_vllm(sources, host=args.host, port=args.port, api_key=api_key, cfg=cfg)
    from gptforge.serve import listen, run_server
    from gptforge.serve.loading import load_served

    sock = listen(args.host, args.port)
    sources = resolve_all(args.models, cfg)
    if retrieval is not None and all(src.kind == "classifier" for src in sources):
        raise BadInput("--rag: no language model to serve (classifiers have no chat)")
    device = pick_device(args.device)
    models = []
    try:
        for src in sources:
            models.append(
                load_served(
                    src,
                    cfg,
                    max_batch=args.max_batch,
                    max_queue=args.max_queue,
                    device=device,
                    prefill_chunk=args.prefill_chunk,
                    prefix_cache_mb=args.prefix_cache_mb,
                    engine_process=args.engine_process == "on",
                    dtype=args.dtype,
                    quantize=None if args.quantize == "none" else args.quantize,
                    speculate=args.speculate,
                )
            )
    except BaseException:
        for m in models:  # the engine processes of the models loaded before the failure
            if getattr(m, "engine", None) is not None:
                m.engine.core.kill()
        raise
    if retrieval is not None:
        from gptforge.serve.rag import attach

        attach(models, retrieval)
    return run_server(models, sock=sock, host=args.host, port=args.port, api_key=api_key)
