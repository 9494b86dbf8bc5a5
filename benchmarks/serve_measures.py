"""The measures of benchmarks/bench_serve.py that run against a server (a `serving` session from
servers.py): `levels` (streaming clients at each concurrency level, greedy, checked against direct
`generate`), `user` (next to `gptforge generate`), `hf` (the same sampled load on gptforge serve and
transformers serve), `prefix` (a shared system prompt, with and without the prefix cache) and
`long` (a long prompt arriving while streams decode); and the pieces they share: the warm-up, a
timed level with the server's CPU, the summary of a level. Each returns the figures that go into
the result file."""

from __future__ import annotations

import asyncio
import re
import statistics
import subprocess
import time
from pathlib import Path

import psutil
import torch
from serve_loads import (
    completion_body,
    long_document,
    long_prompt_gaps,
    ms,
    ms_stats,
    parse,
    parse_plain,
    pct,
    questions,
    run_level,
    run_long_prompt,
    scrape_metrics,
)
from serve_models import SAMPLED_TEMPERATURE
from servers import MODEL_NAME, cpu_delta, gptforge_command, last_line, log_tail, server_env, thread_cpu

from gptforge.modeling.decoding import generate
from gptforge.modeling.gpt import GPT

PREFIX_METRICS = ("gptforge_prefix_cache_hit_tokens_total", "gptforge_prefix_cache_query_tokens_total")
LONG_MAX_TOKENS = 4  # tokens asked of the long prompt: its first is what ends the window


# ---------------------------------------------------------------------------------------------
# levels


def request_body(args, prompt: str) -> bytes:
    return completion_body(MODEL_NAME, prompt, args.max_tokens, temperature=0)


def warm_up(s, one, many, n_many: int, parser=parse) -> None:
    """One request alone, then `n_many` at once (`many`: one body or a body per client); not
    timed. A failure here is the measure's error (with the server log's last line)."""
    for c, body in ((1, one), (n_many, many)):
        _, raws = asyncio.run(run_level(s.port, c, 1, body))
        bad = [p["error"] for p in map(parser, raws) if "error" in p]
        if bad:
            raise RuntimeError(f"warm-up request failed: {bad[0]} (server log: {last_line(s.log)})")


def summarize(clients: int, rounds: list[dict]) -> dict:
    parsed = [p for r in rounds for p in r["parsed"]]
    ok = [p for p in parsed if "error" not in p]
    errors = [p["error"] for p in parsed if "error" in p]
    ttfts = [p["ttft"] for p in ok if p["ttft"] is not None]
    gaps = [g for p in ok for g in p["gaps"]]
    tokens = [p["completion_tokens"] for p in ok]
    events = sum(p["events"] for p in ok)
    aggs = [r["tokens"] / r["wall_s"] for r in rounds]
    per_request = [p["completion_tokens"] / p["seconds"] for p in ok if p["seconds"]]
    server_cpu: dict[str, float] = {}
    for r in rounds:
        for k, v in r["server_cpu_s"].items():
            server_cpu[k] = round(server_cpu.get(k, 0.0) + v, 3)
    wall = sum(r["wall_s"] for r in rounds)
    client_cpu = sum(r["client_cpu_s"] for r in rounds)
    return {
        "clients": clients,
        "requests": len(parsed),
        "aggregate_tokens_per_sec": round(statistics.median(aggs), 2),
        "aggregate_tokens_per_sec_rounds": [round(a, 2) for a in aggs],
        "wall_s_rounds": [round(r["wall_s"], 3) for r in rounds],
        "completion_tokens": sum(tokens),
        "completion_tokens_per_request": {"min": min(tokens, default=None), "max": max(tokens, default=None)},
        "prompt_tokens_per_request": sorted({p["prompt_tokens"] for p in ok}),
        "tokens_per_event": round(sum(tokens) / events, 3) if events else None,
        "ttft_ms": {"p50": ms(pct(ttfts, 0.5)), "p95": ms(pct(ttfts, 0.95)), "max": ms(max(ttfts, default=None))},
        "itl_ms": {"p50": ms(pct(gaps, 0.5)), "p95": ms(pct(gaps, 0.95)), "max": ms(max(gaps, default=None))},
        "per_request_tokens_per_sec_p50": round(pct(per_request, 0.5), 2) if per_request else None,
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "same_text_as_generate": None,  # filled by the caller
        # CPU seconds over the level's wall time: 2.0 would be both cores busy.
        "server_cpu_s_by_thread": server_cpu,
        "server_cores_busy": round(sum(server_cpu.values()) / wall, 3),
        # main = the event loop; worker = the busiest other thread (the engine's, running the
        # model step); the rest are torch's intra-op threads.
        "server_cores_by_role": _roles(server_cpu, wall),
        "client_cores_busy": round(client_cpu / wall, 3),
    }


def _roles(cpu: dict[str, float], wall: float) -> dict[str, float]:
    """Cores busy by role: `main` the API process (event loop: HTTP, SSE, JSON, detokenizing),
    `worker` the engine's loop (the engine process's main thread, or with `--engine-process off`
    the API process's busiest other thread), `rest` torch's other intra-op threads."""
    api = {k: v for k, v in cpu.items() if not k.startswith("child ")}
    engine = {k: v for k, v in cpu.items() if k.startswith("child ")}
    loop = [v for k, v in engine.items() if k.endswith(" main")]
    if engine:
        worker, rest = sum(loop), sum(engine.values()) - sum(loop)
        main = sum(api.values())
    else:  # the scheduler in a thread of the API process
        others = sorted((v for k, v in api.items() if k != "main"), reverse=True)
        main, worker, rest = api.get("main", 0.0), (others[0] if others else 0.0), sum(others[1:])
    return {"main": round(main / wall, 3), "worker": round(worker / wall, 3), "rest": round(rest / wall, 3)}


def timed_level(
    port: int, server_pid: int, clients: int, requests: int, body, parser=parse, path: str = "/v1/completions"
) -> dict:
    """One level: the wall time, the parsed results, the server's and this process's CPU."""
    s0, c0 = thread_cpu(server_pid), time.process_time()
    wall, raws = asyncio.run(run_level(port, clients, requests, body, path))
    s1, c1 = thread_cpu(server_pid), time.process_time()
    parsed = [parser(r) for r in raws]
    return {
        "wall_s": wall,
        "parsed": parsed,
        "server_cpu_s": cpu_delta(s0, s1),
        "client_cpu_s": c1 - c0,
        "tokens": sum(p.get("completion_tokens") or 0 for p in parsed),
    }


def measure_levels(port: int, server_pid: int, args, body: bytes, levels: list[int]) -> dict:
    by_level: dict[int, list] = {c: [] for c in levels}
    for _ in range(args.rounds):
        for c in levels:
            by_level[c].append(timed_level(port, server_pid, c, args.requests, body))
    return by_level


def pick_prompt(model: GPT, enc, args) -> tuple[str, list[int], str]:
    """The prompt, checked: its greedy continuation must not reach end-of-text within max_tokens
    (the server stops there, direct `generate` would not). Returns the prompt, its tokens and
    that greedy continuation's text."""
    ids = enc.encode_ordinary(args.prompt)
    out = generate(model, torch.tensor([ids]), args.max_tokens, temperature=0)[0, len(ids) :].tolist()
    if enc.eot_token in out:
        raise SystemExit(
            f"bench_serve: the greedy continuation of --prompt {args.prompt!r} reaches end-of-text "
            f"after {out.index(enc.eot_token)} tokens; pick another prompt or fewer --max-tokens"
        )
    return args.prompt, ids, enc.decode(out)


def levels_measure(s, args, prompt: str, levels: list[int], expected_text: str) -> dict:
    body = request_body(args, prompt)
    warm_up(s, body, body, args.max_batch)
    idle0 = thread_cpu(s.pid)
    time.sleep(1.0)
    idle_cpu = sum(cpu_delta(idle0, thread_cpu(s.pid)).values())
    os_threads = psutil.Process(s.pid).num_threads()
    by_level = measure_levels(s.port, s.pid, args, body, levels)
    summaries = []
    for c in levels:
        summary = summarize(c, by_level[c])
        texts = {p["text"] for r in by_level[c] for p in r["parsed"] if "error" not in p}
        summary["same_text_as_generate"] = texts == {expected_text}
        summaries.append(summary)
    return {
        "levels": summaries,
        "server": {
            "health": s.health,
            "startup_s": s.startup_s,
            "idle_cpu_cores": round(idle_cpu, 3),
            "omp_num_threads": args.server_threads or "unset (torch's default)",
            "os_threads": os_threads,
            "flags": s.flags,
            "log_tail": log_tail(s.log, 1500),
        },
    }


# ---------------------------------------------------------------------------------------------
# user: next to `gptforge generate`


def run_generate_cli(ckpt: Path, prompt: str, args, cwd: Path, extra: tuple[str, ...] = ()) -> dict:
    """`gptforge generate PROMPT --temperature 0 --max-new-tokens N` on the checkpoint, as a user
    runs it; the tokens and seconds it prints on stderr (model loading excluded)."""
    cmd = [
        *gptforge_command(),
        "generate",
        prompt,
        "--checkpoint",
        str(ckpt),
        "--temperature",
        "0",
        "--max-new-tokens",
        str(args.max_tokens),
        *extra,
    ]
    if args.tokenizer_path:
        cmd += ["-S", f"tokenizer.path={args.tokenizer_path}"]
    try:
        done = subprocess.run(cmd, cwd=cwd, env=server_env(args), capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"error": "gptforge generate ran past 600 s"}
    m = re.search(r"gptforge: (\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s", done.stderr)
    if done.returncode != 0 or not m:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        return {"error": f"gptforge generate exited with {done.returncode}: {lines[-1] if lines else '(no output)'}"}
    tokens, seconds = int(m.group(1)), float(m.group(2))
    return {
        "tokens": tokens,
        "seconds": seconds,
        "printed_tokens_per_sec": float(m.group(3)),
        "tokens_per_sec": round(tokens / seconds, 2) if seconds else float(m.group(3)),
        "text": done.stdout[:-1] if done.stdout.endswith("\n") else done.stdout,
    }


def user_measure(s, args, ckpt: Path, prompt: str, streams: int, cwd: Path) -> dict:
    greedy = request_body(args, prompt)

    def sampled(r: int) -> list[list[bytes]]:
        return [
            [
                completion_body(
                    MODEL_NAME, prompt, args.max_tokens, temperature=SAMPLED_TEMPERATURE, seed=args.seed + 1000 * r + i
                )
            ]
            for i in range(streams)
        ]

    warm_up(s, greedy, sampled(-1), streams)
    rounds = []
    for r in range(args.user_rounds):
        cli = run_generate_cli(ckpt, prompt, args, cwd)
        one = timed_level(s.port, s.pid, 1, 1, greedy)["parsed"][0]
        many = timed_level(s.port, s.pid, streams, 1, sampled(r))
        errors = [p["error"] for p in many["parsed"] if "error" in p]
        rounds.append(
            {
                "cli": {k: v for k, v in cli.items() if k != "text"},
                "cli_same_text_as_server": ("error" not in cli and "error" not in one and cli["text"] == one["text"]),
                "single_stream": (
                    {"error": one["error"]}
                    if "error" in one
                    else {
                        "tokens": one["completion_tokens"],
                        "seconds": round(one["total_seconds"], 4),
                        "tokens_per_sec": round(one["completion_tokens"] / one["total_seconds"], 2),
                        "ttft_ms": ms(one["ttft"]),
                    }
                ),
                "sampled_streams": {
                    "streams": streams,
                    "tokens": many["tokens"],
                    "wall_s": round(many["wall_s"], 4),
                    "aggregate_tokens_per_sec": round(many["tokens"] / many["wall_s"], 2),
                    "errors": len(errors),
                    "error_examples": sorted(set(errors))[:3],
                },
            }
        )

    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    cli_tps = med([r["cli"].get("tokens_per_sec") for r in rounds])
    one_tps = med([r["single_stream"].get("tokens_per_sec") for r in rounds])
    many_tps = med(
        [r["sampled_streams"]["aggregate_tokens_per_sec"] for r in rounds if not r["sampled_streams"]["errors"]]
    )
    return {
        "cli_tokens_per_sec": cli_tps,
        "single_stream_tokens_per_sec": one_tps,
        "sampled_streams_tokens_per_sec": many_tps,
        "streams": streams,
        "single_vs_cli": round(one_tps / cli_tps, 3) if cli_tps and one_tps else None,
        "sampled_vs_cli": round(many_tps / cli_tps, 3) if cli_tps and many_tps else None,
        "cli_errors": sorted({r["cli"]["error"] for r in rounds if "error" in r["cli"]}),
        "cli_same_text_as_server": all(r["cli_same_text_as_server"] for r in rounds),
        "rounds": rounds,
    }


# ---------------------------------------------------------------------------------------------
# hf: gptforge serve and transformers serve on the Llama folder


def hf_measure(s, args, levels: list[int], *, extra: dict) -> dict:
    """The same load on either server: for each round, level and mode (non-streamed `plain`,
    streamed `stream`), the level's clients each sending `--hf-requests` sampled requests."""
    modes = ("plain", "stream")
    stream_parser = (lambda raw: parse(raw, require_done=False)) if s.kind == "transformers" else parse

    def bodies(mode: str, clients: int, r: int) -> list[list[bytes]]:
        return [
            [
                completion_body(
                    s.model,
                    args.prompt,
                    args.max_tokens,
                    temperature=SAMPLED_TEMPERATURE,
                    stream=mode == "stream",
                    seed=args.seed + 10000 * (r + 1) + 100 * i + j,
                    **extra,
                )
                for j in range(args.hf_requests)
            ]
            for i in range(clients)
        ]

    top = max(levels)
    warm_up(s, bodies("plain", 1, -1)[0][0], bodies("plain", top, -1), top, parse_plain)
    warm_up(s, bodies("stream", 1, -1)[0][0], bodies("stream", top, -1), top, stream_parser)
    runs: dict[tuple[str, int], list] = {(m, c): [] for c in levels for m in modes}
    for r in range(args.hf_rounds):
        for c in levels:
            for m in modes:
                runs[(m, c)].append(
                    timed_level(
                        s.port,
                        s.pid,
                        c,
                        args.hf_requests,
                        bodies(m, c, r),
                        parse_plain if m == "plain" else stream_parser,
                    )
                )
    rows = []
    for (m, c), rs in runs.items():
        parsed = [p for r in rs for p in r["parsed"]]
        ok = [p for p in parsed if "error" not in p]
        errors = [p["error"] for p in parsed if "error" in p]
        tokens = [p["completion_tokens"] for p in ok]
        wall = sum(r["wall_s"] for r in rs)
        cpu = sum(sum(r["server_cpu_s"].values()) for r in rs)
        row = {
            "mode": m,
            "clients": c,
            "requests": len(parsed),
            "aggregate_tokens_per_sec": round(statistics.median(r["tokens"] / r["wall_s"] for r in rs), 2),
            "aggregate_tokens_per_sec_rounds": [round(r["tokens"] / r["wall_s"], 2) for r in rs],
            "completion_tokens_per_request": {
                "min": min(tokens, default=None),
                "max": max(tokens, default=None),
                "mean": round(statistics.mean(tokens), 1) if tokens else None,
            },
            "seconds_per_request_p50": round(pct([p["seconds"] for p in ok], 0.5), 4) if ok else None,
            # sampled with a seed per request: one text for all would mean the server decoded greedily
            "distinct_texts": len({p["text"] for p in ok}),
            "errors": len(errors),
            "error_examples": sorted(set(errors))[:3],
            "server_cores_busy": round(cpu / wall, 3) if wall else None,
        }
        if m == "stream":
            row["ttft_ms"] = ms_stats([p["ttft"] for p in ok if p["ttft"] is not None])
            row["itl_ms"] = ms_stats([g for p in ok for g in p["gaps"]])
        rows.append(row)
    rows.sort(key=lambda row: (row["mode"], row["clients"]))
    return {
        "server": s.kind,
        "command_flags": s.flags,
        "startup_s": s.startup_s,
        "levels": rows,
        "log_last_line": last_line(s.log),
    }


# ---------------------------------------------------------------------------------------------
# prefix: a shared system prompt, with and without the prefix cache


def prefix_measure(s, args, clients: int, prefix: str) -> dict:
    n = args.prefix_requests
    qs, warm = questions(clients * n), questions(clients + 1, offset=10_000)

    def body(q: str) -> bytes:
        return completion_body(s.model, prefix + q, args.prefix_max_tokens, temperature=0)

    warm_up(s, body(warm[0]), [[body(q)] for q in warm[1:]], clients)
    bodies = [[body(qs[i * n + j]) for j in range(n)] for i in range(clients)]
    m0 = scrape_metrics(s.port, PREFIX_METRICS)
    level = timed_level(s.port, s.pid, clients, n, bodies)
    m1 = scrape_metrics(s.port, PREFIX_METRICS)
    parsed = level["parsed"]
    ok = [p for p in parsed if "error" not in p]
    errors = [p["error"] for p in parsed if "error" in p]
    cache = None
    if m0 is not None and m1 is not None and all(k in m1 for k in PREFIX_METRICS):
        hits = m1[PREFIX_METRICS[0]] - m0.get(PREFIX_METRICS[0], 0.0)
        queries = m1[PREFIX_METRICS[1]] - m0.get(PREFIX_METRICS[1], 0.0)
        cache = {"hit_tokens": hits, "query_tokens": queries, "hit_rate": round(hits / queries, 4) if queries else None}
    return {
        "flags": s.flags,
        "requests": len(parsed),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "prompt_tokens": sorted({p["prompt_tokens"] for p in ok}),
        "ttft_ms": ms_stats([p["ttft"] for p in ok if p["ttft"] is not None]),
        "itl_ms": ms_stats([g for p in ok for g in p["gaps"]]),
        "aggregate_tokens_per_sec": round(level["tokens"] / level["wall_s"], 2),
        "wall_s": round(level["wall_s"], 3),
        "server_cores_busy": round(sum(level["server_cpu_s"].values()) / level["wall_s"], 3),
        "prefix_cache_metrics": cache if cache is not None else "not on /metrics",
        "texts": [p.get("text") for p in parsed],
    }


def prefix_compare(on: dict, off: dict) -> dict:
    """The cache's effect: p50 TTFT off / on, and whether the greedy answers are the same."""
    out: dict = {}
    if "error" in on or "error" in off:
        return {"error": on.get("error") or off.get("error")}
    a, b = on["ttft_ms"]["p50"], off["ttft_ms"]["p50"]
    out["ttft_p50_off_over_on"] = round(b / a, 3) if a and b else None
    pairs = list(zip(on.pop("texts"), off.pop("texts")))
    same = [x == y and x is not None for x, y in pairs]
    out["same_answers"] = f"{sum(same)}/{len(pairs)}"
    out["all_same"] = bool(pairs) and all(same)
    diff = next(((i, x, y) for i, (x, y) in enumerate(pairs) if x != y), None)
    if diff:
        out["first_difference"] = {
            "request": diff[0],
            "with_cache": (diff[1] or "")[:200],
            "without": (diff[2] or "")[:200],
        }
    return out


# ---------------------------------------------------------------------------------------------
# long: a long prompt arriving while streams decode


def long_measure(s, args, encode, decode) -> dict:
    n = args.long_streams
    stream_body = completion_body(s.model, args.prompt, args.long_decode_tokens, temperature=0)

    def long_body(r: int) -> bytes:
        return completion_body(
            s.model, long_document(encode, decode, args.long_prompt_tokens, r), LONG_MAX_TOKENS, temperature=0
        )

    warm_up(s, long_body(10_000), completion_body(s.model, args.prompt, 8, temperature=0), n)
    rounds, pooled = [], {"before": [], "during": [], "after": []}
    errors: list[str] = []
    for r in range(args.long_rounds):
        raw = asyncio.run(run_long_prompt(s.port, stream_body, long_body(r), n, args.long_before))
        streams, long = [parse(x) for x in raw["streams"]], parse(raw["long"])
        errors += [p["error"] for p in [*streams, long] if "error" in p]
        g = long_prompt_gaps(streams, long)
        if "error" in g:
            rounds.append({"error": g["error"]})
            continue
        for k in pooled:
            pooled[k] += g[k]
        p95 = {k: ms(pct(g[k], 0.95)) for k in pooled}
        rounds.append(
            {
                "prefill_window_ms": ms(g["window_s"]),
                "long_prompt_tokens": long["prompt_tokens"],
                "itl_p95_ms": p95,
                "during_over_before": round(p95["during"] / p95["before"], 3)
                if p95["during"] and p95["before"]
                else None,
                "gaps": {k: len(g[k]) for k in pooled},
                "streams_ended_before_prefill_done": g["streams_ended_before_prefill_done"],
            }
        )
    stats = {k: ms_stats(v) for k, v in pooled.items()}
    b, d = stats["before"]["p95"], stats["during"]["p95"]
    windows = [r["prefill_window_ms"] for r in rounds if "prefill_window_ms" in r]
    return {
        "flags": s.flags,
        "streams": n,
        "decode_tokens": args.long_decode_tokens,
        "queued": n + 1 > args.max_batch,  # more requests than batch slots: some wait, not what is meant
        "streams_ended_before_prefill_done": sum(r.get("streams_ended_before_prefill_done", 0) for r in rounds),
        "long_prompt_tokens": args.long_prompt_tokens,
        "sent_after_events": args.long_before,
        "itl_ms": stats,
        "itl_p95_during_over_before": round(d / b, 3) if b and d else None,
        "prefill_window_ms_p50": round(statistics.median(windows), 2) if windows else None,
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "rounds": rounds,
    }
