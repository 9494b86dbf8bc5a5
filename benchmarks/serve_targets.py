"""The targets benchmarks/bench_serve.py judges its figures by: the headline ones of the levels
(16 clients against 1, 1 client against direct `generate`, TTFT, errors: `headline_targets`) and
one row per figure of every measure (levels and ceiling, user, hf, prefix, long:
`figure_targets`), each with its value, its target and whether it holds."""

from __future__ import annotations


def headline_targets(levels: list[dict], direct: dict) -> dict:
    """Issue 18's targets on the levels."""
    if not levels:
        return {}
    agg = {s["clients"]: s["aggregate_tokens_per_sec"] for s in levels}
    first, top = levels[0]["clients"], levels[-1]["clients"]
    scaling = agg[top] / agg[first] if agg[first] else 0.0
    single = agg.get(1, 0.0) / direct["b1"]["tokens_per_sec"] if direct.get("b1") else None
    worst_ttft = max((s["ttft_ms"]["p95"] or 0.0) for s in levels)
    errors = sum(s["errors"] for s in levels)
    t = {
        "top_clients": top,
        "scaling": round(scaling, 3),
        "scaling_met": scaling >= 6,
        "single_vs_generate": None if single is None else round(single, 3),
        "single_met": None if single is None else single >= 0.5,
        "worst_p95_ttft_ms": worst_ttft,
        "ttft_met": worst_ttft < 1000,
        "errors": errors,
        "errors_met": errors == 0,
    }
    t["all_met"] = all(t[k] for k in ("scaling_met", "single_met", "ttft_met", "errors_met"))
    return t


def figure_targets(result: dict) -> list[dict]:
    """Issue 30's targets: one row per figure (value None where the measure did not run or failed)."""
    rows: list[dict] = []

    def add(measure: str, what: str, value, op: str, target: float, error: str | None = None) -> None:
        met = None if value is None else bool(value >= target if op == ">=" else value <= target)
        row = {"measure": measure, "what": what, "value": value, "target": f"{op} {target:g}", "met": met}
        if error:
            row["error"] = error[:300]
        rows.append(row)

    sel = set(result["measures"])
    levels = {lv["clients"]: lv for lv in result.get("levels") or []}
    direct = result.get("direct_generate") or {}
    if {"levels", "ceiling"} <= sel:
        top = max(result["settings"]["clients"])
        for c in sorted({1, top}):
            ref, lv = direct.get(f"b{c}"), levels.get(c)
            value = round(lv["aggregate_tokens_per_sec"] / ref["tokens_per_sec"], 3) if ref and lv else None
            add(
                "levels",
                f"{c} streaming client(s) / direct generate batch {c} (tokens/s)",
                value,
                ">=",
                0.85,
                result.get("levels_error") or direct.get("error"),
            )
    if "user" in sel:
        u = result.get("user") or {}
        add(
            "user",
            "one greedy stream / `gptforge generate` printed tokens/s",
            u.get("single_vs_cli"),
            ">=",
            0.85,
            u.get("error") or "; ".join(u.get("cli_errors") or []) or None,
        )
        add(
            "user",
            f"{u.get('streams', 16)} sampled streams together / `gptforge generate`",
            u.get("sampled_vs_cli"),
            ">=",
            1.0,
            u.get("error"),
        )
    if "hf" in sel:
        hf = result.get("hf") or {}
        err = hf.get("error") or (hf.get("transformers") or {}).get("error") or (hf.get("gptforge") or {}).get("error")
        ratios = {(r["mode"], r["clients"]): r["ratio"] for r in hf.get("ratios") or []}
        top = max(result["settings"]["clients"])
        for mode in ("plain", "stream"):
            for c, target in ((top, 1.5), (1, 1.0)):
                add(
                    "hf",
                    f"gptforge / transformers serve, {c} client(s), "
                    f"{'non-streamed' if mode == 'plain' else 'streamed'} (tokens/s)",
                    ratios.get((mode, c)),
                    ">=",
                    target,
                    err,
                )
    for key, what in (
        ("prefix", "p50 TTFT without / with the prefix cache"),
        ("long", "ITL p95 during the long prefill / before it"),
    ):
        if key not in sel:
            continue
        for model, r in ((result.get(key) or {}).get("models") or {}).items():
            if key == "prefix":
                add(key, f"{model}: {what}", r.get("ttft_p50_off_over_on"), ">=", 4, r.get("error"))
                add(
                    key,
                    f"{model}: greedy answers the same with and without (1 = all)",
                    None if r.get("all_same") is None else float(r["all_same"]),
                    ">=",
                    1,
                    r.get("error"),
                )
            else:
                add(key, f"{model}: {what}", r.get("itl_p95_during_over_before"), "<=", 3, r.get("error"))
    return rows
