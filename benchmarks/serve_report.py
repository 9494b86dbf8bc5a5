"""The reports of benchmarks/bench_serve.py's result (the dict it writes as JSON): `markdown` (the
targets, then a section per measure that ran, with "where the time goes" for the levels) for
FILE.md, and `plot` (tokens/s and TTFT against clients, the Llama folder behind both servers, the
prefix and long-prompt latencies) for FILE.png."""

from __future__ import annotations

from pathlib import Path

from serve_models import HF_TOP_K, SAMPLED_TEMPERATURE


def _clients_axis(ax, xs: list[int], ylabel: str) -> None:
    """The shared look of the panels against clients: a log2 axis, y from 0, legend, light grid."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = []
    levels = result.get("levels") or []
    if levels:
        panels += ["levels", "ttft"]
    hf = result.get("hf") or {}
    if any("levels" in (hf.get(k) or {}) for k in ("gptforge", "transformers")):
        panels.append("hf")
    bars = _latency_bars(result)
    if bars:
        panels.append("latency")
    if not panels:
        return False
    ncols = min(len(panels), 2)
    nrows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4 * nrows), squeeze=False)
    axes = [ax for row in axes for ax in row]
    for ax in axes[len(panels) :]:
        ax.axis("off")
    for ax, panel in zip(axes, panels):
        if panel == "levels":
            xs = [lv["clients"] for lv in levels]
            ax.plot(
                xs, [lv["aggregate_tokens_per_sec"] for lv in levels], "o-", label="gptforge serve (streamed, greedy)"
            )
            direct = result.get("direct_generate") or {}
            bs = sorted(v["batch"] for k, v in direct.items() if k.startswith("b") and isinstance(v, dict))
            if bs:
                ax.plot(
                    bs,
                    [direct[f"b{b}"]["tokens_per_sec"] for b in bs],
                    "s--",
                    label="direct generate, batch = clients (ceiling)",
                )
            u = result.get("user") or {}
            if u.get("cli_tokens_per_sec"):
                ax.axhline(u["cli_tokens_per_sec"], color="gray", lw=0.8, ls=":", label="`gptforge generate` (CLI)")
                if u.get("sampled_streams_tokens_per_sec"):
                    ax.plot(
                        [u["streams"]],
                        [u["sampled_streams_tokens_per_sec"]],
                        "^",
                        label=f"{u['streams']} sampled streams (T {SAMPLED_TEMPERATURE})",
                    )
            _clients_axis(ax, xs, "aggregate tokens/s")
            ax.set_title(f"gptforge GPT `tiny`, {result['settings']['max_tokens']} tokens/request", fontsize=9)
        elif panel == "ttft":
            xs = [lv["clients"] for lv in levels]
            ax.plot(xs, [lv["ttft_ms"]["p95"] for lv in levels], "o-", label="p95")
            ax.plot(xs, [lv["ttft_ms"]["p50"] for lv in levels], "o:", label="p50")
            ax.axhline(1000, color="r", lw=0.8, ls="--", label="target (p95 < 1 s)")
            _clients_axis(ax, xs, "time to first token (ms)")
            ax.set_title("gptforge GPT `tiny`: time to first token", fontsize=9)
        elif panel == "hf":
            xs = set()
            for server, style in (("gptforge", "o"), ("transformers", "s")):
                rows = (hf.get(server) or {}).get("levels") or []
                for mode, ls in (("plain", "-"), ("stream", "--")):
                    pts = [(r["clients"], r["aggregate_tokens_per_sec"]) for r in rows if r["mode"] == mode]
                    if pts:
                        xs |= {x for x, _ in pts}
                        ax.plot(
                            *zip(*pts),
                            style + ls,
                            label=f"{server} serve, {'non-streamed' if mode == 'plain' else 'streamed'}",
                        )
            _clients_axis(ax, sorted(xs), "aggregate tokens/s")
            ax.set_title(f"Llama folder (random, 2048 positions), sampled T {SAMPLED_TEMPERATURE}", fontsize=9)
        else:
            labels, values = zip(*bars)
            ax.bar(range(len(values)), values, color=["C0", "C1"] * (len(values) // 2 + 1))
            ax.set_xticks(range(len(values)), labels, rotation=60, ha="right", fontsize=7)
            ax.set_yscale("log")
            ax.set_ylabel("ms")
            ax.grid(alpha=0.3, axis="y")
            ax.set_title("shared prefix: TTFT p50; long prompt: streams' ITL p95", fontsize=9)
    fig.suptitle(f"gptforge serve, {result['machine']['cpu_count']} CPU cores, {result['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _latency_bars(result: dict) -> list[tuple[str, float]]:
    bars = []
    for model, r in ((result.get("prefix") or {}).get("models") or {}).items():
        on, off = r.get("with_cache") or {}, r.get("without_cache") or {}
        if "ttft_ms" in on and "ttft_ms" in off and on["ttft_ms"]["p50"] and off["ttft_ms"]["p50"]:
            bars += [
                (f"{model} prefix, cache", on["ttft_ms"]["p50"]),
                (f"{model} prefix, no cache", off["ttft_ms"]["p50"]),
            ]
    for model, r in ((result.get("long") or {}).get("models") or {}).items():
        itl = r.get("itl_ms") or {}
        if (itl.get("before") or {}).get("p95") and (itl.get("during") or {}).get("p95"):
            bars += [
                (f"{model} ITL before long", itl["before"]["p95"]),
                (f"{model} ITL during long", itl["during"]["p95"]),
            ]
    return bars


def where_the_time_goes(result: dict) -> str:
    """The measured pieces put side by side (the numbers only; the reading is the reader's)."""
    levels = {lv["clients"]: lv for lv in result["levels"]}
    direct, alone = result.get("direct_generate") or {}, result.get("server_step_alone_ms") or {}
    n = result["settings"]["max_tokens"]
    lines = []
    one = levels.get(1)
    if one and one["aggregate_tokens_per_sec"] and direct.get("b1"):
        t_srv = 1000 / one["aggregate_tokens_per_sec"]
        t_dir = 1000 / direct["b1"]["tokens_per_sec"]
        a1 = alone.get("b1") or {}
        text = (
            f"**One client**: {t_srv:.2f} ms per token through the server against {t_dir:.2f} ms in direct "
            f"`generate` (same weights, prompt and greedy tokens, prefill included in both): the server adds "
            f"{t_srv - t_dir:.2f} ms per token."
        )
        if a1.get("step_aligned_ms") is not None:
            head = (
                "the int8 screen of the head (`GreedyHead`, as direct `generate` uses at batch 1)"
                if a1.get("head", "").startswith("int8")
                else "the float32 50257-row head's product (direct `generate` reads an int8 copy, `GreedyHead`)"
            )
            text += (
                f" The server's model step alone (its backend's decode and greedy pick, no HTTP, in this "
                f"process) takes {a1['step_aligned_ms']:.2f} ms at one row, of which {head} is "
                f"{a1['head_ms']:.2f} ms. The rest, "
                f"{t_srv - a1['step_aligned_ms']:.2f} ms per token, is the serving around the step: each "
                f"step's tokens crossing from the engine process to the API process, detokenizing, the JSON "
                f"chunk, the SSE write (a send to the socket per token), the two processes sharing the "
                f"machine's cores, and the request's time to first text ({one['ttft_ms']['p50']:.1f} ms p50 per "
                f"{n}-token request: {one['ttft_ms']['p50'] / n:.2f} ms per token)."
            )
        text += (
            f" Server threads: {_threads(one)}; {one['server_cores_busy']:.2f} cores busy, the client "
            f"{one['client_cores_busy']:.2f}."
        )
        lines.append(text)
    top = max(levels)
    hi, ref, at = levels[top], direct.get(f"b{top}"), alone.get(f"b{top}") or {}
    if ref and top != 1:
        text = (
            f"**{top} clients**: {hi['aggregate_tokens_per_sec']:.0f} tokens/s against "
            f"{ref['tokens_per_sec']:.0f} for direct `generate` at batch {top} "
            f"({1000 * ref['median_s'] / n:.2f} ms per step of {top} tokens)."
        )
        if at.get("step_ragged_ms") is not None:
            text += (
                f" The server's step alone at {top} rows takes {at['step_aligned_ms']:.2f} ms with rows of one "
                f"length and {at['step_ragged_ms']:.2f} ms with rows at different positions (what staggered "
                f"clients give: a mask per row), of which the head's product (the float32 head) is "
                f"{at['head_ms']:.2f} ms: a "
                f"ceiling of {top * 1000 / at['step_ragged_ms']:.0f} tokens/s before any HTTP."
            )
        text += (
            f" Server threads: {_threads(hi)}; {hi['server_cores_busy']:.2f} cores busy, the client "
            f"{hi['client_cores_busy']:.2f}, of the machine's {result['machine']['cpu_count']}."
        )
        lines.append(text)
    roles = [(c, lv["server_cores_by_role"]) for c, lv in sorted(levels.items())]
    lines.append(
        "**Processes**: the API process (HTTP, SSE, JSON, detokenizing) kept "
        + ", ".join(f"{r['main']:.2f}" for _, r in roles)
        + f" cores busy at {', '.join(str(c) for c, _ in roles)} clients, the engine process's loop "
        + ", ".join(f"{r['worker']:.2f}" for _, r in roles)
        + " and torch's other intra-op threads there "
        + ", ".join(f"{r['rest']:.2f}" for _, r in roles)
        + ". The two no longer share an interpreter lock, but on a machine of two cores the API process's "
        "work per token takes some of the core that the engine's second intra-op thread would use."
    )
    return "\n\n".join(lines)


def _threads(level: dict) -> str:
    """Shares of the server's CPU time: the API process (its event loop, HTTP, SSE, JSON,
    detokenizing) and the engine process's threads (its loop and torch's intra-op threads)."""
    cpu = level["server_cpu_s_by_thread"]
    total = sum(cpu.values()) or 1.0
    api = sum(v for k, v in cpu.items() if not k.startswith("child "))
    engine = sorted((v for k, v in cpu.items() if k.startswith("child ")), reverse=True)
    return (
        f"the API process {100 * api / total:.0f}% of the server's CPU time, the engine process's "
        f"{len(engine)} busy thread(s) " + "/".join(f"{100 * v / total:.0f}%" for v in engine[:3])
    )


def _alone_row(alone: dict) -> str:
    if "error" in alone:
        return f"not measured ({alone['error']})"
    parts = []
    for key, row in alone.items():
        steps = " / ".join(
            f"{row[k]:.2f} {k.split('_')[1]}" for k in ("step_aligned_ms", "step_ragged_ms") if row.get(k) is not None
        )
        if "error" in row:
            parts.append(f"batch {key[1:]}: not measured ({row['error']})")
            continue
        parts.append(f"batch {key[1:]}: step {steps or 'n/a'}, head {row['head_ms']:.2f} ({row['head']})")
    return "; ".join(parts)


def _met(ok) -> str:
    return "not measured" if ok is None else ("met" if ok else "**missed**")


def _f(x, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def _pair(d: dict | None, k1: str = "p50", k2: str = "p95") -> str:
    d = d or {}
    return f"{_f(d.get(k1), '.1f')} / {_f(d.get(k2), '.1f')}"


def levels_markdown(result: dict) -> list[str]:
    s, t = result["settings"], result["targets"]
    direct = result.get("direct_generate") or {}
    rows = [
        "| clients | requests | tokens/request | aggregate tokens/s | vs 1 client | TTFT p50 / p95 (ms) "
        "| ITL p50 / p95 (ms) | tokens/event | errors | server cores | client cores |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = result["levels"][0]["aggregate_tokens_per_sec"] or 1.0
    for lv in result["levels"]:
        tpr = lv["completion_tokens_per_request"]
        tpr = str(tpr["min"]) if tpr["min"] == tpr["max"] else f"{tpr['min']}-{tpr['max']}"
        rows.append(
            f"| {lv['clients']} | {lv['requests']} | {tpr} | {lv['aggregate_tokens_per_sec']:.0f} | "
            f"{lv['aggregate_tokens_per_sec'] / base:.2f}x | {lv['ttft_ms']['p50']} / {lv['ttft_ms']['p95']} | "
            f"{lv['itl_ms']['p50']} / {lv['itl_ms']['p95']} | {lv['tokens_per_event']} | {lv['errors']} | "
            f"{lv['server_cores_busy']} | {lv['client_cores_busy']} |"
        )
    drow = ", ".join(
        f"batch {v['batch']} {v['tokens_per_sec']:.0f}"
        for k, v in direct.items()
        if k.startswith("b") and isinstance(v, dict)
    )
    single = (
        f"1 client / direct batch-1 greedy = {t['single_vs_generate']:.3f} (>= 0.5: {_met(t['single_met'])})"
        if t.get("single_vs_generate") is not None
        else "1 client / direct batch 1: not measured (no ceiling)"
    )
    return [
        "## Streaming clients (levels) and direct `generate` (ceiling)",
        "",
        f"Each request: `POST /v1/completions`, stream, temperature 0, prompt {s['prompt']!r} "
        f"({s['prompt_tokens']} tokens), max_tokens {s['max_tokens']}; {s['requests_per_client']} requests per client "
        f"in turn on one keep-alive connection; {s['rounds']} rounds of the levels in turn (aggregate: median "
        f"over rounds; latencies: over all requests of all rounds).",
        "",
        *rows,
        "",
        (
            f"Direct `generate` (bench_generate's warm greedy measurement, same weights and prompt, {s['repeats']} "
            f"repeats, median), tokens/s: {drow}."
            if drow
            else "Direct `generate`: not measured (`ceiling` not run)."
        ),
        "",
        f"The server's model step alone (its backend's decode + argmax in this process, no HTTP; median ms): "
        f"{_alone_row(result.get('server_step_alone_ms') or {'error': 'ceiling not run'})}.",
        "",
        f"Headline targets: aggregate at {t['top_clients']} clients / 1 client = {t['scaling']:.2f} (>= 6: "
        f"{_met(t['scaling_met'])}); {single}; worst p95 TTFT {t['worst_p95_ttft_ms']:.0f} ms (< 1000: "
        f"{_met(t['ttft_met'])}); errors {t['errors']} ({_met(t['errors_met'])}). Greedy text through the server "
        f"equals direct `generate`'s: {result['same_text_as_generate']}.",
        "",
        "## Where the time goes",
        "",
        where_the_time_goes(result),
        "",
    ]


def user_markdown(u: dict, s: dict) -> list[str]:
    out = ["## As a user sees it (user)", ""]
    if "error" in u:
        return out + [f"Not measured: {u['error']}", ""]
    out += [
        f"`gptforge generate PROMPT --temperature 0 --max-new-tokens {s['max_tokens']}` on the `tiny` checkpoint "
        f"printed {_f(u['cli_tokens_per_sec'], '.1f')} tokens/s (median of {len(u['rounds'])}; model loading "
        f"excluded). Through the server: one greedy stream of {s['max_tokens']} tokens "
        f"{_f(u['single_stream_tokens_per_sec'], '.1f')} tokens/s (sent to end of stream) = "
        f"{_f(u['single_vs_cli'], '.2f')}x (target >= 0.85); {u['streams']} sampled streams at once (temperature "
        f"{SAMPLED_TEMPERATURE}, usage tokens) {_f(u['sampled_streams_tokens_per_sec'], '.1f')} tokens/s together = "
        f"{_f(u['sampled_vs_cli'], '.2f')}x (target >= 1.0). The CLI's greedy text equals the server's: "
        f"{u['cli_same_text_as_server']}." + (f" CLI errors: {'; '.join(u['cli_errors'])}." if u["cli_errors"] else ""),
        "",
    ]
    return out


def hf_markdown(hf: dict) -> list[str]:
    out = ["## The Llama folder: gptforge serve against transformers serve (hf)", ""]
    if "error" in hf:
        return out + [f"Not measured: {hf['error']}", ""]
    m = hf["model"]
    out += [
        f"A random Llama ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} "
        f"heads / {m['num_key_value_heads']} key-value heads, MLP {m['intermediate_size']}, "
        f"{m['max_position_embeddings']} positions, {m['params'] / 1e6:.1f}M parameters), each server alone; "
        f"`POST /v1/completions`, temperature {SAMPLED_TEMPERATURE}, top_k {HF_TOP_K}, a seed per request, "
        f"max_tokens {hf['max_tokens']}, {hf['requests_per_client']} requests per client, {hf['rounds']} round(s); "
        f"tokens = `usage.completion_tokens`.",
        "",
        "| server | mode | clients | aggregate tokens/s | tokens/request (mean) | TTFT p50 / p95 (ms) "
        "| distinct answers | errors | server cores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for server in ("gptforge", "transformers"):
        sec = hf.get(server) or {}
        if "error" in sec:
            out.append(f"| {server} serve | - | - | not measured: {sec['error'][:200]} | | | | | |")
            continue
        for r in sec.get("levels") or []:
            out.append(
                f"| {server} serve | {'non-streamed' if r['mode'] == 'plain' else 'streamed'} | {r['clients']} "
                f"| {r['aggregate_tokens_per_sec']:.0f} | {_f(r['completion_tokens_per_request']['mean'], '.1f')} "
                f"| {_pair(r.get('ttft_ms')) if r['mode'] == 'stream' else '-'} "
                f"| {r['distinct_texts']}/{r['requests'] - r['errors']} | {r['errors']} "
                f"| {_f(r['server_cores_busy'], '.2f')} |"
            )
    if hf.get("ratios"):
        out += [
            "",
            "gptforge / transformers: "
            + "; ".join(
                f"{'non-streamed' if r['mode'] == 'plain' else 'streamed'} at {r['clients']} {_f(r['ratio'], '.2f')}x"
                for r in hf["ratios"]
            )
            + " (targets: >= 1.5 at 16 clients, >= 1.0 at 1).",
        ]
    out += ["", f"transformers serve: `{hf.get('transformers_command', '')}`"]
    return out + [""]


def prefix_markdown(p: dict) -> list[str]:
    out = ["## A shared system prompt (prefix)", ""]
    if "error" in p:
        return out + [f"Not measured: {p['error']}", ""]
    out += [
        f"{p['clients']} clients, {p['requests_per_client']} requests each in turn, every prompt the same "
        f"{p['prefix_tokens']}-token system prompt + a short distinct question; greedy, streamed, "
        f"max_tokens {p['max_tokens']}.",
        "",
        "| model | prefix cache | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | aggregate tokens/s | cache hit rate "
        "| errors |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model, r in p["models"].items():
        for key, label in (("with_cache", "on (default)"), ("without_cache", "off (`--prefix-cache-mb 0`)")):
            x = r.get(key) or {}
            if "error" in x:
                out.append(f"| {model} | {label} | not measured: {x['error'][:200]} | | | | |")
                continue
            c = x.get("prefix_cache_metrics")
            rate = (
                f"{100 * c['hit_rate']:.0f}%"
                if isinstance(c, dict) and c.get("hit_rate") is not None
                else "-"
                if isinstance(c, dict)
                else "n/a"
            )
            out.append(
                f"| {model} | {label} | {_pair(x.get('ttft_ms'))} | {_pair(x.get('itl_ms'))} "
                f"| {_f(x.get('aggregate_tokens_per_sec'))} | {rate} | {x.get('errors')} |"
            )
    out.append("")
    for model, r in p["models"].items():
        if "error" in r:
            out.append(f"- {model}: {r['error'][:300]}")
        else:
            out.append(
                f"- {model}: p50 TTFT without / with the cache {_f(r.get('ttft_p50_off_over_on'), '.2f')}x "
                f"(target >= 4); greedy answers the same: {r.get('same_answers')}"
            )
    return out + [""]


def long_markdown(lg: dict) -> list[str]:
    out = ["## A long prompt arriving while streams decode (long)", ""]
    if "error" in lg:
        return out + [f"Not measured: {lg['error']}", ""]
    out += [
        f"{lg['streams']} greedy streams of {lg['decode_tokens']} tokens; once each has had {lg['before']} "
        f"events, a {lg['prompt_tokens']}-token prompt arrives; {lg['rounds']} round(s); the streams' "
        f"inter-token gaps before it, during its prefill (sent -> its first token) and after. Server flags: "
        f"{lg['prefill_chunk'] or 'the default prefill chunk'}.",
        "",
        "| model | prefill window p50 (ms) | ITL p95 before (ms) | during | after | during / before "
        "| streams done before it | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, r in lg["models"].items():
        if "error" in r:
            out.append(f"| {model} | not measured: {r['error'][:200]} | | | | | | |")
            continue
        itl = r["itl_ms"]
        out.append(
            f"| {model} | {_f(r['prefill_window_ms_p50'], '.1f')} | {_f(itl['before']['p95'], '.1f')} "
            f"| {_f(itl['during']['p95'], '.1f')} | {_f(itl['after']['p95'], '.1f')} "
            f"| {_f(r['itl_p95_during_over_before'], '.2f')}x | {r['streams_ended_before_prefill_done']} "
            f"| {r['errors']} |"
        )
        if r.get("queued"):
            out.append(
                f"| {model} | (--max-batch is below {r['streams']} streams + 1: requests queued, "
                f"the figures are not the measure's) | | | | | | |"
            )
    return out + [
        "",
        "Target: during / before <= 3. `streams done before it`: streams that ended before the long "
        "prompt's first token (over all rounds; raise --long-decode-tokens if not 0).",
        "",
    ]


def markdown(result: dict) -> str:
    mach, s = result["machine"], result["settings"]
    m = result["model"]
    lines = [
        "# `gptforge serve` on the CPU: concurrent clients, tiny models",
        "",
        f"- date: {result['date']}; machine: {mach['processor'] or mach['machine']}, {mach['cpu_count']} cores "
        f"({mach['machine']}, {mach['platform']}); load average (1 min) before/after: {result['load_average_1min']}",
        f"- torch {mach['torch']}, Python {mach['python']}; "
        f"server OMP_NUM_THREADS {result['server']['omp_num_threads']}; commit {result['commit']}"
        f"{' with uncommitted changes under src/gptforge' if result['uncommitted_server_changes'] else ''}",
        f"- measures: {', '.join(result['measures'])}; gptforge serve flags: `--max-batch {s['max_batch']}`"
        + (f" `--prefill-chunk {s['prefill_chunk']}`" if s.get("prefill_chunk") else ""),
        f"- model `tiny`: bench_generate's ({m['n_layer']} layers x {m['n_head']} heads x {m['n_embd']}, block "
        f"{m['block_size']}, random weights, seed {s['seed']}, {m['params'] / 1e6:.1f}M parameters), GPT-2 tokenizer; "
        f"`tiny-2048`: the same with block 2048",
        "",
        "## Targets, one per figure",
        "",
        "| measure | figure | value | target | |",
        "|---|---|---:|---:|---|",
    ]
    for t in result["figure_targets"]:
        note_ = f" ({t['error'][:120]})" if t.get("error") and t["met"] is None else ""
        lines.append(
            f"| {t['measure']} | {t['what']} | {_f(t['value'], '.3f')} | {t['target']} | {_met(t['met'])}{note_} |"
        )
    lines.append("")
    if result.get("levels"):
        lines += levels_markdown(result)
    elif result.get("levels_error"):
        lines += ["## Streaming clients (levels)", "", f"Not measured: {result['levels_error']}", ""]
    if "user" in result:
        lines += user_markdown(result["user"], s)
    if "hf" in result:
        lines += hf_markdown(result["hf"])
    if "prefix" in result:
        lines += prefix_markdown(result["prefix"])
    if "long" in result:
        lines += long_markdown(result["long"])
    lines += [f"Command: `{result['command']}`", ""]
    return "\n".join(lines)
