"""`gptforge serve` against llama.cpp's OpenAI-compatible server (`llama_cpp.server`, the server
CPU users pick) on the same SmolLM2, greedy, at 1 and 16 clients, 16-bit and 8-bit on each side.

    benchmarks/llama_cpp_env.sh          # once: llama-cpp-python built into .venv-llama-cpp
    python benchmarks/bench_serve_llama_cpp.py [--folder DIR] [--clients 1,16] [--requests 2]
        [--max-tokens 64] [--rounds 3] [--out docs/results/serve_llama_cpp_cpu.json]

The folder (by default the quickstart's fine-tuned SmolLM2, checkpoints/instruct_smollm2/final,
else the base checkpoints/base/smollm2) is exported by gptforge to GGUF f16, q8_0 and q4_1; the sides:

- gptforge serve on the folder, `--dtype bfloat16` (16-bit weights: on a CPU with native bf16
  the fastest dtype it has), `--quantize int8` and `--quantize int4` (weight-only int8, and
  groupwise int4 with an int8 head, bf16 activations), bf16 and int4 again with `--speculate 4`
  (a lone greedy request drafts by prompt lookup: what it costs or gains on plain chat);
- llama.cpp's server on the f16, the q8_0 and the q4_1 file, `--n_threads` and `--n_threads_batch` the
  core count, requests with `repeat_penalty` 1.0 (its default 1.1 changes greedy answers).

Each server runs alone on the machine; each level sends `--requests` non-streamed
`/v1/completions` per client in turn over one connection (bench_serve_model's `level_rows`: the
asyncio client of serve_loads.py), `max_tokens` `--max-tokens`, the levels taking turns for
`--rounds` rounds; tokens/s is the answers' completion tokens over the level's wall time,
median over rounds. The greedy answer at 1 client is compared across the sides.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_serve_model import level_rows  # noqa: E402
from machine import describe  # noqa: E402
from servers import note, recorded_failure, serving  # noqa: E402

SIDES = (  # label, server kind, what it serves, gptforge serve flags
    ("gptforge bf16", "gptforge", "folder", ("--dtype", "bfloat16")),
    ("gptforge int8", "gptforge", "folder", ("--quantize", "int8")),
    ("gptforge int4", "gptforge", "folder", ("--quantize", "int4")),
    ("gptforge bf16 speculate 4", "gptforge", "folder", ("--dtype", "bfloat16", "--speculate", "4")),
    ("gptforge int4 speculate 4", "gptforge", "folder", ("--quantize", "int4", "--speculate", "4")),
    ("llama.cpp f16", "llama_cpp", "f16", ()),
    ("llama.cpp q8_0", "llama_cpp", "q8_0", ()),
    ("llama.cpp q4_1", "llama_cpp", "q4_1", ()),
)


def default_folder() -> Path:
    tuned = ROOT / "checkpoints/instruct_smollm2/final"
    return tuned if (tuned / "config.json").is_file() else ROOT / "checkpoints/base/smollm2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--folder", default=None, help="a Hugging Face Llama-family folder (default: the quickstart's SmolLM2)"
    )
    ap.add_argument("--clients", default="1,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--sides", default=",".join(label for label, *_ in SIDES))
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.prefill_chunk = args.profile = args.tokenizer_path = args.server_threads = None  # bench_serve's helpers
    folder = Path(args.folder) if args.folder else default_folder()
    if not (folder / "config.json").is_file():
        sys.exit(f"error: {folder} has no config.json (make run writes the quickstart's SmolLM2)")
    levels = [int(c) for c in args.clients.split(",")]
    wanted = args.sides.split(",")
    result = {
        "benchmark": "serve_llama_cpp",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "folder": str(folder),
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests,
        "rounds": args.rounds,
        "sides": {},
        "command": "python benchmarks/bench_serve_llama_cpp.py " + " ".join(sys.argv[1:]),
    }
    from gptforge.modeling.gguf_out import export_gguf

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        files = {}
        for quant in ("f16", "q8_0", "q4_1"):
            if any(label.endswith(quant) for label in wanted):
                files[quant] = export_gguf(folder, tmp / quant / f"smollm2-{quant}.gguf", quant)
                result[f"gguf_{quant}_mb"] = round(files[quant].stat().st_size / 1e6, 1)
        for label, kind, what, flags in SIDES:
            if label not in wanted:
                continue
            path = folder if what == "folder" else files[what]
            with recorded_failure(result["sides"], label):
                with serving(kind, path, args, tmp, label.replace(" ", "-"), name="smollm2", extra=flags) as s:
                    if kind == "llama_cpp":
                        s.body_extra = {"repeat_penalty": 1.0}
                    result["sides"][label] = {"startup_s": s.startup_s, "greedy": level_rows(s, args, "greedy", levels)}
                    rows = result["sides"][label]["greedy"]
                    note(f"{label}: {json.dumps({c: r['tokens_per_sec'] for c, r in rows.items()})}")
    texts = {label: side.get("greedy", {}).get("1", {}).get("text") for label, side in result["sides"].items()}
    result["same_greedy_text_as"] = {
        label: [o for o, t in texts.items() if t == text and o != label] for label, text in texts.items()
    }
    result["machine"] = describe()
    print(json.dumps(result, indent=1))
    print(table(result, levels), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def table(result: dict, levels: list[int]) -> str:
    """A markdown table: tokens/s per side and level (median, the rounds), cores busy."""
    head = "| side | " + " | ".join(f"{c} client{'s' if c > 1 else ''} tokens/s (rounds)" for c in levels) + " |"
    lines = [head, "| --- |" + " ---: |" * len(levels)]
    for label, side in result["sides"].items():
        if "error" in side:
            lines.append(f"| {label} | {side['error'][:100]} |" + " |" * (len(levels) - 1))
            continue
        cells = []
        for c in levels:
            r = side["greedy"][str(c)]
            cells.append(f"{r['tokens_per_sec']} ({', '.join(map(str, r['rounds']))})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
