"""`gptforge serve` against `transformers serve --continuous-batching` on a real Hugging Face
folder (SmolLM2-135M-Instruct by default), greedy and sampled, at 1 and 16 clients, in each
weight dtype; and one greedy stream through gptforge serve against `gptforge generate`.

    python benchmarks/bench_serve_model.py [--folder DIR] [--clients 1,16] [--requests 2]
        [--max-tokens 64] [--rounds 3] [--dtypes float32,bfloat16]
        [--out docs/results/serve_smollm2_cpu.json]

The servers and the client are bench_serve's (one server alone on the machine at a time, the
asyncio client of serve_loads.py, the server's CPU per thread). Per dtype (`--dtype` on both
servers): gptforge serve on the folder (`--max-batch 16`), then transformers serve on the
folder (greedy: SmolLM2's generation_config does not sample) and on a copy whose
generation_config says `do_sample: true, top_k: 50, temperature: 0.8` (transformers serve
samples only when the folder says so, and answers 422 to a request's `top_k`; gptforge gets
top_k 50 in the request, so both sample from the same distribution). Each level sends
`--requests` non-streamed `/v1/completions` per client, in turn over one connection,
`max_tokens` `--max-tokens` with `ignore_eos`-free prompts chosen so that the answers run to
the limit; sampled requests carry a seed each. The levels and modes take turns for `--rounds`
rounds; tokens/s is the answers' `usage.completion_tokens` over the level's wall time, median
over rounds. The greedy answer at 1 client is compared between the two servers.

`user`: `gptforge generate PROMPT --checkpoint FOLDER --temperature 0 --dtype D` (the tokens/s
it prints, a fresh process each round) against one greedy streamed request of the same
prompt through gptforge serve (its tokens over send-to-end-of-stream), `--rounds` times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from machine import describe  # noqa: E402
from serve_loads import completion_body, parse, parse_plain  # noqa: E402
from serve_measures import run_generate_cli, timed_level, warm_up  # noqa: E402
from servers import note, recorded_failure, serving  # noqa: E402

# A text prompt whose continuation by SmolLM2 runs past 64 tokens without an end of text, greedy
# and sampled (checked by the `tokens per request` of the result: every answer at max_tokens).
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a screw press. Over the following decades"
)
TEMPERATURE, TOP_K = 0.8, 50


def sampling_copy(folder: Path, dest: Path) -> Path:
    """The folder with a generation_config.json that samples (transformers serve's switch)."""
    shutil.copytree(folder, dest)
    cfg_path = dest / "generation_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg.update(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dest


def level_rows(s, args, mode: str, levels: list[int]) -> dict:
    """Non-streamed requests at each level, `--rounds` rounds in turn (greedy bodies carry the
    server's `s.body_extra` when it has one)."""
    gptforge = s.kind == "gptforge"

    def bodies(clients: int, r: int) -> list[list[bytes]]:
        if mode == "greedy":
            return [
                [
                    completion_body(
                        s.model, PROMPT, args.max_tokens, temperature=0, stream=False, **getattr(s, "body_extra", {})
                    )
                    for _ in range(args.requests)
                ]
                for _ in range(clients)
            ]
        extra = {"top_k": TOP_K} if gptforge else {}
        return [
            [
                completion_body(
                    s.model,
                    PROMPT,
                    args.max_tokens,
                    temperature=TEMPERATURE,
                    stream=False,
                    seed=1000 * (r + 1) + 100 * i + j,
                    **extra,
                )
                for j in range(args.requests)
            ]
            for i in range(clients)
        ]

    top = max(levels)
    warm_up(s, bodies(1, -1)[0][0], bodies(top, -1), top, parse_plain)
    runs = {c: [] for c in levels}
    for r in range(args.rounds):
        for c in levels:
            runs[c].append(timed_level(s.port, s.pid, c, args.requests, bodies(c, r), parse_plain))
    out = {}
    for c, rs in runs.items():
        parsed = [p for r in rs for p in r["parsed"]]
        ok = [p for p in parsed if "error" not in p]
        tokens = [p["completion_tokens"] for p in ok]
        out[str(c)] = {
            "tokens_per_sec": round(statistics.median(r["tokens"] / r["wall_s"] for r in rs), 2),
            "rounds": [round(r["tokens"] / r["wall_s"], 2) for r in rs],
            "tokens_per_request": [min(tokens, default=None), max(tokens, default=None)],
            "distinct_texts": len({p["text"] for p in ok}),
            "errors": len(parsed) - len(ok),
            "error_examples": sorted({p["error"] for p in parsed if "error" in p})[:2],
            "server_cores_busy": round(
                sum(sum(r["server_cpu_s"].values()) for r in rs) / sum(r["wall_s"] for r in rs), 3
            ),
        }
        if c == 1 and ok:
            out[str(c)]["text"] = ok[0]["text"]
    return out


def user_rows(s, args, folder: Path, dtype: str, cwd: Path) -> dict:
    body = completion_body(s.model, PROMPT, args.max_tokens, temperature=0, stream=True)
    warm_up(s, body, body, 1, parse)
    cli, stream = [], []
    for _ in range(args.rounds):
        res = run_generate_cli(folder, PROMPT, args, cwd, extra=("--dtype", dtype))
        if "error" in res:
            return {"error": res["error"]}
        cli.append(res)
        one = timed_level(s.port, s.pid, 1, 1, body)["parsed"][0]
        if "error" in one:
            return {"error": one["error"]}
        stream.append(one["completion_tokens"] / one["total_seconds"])
    cli_tps = statistics.median(r["tokens_per_sec"] for r in cli)
    return {
        "generate_cli_tokens_per_sec": round(cli_tps, 2),
        "generate_cli_runs": [r["tokens_per_sec"] for r in cli],
        "stream_tokens_per_sec": round(statistics.median(stream), 2),
        "stream_runs": [round(x, 2) for x in stream],
        "stream_over_generate": round(statistics.median(stream) / cli_tps, 3),
        "generate_text": cli[0]["text"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", default=str(ROOT / "checkpoints/base/smollm2"))
    ap.add_argument("--clients", default="1,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # what bench_serve's server helpers read
    args.prefill_chunk = args.profile = args.tokenizer_path = args.server_threads = None
    levels = [int(c) for c in args.clients.split(",")]
    result = {
        "benchmark": "serve_hf_model",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "folder": args.folder,
        "prompt": PROMPT,
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests,
        "rounds": args.rounds,
        "sampling": {"temperature": TEMPERATURE, "top_k": TOP_K},
        "dtypes": {},
        "command": "python benchmarks/bench_serve_model.py " + " ".join(sys.argv[1:]),
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        folder = Path(args.folder).resolve()
        if not (folder / "config.json").is_file():
            from gptforge.modeling.gguf_in import write_folder

            note(f"{folder} missing: writing SmolLM2 from the packaged GGUF")
            folder = tmp / "smollm2"
            write_folder("packaged://smollm2-135m-instruct", folder, param="--folder")
        sampled_folder = sampling_copy(folder, tmp / "smollm2-sampling")
        for dtype in args.dtypes.split(","):
            res = result["dtypes"][dtype] = {}
            flags = ("--dtype", dtype)
            with recorded_failure(res, "gptforge"):
                with serving("gptforge", folder, args, tmp, f"gptforge-{dtype}", name="smollm2", extra=flags) as s:
                    res["gptforge"] = {
                        "startup_s": s.startup_s,
                        "greedy": level_rows(s, args, "greedy", levels),
                        "sampled": level_rows(s, args, "sampled", levels),
                        "user": user_rows(s, args, folder, dtype, tmp),
                    }
            res["transformers"] = {}
            for mode, path in (("greedy", folder), ("sampled", sampled_folder)):
                with recorded_failure(res["transformers"], mode):
                    with serving("transformers", path, args, tmp, f"transformers-{dtype}-{mode}", extra=flags) as s:
                        res["transformers"][mode] = level_rows(s, args, mode, levels)
            res["ratios"] = ratios(res, levels)
            note(f"{dtype}: {json.dumps(res['ratios'])}")
    result["machine"] = describe()
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def ratios(res: dict, levels: list[int]) -> dict:
    """gptforge / transformers tokens/s per mode and level; one stream / gptforge generate."""
    out = {}
    ours, theirs = res.get("gptforge", {}), res.get("transformers", {})
    for mode in ("greedy", "sampled"):
        for c in levels:
            a = ours.get(mode, {}).get(str(c), {}).get("tokens_per_sec")
            b = theirs.get(mode, {}).get(str(c), {}).get("tokens_per_sec")
            out[f"{mode}_{c}"] = round(a / b, 3) if a and b else None
    g, t = ours.get("greedy", {}).get("1", {}).get("text"), theirs.get("greedy", {}).get("1", {}).get("text")
    out["same_greedy_text"] = g == t if g is not None and t is not None else None
    out["stream_over_generate"] = ours.get("user", {}).get("stream_over_generate")
    return out


if __name__ == "__main__":
    main()
