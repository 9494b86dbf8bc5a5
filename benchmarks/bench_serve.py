"""Concurrent clients against `gptforge serve`, in measures that run alone or together
(`--measures`, default all): streaming clients at 1, 4 and 16 next to direct batched `generate`
on the same weights (the ceiling), what a user sees next to `gptforge generate`, the same load
against `transformers serve --continuous-batching`, a shared-prefix load, and a long prompt
arriving while streams decode.

    python benchmarks/bench_serve.py [--measures ceiling,levels,user,hf,prefix,long]
        [--clients 1,4,16] [--requests 8] [--max-tokens 128] [--rounds 3] [--prefill-chunk N]
        [--out docs/results/serve_tiny_cpu.json]

Models, all random weights from `--seed`, with the project's GPT-2 tokenizer (params.yaml's
`tokenizer.path`):
- `tiny`: bench_generate's tiny GPT (4 layers x 4 heads x 128, block 256), a gptforge checkpoint
  (ceiling, levels, user);
- `tiny-2048`: the same width with block 2048 (prefix, long);
- `llama`: a Hugging Face Llama folder of a comparable cost (hidden 128, 4 layers, 4 heads with
  2 key/value heads (GQA), MLP 352, tied embeddings, GPT-2's vocabulary, 2048 positions;
  `LlamaForCausalLM(config).save_pretrained` and the GPT-2 tokenizer saved into the folder; its
  generation_config.json samples (do_sample, top_k 50), so that transformers serve samples at
  the requested temperature) (hf, prefix, long).
Each server runs alone (`gptforge serve NAME=PATH --max-batch 16 [--prefill-chunk N]` or
`transformers serve FOLDER --continuous-batching`, in a subprocess, stopped before the next
starts); measures on the same model and flags share one server. The order: ceiling (no
server); `tiny` (levels, user); `tiny-2048` (prefix with the cache, long), `tiny-2048
--prefix-cache-mb 0` (prefix without); gptforge on `llama` (hf, prefix with the cache, long),
transformers on `llama` (hf), gptforge on `llama --prefix-cache-mb 0` (prefix without).

Measures (`--measures`; each warms its server up first, one request alone then many at once):
- `ceiling`: before any server starts, bench_generate's warm greedy measurement
  (`timed_interleaved` over `generate(model, prompt, N, temperature=0)`, the prompt repeated to
  the batch size) at batch 1 and at each level's batch size: the direct tokens/s a server on the
  same weights can at best reach; and the server's model step alone (its backend, no HTTP).
- `levels`: `--clients` clients at once, each sending `--requests` requests in turn over one
  keep-alive connection: `POST /v1/completions`, `stream: true`, `stream_options.include_usage`,
  temperature 0, the fixed `--prompt`, `max_tokens` = `--max-tokens`; the levels take turns for
  `--rounds` rounds (1, 4, 16, 1, 4, 16, ...), so a slow spell of this shared machine hits them
  alike. Per level: aggregate tokens/s (the completion tokens of the usage chunks over the
  level's wall time, median over rounds), time to first token (TTFT: request sent -> first event
  with text, p50/p95), inter-token latency (ITL: gaps between a request's text events, p50/p95;
  `tokens_per_event` says how many tokens an event carried), errors (a status other than 200, an
  `error` event, no `[DONE]`, a failed connection), the CPU seconds of the server's threads
  (those of the processes it started, an engine process, included) and of this client. The
  greedy text through the server is checked against direct `generate`'s.
- `user`: on the `tiny` checkpoint, `gptforge generate PROMPT --temperature 0 --max-new-tokens
  N` as a subprocess (the tokens/s it prints: model loading excluded, prefill included), then
  one greedy streamed request of N tokens (its tokens / send-to-end-of-stream time), then 16
  sampled streams at once (temperature 0.8, each its own seed; their usage tokens over the wall
  time), `--user-rounds` times in turn (medians).
- `hf`: the `llama` folder behind `gptforge serve`, then behind `transformers serve
  --continuous-batching` (model named by the folder's path, the server pinned to it), the same
  load: the levels of `--clients`, `--hf-requests` requests per client, `--hf-rounds` rounds,
  temperature 0.8 and a `seed` per request (the same seeds on both), top_k 50 on both
  (transformers' default, sent to gptforge), both non-streamed `/v1/completions` (tokens: the
  answer's `usage.completion_tokens`) and streamed (the usage chunk; transformers ends its
  streams without `[DONE]`, which is not counted against it). A server that cannot start or
  answer is reported (the last line of its log), and the other measures go on.
- `prefix`: 16 clients (the top level of `--clients`), `--prefix-requests` requests each, every
  prompt the same `--prefix-tokens`-token system prompt (exactly, in GPT-2's BPE) + a short
  distinct question, greedy, `--prefix-max-tokens` tokens, streamed; once with the server's
  prefix cache (the default) and once with `--prefix-cache-mb 0`, on `tiny-2048` and `llama`
  (`--context-models`). Per run: p50/p95 TTFT, and the cache's hit rate over the load from
  /metrics (`gptforge_prefix_cache_hit_tokens_total` / `..._query_tokens_total`, where the
  server has them); the greedy answers of both runs are compared question by question.
- `long`: `--long-streams` greedy streams of `--long-decode-tokens` tokens; once each has had
  `--long-before` events, a `--long-prompt-tokens`-token prompt (distinct per round) is sent.
  The streams' inter-token gaps are split by its prefill window (sent -> its first text):
  `before` (all streams started, ending before it was sent), `during` (overlapping the window),
  `after`; p95 of each, pooled over `--long-rounds` rounds; on `tiny-2048` and `llama`.
  `--prefill-chunk N` is passed to every gptforge server (prompt tokens prefilled per engine
  step, interleaved with decode steps; default: the server's own).

Targets. Issue 18 (levels): aggregate at 16 clients >= 6x that of 1 client; 1 client >= 0.5x
direct batch-1 greedy; p95 TTFT < 1 s; no errors. Issue 30: levels at 16 clients >= 0.85x direct
batch-16 `generate` and at 1 client >= 0.85x direct batch 1 (levels + ceiling); one greedy
stream >= 0.85x the tokens/s `gptforge generate` prints, and 16 sampled streams together
>= 1.0x it (user); gptforge serve / transformers serve aggregate tokens/s >= 1.5 at 16 clients
and >= 1.0 at 1 client (hf, non-streamed and streamed each); p50 TTFT without the prefix cache
/ with it >= 4, the greedy answers the same (prefix); ITL p95 during the long prefill / before
it <= 3 (long). The bench reports the figures and whether each target holds.

The client is a few lines of asyncio streams (benchmarks/serve_loads.py), not httpx or aiohttp:
on 2 cores the client takes CPU from the server, so it does the least it can while timing
(read the body, split the events, note the arrival times) and parses the JSON afterwards.

`--out FILE.json` also writes FILE.md (tables) and FILE.png (tokens/s and TTFT against clients
for gptforge serve with the direct `generate` ceiling, the Llama folder behind both servers, and
the prefix and long-prompt latencies). `--profile DIR` starts the `tiny` server under cProfile,
one profile per thread (written when the server stops): for finding where the time goes, not for
the figures (profiling slows Python).

This file holds the command line and the run; the pieces are beside it: servers.py (starting,
waiting for and stopping the servers), serve_models.py (the models and the `ceiling`),
serve_measures.py (the measures against a server), serve_targets.py, serve_report.py (FILE.md and
FILE.png), machine.py (the CPU's name, the commit) and serve_loads.py (the client).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_generate import CONFIGS  # noqa: E402
from machine import cpu_model, git  # noqa: E402
from serve_loads import shared_prefix  # noqa: E402
from serve_measures import (  # noqa: E402
    LONG_MAX_TOKENS,
    PREFIX_METRICS,
    hf_measure,
    levels_measure,
    long_measure,
    pick_prompt,
    prefix_compare,
    prefix_measure,
    user_measure,
)
from serve_models import (  # noqa: E402
    HF_TOP_K,
    SAMPLED_TEMPERATURE,
    direct_generate,
    make_llama_folder,
    step_alone,
    tiny_model,
)
from serve_report import markdown, plot  # noqa: E402
from serve_targets import figure_targets, headline_targets  # noqa: E402
from servers import MODEL_NAME, note, run_session, serving  # noqa: E402

from gptforge.config.load import load_config  # noqa: E402
from gptforge.modeling.tokenizer import load_tokenizer  # noqa: E402
from gptforge.modeling.weights import save_model  # noqa: E402

LONG_NAME = "tiny-2048"
HF_NAME = "llama"
DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog"
MEASURES = ("ceiling", "levels", "user", "hf", "prefix", "long")
CONTEXT_MODELS = ("gpt", "llama")  # the 2,048-position models of prefix and long


# ---------------------------------------------------------------------------------------------
# main


def parse_measures(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if "all" in names:
        return list(MEASURES)
    unknown = [m for m in names if m not in MEASURES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--measures: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(MEASURES)} or all"
        )
    return [m for m in MEASURES if m in names]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--measures",
        type=parse_measures,
        default=list(MEASURES),
        help=f"comma-separated, from {', '.join(MEASURES)}, or all",
    )
    ap.add_argument(
        "--clients",
        default="1,4,16",
        help="comma-separated concurrency levels (levels, hf; the top one "
        "is the number of streams of user and of clients of prefix)",
    )
    ap.add_argument("--requests", type=int, default=8, help="requests per client per round (levels)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the levels in turn (levels)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (levels, user, hf)")
    ap.add_argument("--max-batch", type=int, default=16, help="gptforge serve --max-batch")
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="gptforge serve --prefill-chunk N for every gptforge server (default: not passed, the server's own)",
    )
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--repeats", type=int, default=15, help="direct generate's timing rounds (ceiling)")
    ap.add_argument("--user-rounds", type=int, default=3, help="rounds of CLI, one stream, sampled streams (user)")
    ap.add_argument("--hf-requests", type=int, default=2, help="requests per client per round and mode (hf)")
    ap.add_argument("--hf-rounds", type=int, default=1, help="rounds of the levels and modes (hf)")
    ap.add_argument(
        "--context-models",
        default="gpt,llama",
        help="the 2,048-position models of prefix and long: gpt (tiny-2048), llama, or both",
    )
    ap.add_argument("--prefix-tokens", type=int, default=512, help="the shared system prompt's tokens (prefix)")
    ap.add_argument("--prefix-requests", type=int, default=4, help="requests per client (prefix)")
    ap.add_argument("--prefix-max-tokens", type=int, default=16, help="tokens per answer (prefix)")
    ap.add_argument("--long-prompt-tokens", type=int, default=1000, help="the long prompt's tokens (long)")
    ap.add_argument("--long-streams", type=int, default=8, help="streams decoding when it arrives (long)")
    ap.add_argument("--long-decode-tokens", type=int, default=256, help="tokens per decoding stream (long)")
    ap.add_argument(
        "--long-before", type=int, default=32, help="events every stream has had before the long prompt is sent (long)"
    )
    ap.add_argument("--long-rounds", type=int, default=3, help="rounds (long)")
    ap.add_argument("--seed", type=int, default=1337, help="the weights' seed (bench_generate's default)")
    ap.add_argument(
        "--tokenizer-path", default=None, help="default: params.yaml's tokenizer.path (resolved), else tiktoken's gpt2"
    )
    ap.add_argument(
        "--server-threads", type=int, default=None, help="OMP_NUM_THREADS for the servers (default: torch's own choice)"
    )
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument(
        "--profile", default=None, metavar="DIR", help="cProfile every thread of the `tiny` server into DIR"
    )
    ap.add_argument("--out", default=None, help="also write this JSON, a markdown table (.md) and a plot (.png)")
    args = ap.parse_args()
    measures = args.measures
    levels = sorted({int(c) for c in args.clients.split(",")})
    counts = (
        levels[0],
        args.requests,
        args.rounds,
        args.max_tokens,
        args.user_rounds,
        args.hf_requests,
        args.hf_rounds,
        args.prefix_tokens,
        args.prefix_requests,
        args.prefix_max_tokens,
        args.long_prompt_tokens,
        args.long_streams,
        args.long_decode_tokens,
        args.long_before,
        args.long_rounds,
    )
    if min(counts) < 1 or (args.prefill_chunk is not None and args.prefill_chunk < 1):
        ap.error(
            "the counts (--clients, --requests, --rounds, --max-tokens, --*-rounds, --*-requests, --*-tokens, "
            "--long-*, --prefill-chunk) must be >= 1"
        )
    if args.long_before >= args.long_decode_tokens:
        ap.error("--long-before must be below --long-decode-tokens (the streams must still decode after the prompt)")
    context_models = [m.strip() for m in args.context_models.split(",") if m.strip()]
    if not context_models or set(context_models) - set(CONTEXT_MODELS):
        ap.error(f"--context-models: choose from {', '.join(CONTEXT_MODELS)}")
    if args.prefix_tokens + 32 + args.prefix_max_tokens > 2048 or args.long_prompt_tokens + LONG_MAX_TOKENS > 2048:
        ap.error("--prefix-tokens and --long-prompt-tokens must fit in the 2,048 positions")
    if args.tokenizer_path is None and (ROOT / "params.yaml").is_file():
        args.tokenizer_path = load_config(ROOT / "params.yaml").tokenizer.path
    load_before = round(os.getloadavg()[0], 2)
    top = levels[-1]
    enc = load_tokenizer(args.tokenizer_path)
    cfg = CONFIGS["tiny"]
    result: dict = {
        "benchmark": "serve",
        "config": "tiny",
        "measures": measures,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": cpu_model(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "client_torch_threads": torch.get_num_threads(),
        },
    }
    out: dict = {}
    direct, pieces, prompt, ids, model_info = {}, {}, args.prompt, enc.encode_ordinary(args.prompt), None
    llama_info = None
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        tmp = Path(tmp)
        # tiny: ceiling, levels, user
        model = tiny_model(args)
        model_info = {**cfg.to_dict(), "params": model.num_params(non_embedding=False)}
        if {"ceiling", "levels", "user"} & set(measures):
            if args.max_tokens + len(ids) > cfg.block_size:
                ap.error(f"prompt + --max-tokens must fit in the block size {cfg.block_size}")
            prompt, ids, expected_text = pick_prompt(model, enc, args)
            if "ceiling" in measures:
                note("ceiling: direct generate")
                direct = direct_generate(model, ids, args, levels if 1 in levels else [1, *levels])
                direct.pop("new_ids")
                pieces = step_alone(model, ids, args, levels)
            ckpt = save_model(model, tmp / "tiny")
            jobs = []
            if "levels" in measures:
                jobs.append(("levels", lambda s: levels_measure(s, args, prompt, levels, expected_text)))
            if "user" in measures:
                jobs.append(("user", lambda s: user_measure(s, args, ckpt, prompt, top, tmp)))
            run_session(
                lambda: serving("gptforge", ckpt, args, tmp, "gptforge-tiny", name=MODEL_NAME, profile=True), jobs, out
            )
        del model

        # tiny-2048 and llama: prefix, long; llama: hf
        encode, decode = enc.encode_ordinary, enc.decode
        want_prefix, want_long = "prefix" in measures, "long" in measures
        prefix_text = shared_prefix(encode, decode, args.prefix_tokens) if want_prefix else ""
        no_cache = ("--prefix-cache-mb", "0")
        if (want_prefix or want_long) and "gpt" in context_models:
            ckpt2 = save_model(tiny_model(args, 2048), tmp / LONG_NAME)
            jobs = []
            if want_prefix:
                jobs.append(("prefix_gpt_on", lambda s: prefix_measure(s, args, top, prefix_text)))
            if want_long:
                jobs.append(("long_gpt", lambda s: long_measure(s, args, encode, decode)))
            run_session(lambda: serving("gptforge", ckpt2, args, tmp, "gptforge-tiny-2048", name=LONG_NAME), jobs, out)
            if want_prefix:
                run_session(
                    lambda: serving(
                        "gptforge",
                        ckpt2,
                        args,
                        tmp,
                        "gptforge-tiny-2048-no-prefix-cache",
                        name=LONG_NAME,
                        extra=no_cache,
                    ),
                    [("prefix_gpt_off", lambda s: prefix_measure(s, args, top, prefix_text))],
                    out,
                )
        llama_ctx = (want_prefix or want_long) and "llama" in context_models
        if "hf" in measures or llama_ctx:
            folder = tmp / "llama"
            try:
                llama_info = make_llama_folder(folder, args)
            except Exception as e:  # noqa: BLE001 (the other measures go on)
                msg = f"the Llama folder could not be made: {type(e).__name__}: {e}"
                for key in ("hf_gptforge", "prefix_llama_on", "prefix_llama_off", "long_llama"):
                    out[key] = {"error": msg}
            else:
                jobs = []
                if "hf" in measures:
                    jobs.append(("hf_gptforge", lambda s: hf_measure(s, args, levels, extra={"top_k": HF_TOP_K})))
                if llama_ctx and want_prefix:
                    jobs.append(("prefix_llama_on", lambda s: prefix_measure(s, args, top, prefix_text)))
                if llama_ctx and want_long:
                    jobs.append(("long_llama", lambda s: long_measure(s, args, encode, decode)))
                run_session(lambda: serving("gptforge", folder, args, tmp, "gptforge-llama", name=HF_NAME), jobs, out)
                if "hf" in measures:
                    run_session(
                        lambda: serving("transformers", folder, args, tmp, "transformers-llama"),
                        [("hf_transformers", lambda s: hf_measure(s, args, levels, extra={}))],
                        out,
                    )
                if llama_ctx and want_prefix:
                    run_session(
                        lambda: serving(
                            "gptforge",
                            folder,
                            args,
                            tmp,
                            "gptforge-llama-no-prefix-cache",
                            name=HF_NAME,
                            extra=no_cache,
                        ),
                        [("prefix_llama_off", lambda s: prefix_measure(s, args, top, prefix_text))],
                        out,
                    )

    # The report
    lv = out.get("levels") or {}
    summaries = lv.get("levels") or []
    result.update(
        {
            "model": model_info,
            "settings": {
                "clients": levels,
                "requests_per_client": args.requests,
                "rounds": args.rounds,
                "max_tokens": args.max_tokens,
                "max_batch": args.max_batch,
                "prefill_chunk": args.prefill_chunk,
                "prompt": prompt,
                "prompt_tokens": len(ids),
                "temperature": 0,
                "endpoint": "/v1/completions",
                "stream": True,
                "repeats": args.repeats,
                "seed": args.seed,
                "tokenizer_path": _short(args.tokenizer_path),
                "server_threads_env": args.server_threads,
                "profiled": bool(args.profile),
                "client": "asyncio streams, HTTP/1.1 keep-alive, events parsed after each level",
            },
            "server": lv.get("server") or {"omp_num_threads": args.server_threads or "unset (torch's default)"},
            "direct_generate": direct,
            "server_step_alone_ms": pieces,
            "levels": summaries,
        }
    )
    if "levels" in measures and "error" in lv:
        result["levels_error"] = lv["error"]
    result["targets"] = headline_targets(summaries, direct)
    result["same_text_as_generate"] = all(s["same_text_as_generate"] for s in summaries) if summaries else None
    if "user" in measures:
        result["user"] = out.get("user") or {"error": "not run"}
    if "hf" in measures:
        hf = {
            "model": llama_info,
            "endpoint": "/v1/completions",
            "max_tokens": args.max_tokens,
            "temperature": SAMPLED_TEMPERATURE,
            "top_k": HF_TOP_K,
            "requests_per_client": args.hf_requests,
            "rounds": args.hf_rounds,
            "gptforge": out.get("hf_gptforge") or {"error": "not run"},
            "transformers": out.get("hf_transformers") or {"error": "not run"},
            "transformers_command": "transformers serve FOLDER --continuous-batching --host 127.0.0.1 --port PORT "
            f"--device {'cuda' if torch.cuda.is_available() else 'cpu'} "
            "(HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1)",
        }
        if llama_info is None:
            hf["error"] = (out.get("hf_gptforge") or {}).get("error", "the Llama folder was not made")
        ratios = []
        rows = {
            srv: {(r["mode"], r["clients"]): r for r in (hf[srv].get("levels") or [])}
            for srv in ("gptforge", "transformers")
        }
        for mode in ("plain", "stream"):
            for c in levels:
                g, t = rows["gptforge"].get((mode, c)), rows["transformers"].get((mode, c))
                if g and t:
                    ratios.append(
                        {
                            "mode": mode,
                            "clients": c,
                            "gptforge": g["aggregate_tokens_per_sec"],
                            "transformers": t["aggregate_tokens_per_sec"],
                            "ratio": round(g["aggregate_tokens_per_sec"] / t["aggregate_tokens_per_sec"], 3)
                            if t["aggregate_tokens_per_sec"]
                            else None,
                        }
                    )
        hf["ratios"] = ratios
        result["hf"] = hf
    names = {"gpt": LONG_NAME, "llama": HF_NAME}
    if "prefix" in measures:
        models = {}
        for m in context_models:
            on = out.get(f"prefix_{m}_on") or {"error": "not run"}
            off = out.get(f"prefix_{m}_off") or {"error": "not run"}
            cmp = prefix_compare(on, off)
            on.pop("texts", None)
            off.pop("texts", None)
            models[names[m]] = {"with_cache": on, "without_cache": off, **cmp}
        result["prefix"] = {
            "prefix_tokens": args.prefix_tokens,
            "clients": top,
            "requests_per_client": args.prefix_requests,
            "max_tokens": args.prefix_max_tokens,
            "metrics": list(PREFIX_METRICS),
            "models": models,
        }
    if "long" in measures:
        result["long"] = {
            "streams": args.long_streams,
            "decode_tokens": args.long_decode_tokens,
            "before": args.long_before,
            "prompt_tokens": args.long_prompt_tokens,
            "rounds": args.long_rounds,
            "prefill_chunk": args.prefill_chunk,
            "models": {names[m]: out.get(f"long_{m}") or {"error": "not run"} for m in context_models},
        }
    result["figure_targets"] = figure_targets(result)
    judged = [t["met"] for t in result["figure_targets"] if t["met"] is not None]
    result["targets"]["all_figures_met"] = bool(judged) and all(judged) and len(judged) == len(result["figure_targets"])
    result.update(
        {
            "wall_s": round(time.perf_counter() - t_start, 1),
            "load_average_1min": [load_before, round(os.getloadavg()[0], 2)],
            "command": "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:]),
            "commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted_server_changes": bool(git("status", "--porcelain", "--", "src/gptforge")),
        }
    )
    text = json.dumps(result, indent=2)
    if args.out:
        out_path = Path(args.out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text + "\n", encoding="utf-8")
        out_path.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
        if plot(result, out_path.with_suffix(".png")):
            result["plot"] = str(out_path.with_suffix(".png"))
    print(text)
    return 0


def _short(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
