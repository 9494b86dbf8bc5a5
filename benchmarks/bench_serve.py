"""Concurrent streaming clients against `gptforge serve`: aggregate tokens/s, time to first token
and inter-token latency at 1, 4 and 16 clients, next to direct `generate` on the same weights.

    python benchmarks/bench_serve.py [--clients 1,4,16] [--requests 8] [--max-tokens 128]
        [--rounds 3] [--out docs/results/serve_tiny_cpu.json]

The model is bench_generate's `tiny` one (4 layers x 4 heads x 128, block 256, random weights
from the same seed), saved as a gptforge checkpoint in a temporary folder and served by
`gptforge serve tiny=FOLDER --port P --max-batch 16` in a subprocess, with the project's
GPT-2 tokenizer (params.yaml's `tokenizer.path`). After /health answers and a warm-up (one
request alone, then one per slot at once), each level runs `--clients` clients at once, each
sending `--requests` requests one after the other over one keep-alive connection:
`POST /v1/completions` with `stream: true`, `stream_options: {"include_usage": true}`,
temperature 0, the fixed `--prompt` and `max_tokens` = `--max-tokens`. The levels take turns
for `--rounds` rounds (1, 4, 16, 1, 4, 16, ...), so a slow spell of this shared machine hits
them alike.

The client is a few lines of asyncio streams, not httpx or aiohttp: on 2 cores the client takes
CPU from the server, so it does the least it can while timing (read the chunked body, split
the events, note the arrival time) and parses the JSON after the level. Per level:
- aggregate tokens/s: the completion tokens the server reports (the usage chunk), summed over
  the level's requests, over the level's wall time (median over the rounds);
- time to first token (TTFT): request sent -> first event with text (p50/p95 over requests);
- inter-token latency (ITL): gaps between consecutive text events of one request (p50/p95 over
  all gaps); `tokens_per_event` says how many tokens an event carried on average (a piece of
  text that ends inside a UTF-8 character waits for the next token);
- errors: a status other than 200, an `error` event, a missing `[DONE]`, a failed connection;
- the CPU seconds of the server's threads (by thread name) and of this client process.

In the same run, before the server starts, bench_generate's warm greedy measurement
(`timed_interleaved` over `generate(model, prompt, N, temperature=0)`) on the same weights and
the same prompt tokens gives the direct tokens/s at batch 1, and at the batch sizes of the other
levels (the prompt repeated) as the ceiling of what batching can give. The targets (issue 18):
aggregate tokens/s at 16 clients >= 6x that of 1 client; 1 client >= 0.5x direct batch-1
greedy; p95 TTFT < 1 s; no errors. The greedy text through the server is checked against
direct `generate`'s. The server stops at end-of-text; the prompt is one whose greedy
continuation does not reach it within `--max-tokens` (the token counts are reported, not
assumed).

`--profile DIR` starts the server under cProfile, one profile per thread (written when the
server stops): for finding where the time goes, not for the figures (profiling slows Python).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import torch  # noqa: E402

from bench_generate import CONFIGS, timed_interleaved  # noqa: E402
from gptforge.config.load import load_config  # noqa: E402
from gptforge.modeling.decoding import generate  # noqa: E402
from gptforge.modeling.gpt import GPT  # noqa: E402
from gptforge.modeling.tokenizer import load_tokenizer  # noqa: E402
from gptforge.modeling.weights import save_model  # noqa: E402

MODEL_NAME = "tiny"
DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog"

# Runs `gptforge serve` with a cProfile profiler in every thread (--profile): each thread's stats
# are dumped into the folder when the server process exits.
PROFILE_WRAPPER = r"""
import atexit, cProfile, os, sys, threading
out = sys.argv.pop(1)
profiles = []
_run = threading.Thread.run
def run(self):
    p = cProfile.Profile()
    profiles.append((self.name, p))
    p.enable()
    try:
        _run(self)
    finally:
        p.disable()
threading.Thread.run = run
main = cProfile.Profile()
profiles.append(("main", main))
def dump():
    for i, (name, p) in enumerate(profiles):
        try:
            p.create_stats()
            p.dump_stats(os.path.join(out, f"{i:02d}_{''.join(c if c.isalnum() else '_' for c in name)}.prof"))
        except Exception as e:
            print(f"profile {name}: {e}", file=sys.stderr)
atexit.register(dump)
from gptforge.cli import main as cli_main
sys.argv[0] = "gptforge"
main.enable()
try:
    code = cli_main()
finally:
    main.disable()
sys.exit(code)
"""


# ---------------------------------------------------------------------------------------------
# The server process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gptforge_command() -> list[str]:
    script = Path(sys.executable).with_name("gptforge")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "gptforge.cli"]


def start_server(ckpt: Path, port: int, args, log_path: Path) -> subprocess.Popen:
    serve_args = ["serve", f"{MODEL_NAME}={ckpt}", "--host", "127.0.0.1", "--port", str(port),
                  "--max-batch", str(args.max_batch)]
    if args.tokenizer_path:
        serve_args += ["-S", f"tokenizer.path={args.tokenizer_path}"]
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-c", PROFILE_WRAPPER, str(Path(args.profile).resolve()), *serve_args]
    else:
        cmd = [*gptforge_command(), *serve_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    env.pop("GPTFORGE_API_KEY", None)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the server's own thread count unless asked
        env.pop(key, None)
    if args.server_threads:
        env["OMP_NUM_THREADS"] = str(args.server_threads)
    log = open(log_path, "wb")
    # The server's working directory is the temporary folder: no params.yaml or checkpoints of
    # the repository are read; the settings come from the command line.
    return subprocess.Popen(cmd, cwd=log_path.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def log_tail(log_path: Path, n: int = 2000) -> str:
    try:
        return log_path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench_serve: the server exited with {proc.returncode}:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                body = json.loads(r.read())
            if body.get("status") == "ok":
                return body
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"bench_serve: no healthy /health within {timeout:.0f} s:\n{log_tail(log_path)}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down on SIGINT (and --profile dumps its stats)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of the process: `main` (the event loop, HTTP)
    and the others by thread id (Python's thread names do not reach the OS)."""
    try:
        return {("main" if t.id == pid else f"tid {t.id}"): t.user_time + t.system_time
                for t in psutil.Process(pid).threads()}
    except psutil.Error:
        return {}


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    names = set(before) | set(after)
    return {n: round(after.get(n, 0.0) - before.get(n, 0.0), 3) for n in sorted(names)
            if after.get(n, 0.0) - before.get(n, 0.0) > 0.0005}


# ---------------------------------------------------------------------------------------------
# The client: raw HTTP/1.1 over asyncio streams, keep-alive, chunked or plain bodies


class Connection:
    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None

    async def post_stream(self, path: str, body: bytes) -> dict:
        """Send one request; return status, the raw events with their arrival times, and the
        send time. Parsing the events is left for later."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.reader, self.writer
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        t0 = time.perf_counter()
        writer.write(head + body)
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        events: list[tuple[float, bytes]] = []
        buf = b""
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()  # the blank line after the last chunk (no trailers)
                    break
                data = await reader.readexactly(size + 2)
                t = time.perf_counter()
                buf += data[:-2]
                if b"\n\n" in buf or b"\r\n\r\n" in buf:
                    buf = buf.replace(b"\r\n", b"\n")
                    *done, buf = buf.split(b"\n\n")
                    events.extend((t, e) for e in done)
        elif "content-length" in headers:
            buf = await reader.readexactly(int(headers["content-length"]))
        else:
            buf = await reader.read()
            headers["connection"] = "close"
        if buf.strip():
            events.append((time.perf_counter(), buf.replace(b"\r\n", b"\n").strip()))
        if headers.get("connection") == "close":
            await self.close()
        return {"status": status, "sent": t0, "events": events}


def request_body(args, prompt: str) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()


async def run_level(port: int, clients: int, requests: int, body: bytes) -> tuple[float, list]:
    """`clients` clients at once, each sending `requests` requests in turn on its own connection.
    Returns the wall time and the raw results (an exception's text in place of a failed one)."""
    async def client() -> list:
        conn, out = Connection(port), []
        for _ in range(requests):
            try:
                out.append(await conn.post_stream("/v1/completions", body))
            except Exception as e:  # counted as an error, the client goes on with a new connection
                out.append({"error": f"{type(e).__name__}: {e}"})
                await conn.close()
        await conn.close()
        return out

    t0 = time.perf_counter()
    results = await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - t0, [r for rs in results for r in rs]


def parse(raw: dict) -> dict:
    """One request's raw result -> ttft, the gaps between text events, tokens, text, error."""
    if "error" in raw:
        return {"error": raw["error"]}
    if raw["status"] != 200:
        msg = b" ".join(e for _, e in raw["events"])[:300].decode(errors="replace")
        return {"error": f"status {raw['status']}: {msg}"}
    text_times, pieces, usage, done, error = [], [], None, False, None
    for t, event in raw["events"]:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                error = f"not JSON: {data[:100]!r}"
                continue
            if "error" in chunk:
                error = json.dumps(chunk["error"])[:300]
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content")
                if piece:
                    pieces.append(piece)
                    text_times.append(t)
    if error is None and not done:
        error = "no [DONE] event"
    if error is None and usage is None:
        error = "no usage chunk"
    if error is not None:
        return {"error": error}
    gaps = [b - a for a, b in zip(text_times, text_times[1:])]
    return {"ttft": (text_times[0] - raw["sent"]) if text_times else None, "gaps": gaps,
            "events": len(text_times), "completion_tokens": usage.get("completion_tokens"),
            "prompt_tokens": usage.get("prompt_tokens"), "text": "".join(pieces),
            "seconds": (text_times[-1] - raw["sent"]) if text_times else None}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


# ---------------------------------------------------------------------------------------------
# The measurement


def direct_generate(model: GPT, ids: list[int], args, batch_sizes: list[int]) -> dict:
    """bench_generate's warm greedy measurement, batch 1 and the other levels' batch sizes."""
    n = args.max_tokens
    prompt = torch.tensor([ids])
    fns = {f"b{b}": (lambda b=b: generate(model, prompt.repeat(b, 1), n, temperature=0)) for b in batch_sizes}
    res = timed_interleaved(fns, args.repeats)
    out = {}
    for name, (median, times, tokens) in res.items():
        b = int(name[1:])
        out[name] = {"batch": b, "tokens_per_sec": round(b * n / median, 2), "median_s": round(median, 4),
                     "times_s": [round(t, 4) for t in times]}
    out["new_ids"] = res["b1"][2][0, len(ids):].tolist()
    return out


def step_alone(model: GPT, ids: list[int], args, batch_sizes: list[int]) -> dict:
    """The server's model step without the server, timed in this process (median of 48 steps
    after 8): `serve.backends.GPTBackend` decoding `batch_sizes` rows and picking each row's
    greedy token as the engine does (`decode_greedy` for a single row where the backend has it,
    else `decode` and argmax), once with rows of one length (the backend's batch path) and once
    with rows at different positions (its ragged path, what staggered clients give); and the
    head's part alone (the backend's `logits`, or its int8 `screen` for a single greedy row).
    Pieces of the per-token cost, for the report; the backend is the server's internal API, so
    a change there is reported, not fatal."""
    from gptforge.modeling.gpt import head_logits

    def median_ms(fn, n=48, warm=8):
        for _ in range(warm):
            fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return round(1000 * statistics.median(ts), 3)

    try:
        from gptforge.serve.backends import GPTBackend
    except ImportError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    out: dict = {}
    for b in batch_sizes:
        row: dict = {}
        try:
            backend = GPTBackend(model, max(args.max_batch, b))
            screen = getattr(backend, "screen", None) if b == 1 and hasattr(backend, "decode_greedy") else None
            x = torch.randn(b, model.config.n_embd)
            if screen is not None:
                row["head"] = "int8 screen (GreedyHead)"
                head = lambda: screen.argmax(x[0])  # noqa: E731
            elif hasattr(backend, "logits"):
                row["head"] = "backend.logits"
                head = lambda: backend.logits(x)  # noqa: E731
            else:
                row["head"] = "model.head_logits"
                head = lambda: head_logits(x, backend.head)  # noqa: E731
            with torch.inference_mode():
                row["head_ms"] = median_ms(head)
            for kind in ("aligned", "ragged") if b > 1 else ("aligned",):
                backend = GPTBackend(model, max(args.max_batch, b))
                # ragged: prompts of different lengths, so the rows sit at different positions
                toks = [int(backend.add(ids + ids[:r % len(ids)] if kind == "ragged" else ids).argmax())
                        for r in range(b)]
                state = {"toks": toks}

                def step():
                    backend.keep(list(range(b)))
                    if b == 1 and hasattr(backend, "decode_greedy"):
                        state["toks"] = [backend.decode_greedy(state["toks"][0])]
                    else:
                        state["toks"] = backend.decode(state["toks"]).argmax(dim=-1).tolist()
                row[f"step_{kind}_ms"] = median_ms(step)
        except Exception as e:  # noqa: BLE001 (the server's API moved: say so in the report)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        out[f"b{b}"] = row
    return out


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
    others = sorted((v for k, v in cpu.items() if k != "main"), reverse=True)
    return {"main": round(cpu.get("main", 0.0) / wall, 3), "worker": round((others[0] if others else 0.0) / wall, 3),
            "rest": round(sum(others[1:]) / wall, 3)}


def measure_levels(port: int, server_pid: int, args, body: bytes, levels: list[int]) -> dict:
    by_level: dict[int, list] = {c: [] for c in levels}
    for _ in range(args.rounds):
        for c in levels:
            s0, c0 = thread_cpu(server_pid), time.process_time()
            wall, raws = asyncio.run(run_level(port, c, args.requests, body))
            s1, c1 = thread_cpu(server_pid), time.process_time()
            parsed = [parse(r) for r in raws]
            by_level[c].append({"wall_s": wall, "parsed": parsed, "server_cpu_s": cpu_delta(s0, s1),
                                "client_cpu_s": c1 - c0,
                                "tokens": sum(p.get("completion_tokens") or 0 for p in parsed)})
    return by_level


def pick_prompt(model: GPT, enc, args) -> tuple[str, list[int]]:
    """The prompt, checked: its greedy continuation must not reach end-of-text within max_tokens
    (the server stops there, direct `generate` would not)."""
    ids = enc.encode_ordinary(args.prompt)
    out = generate(model, torch.tensor([ids]), args.max_tokens, temperature=0)[0, len(ids):].tolist()
    if enc.eot_token in out:
        raise SystemExit(f"bench_serve: the greedy continuation of --prompt {args.prompt!r} reaches end-of-text "
                         f"after {out.index(enc.eot_token)} tokens; pick another prompt or fewer --max-tokens")
    return args.prompt, ids


def _clients_axis(ax, xs: list[int], ylabel: str) -> None:
    """The shared look of both panels: clients on a log2 axis, y from 0, legend, light grid."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    levels = result["levels"]
    xs = [lv["clients"] for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [lv["aggregate_tokens_per_sec"] for lv in levels], "o-", label="gptforge serve (streaming)")
    direct = result["direct_generate"]
    bs = sorted(v["batch"] for k, v in direct.items() if k.startswith("b"))
    a.plot(bs, [direct[f"b{b}"]["tokens_per_sec"] for b in bs], "s--", label="direct generate, batch = clients")
    _clients_axis(a, xs, "aggregate tokens/s")
    b.plot(xs, [lv["ttft_ms"]["p95"] for lv in levels], "o-", label="p95")
    b.plot(xs, [lv["ttft_ms"]["p50"] for lv in levels], "o:", label="p50")
    b.axhline(1000, color="r", lw=0.8, ls="--", label="target (p95 < 1 s)")
    _clients_axis(b, xs, "time to first token (ms)")
    m = result["model"]
    fig.suptitle(f"gptforge serve, tiny model ({m['n_layer']}x{m['n_head']}x{m['n_embd']}), "
                 f"{result['settings']['max_tokens']} tokens per request, {result['machine']['cpu_count']} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def where_the_time_goes(result: dict) -> str:
    """The measured pieces put side by side (the numbers only; the reading is the reader's)."""
    levels = {lv["clients"]: lv for lv in result["levels"]}
    direct, alone = result["direct_generate"], result.get("server_step_alone_ms") or {}
    n = result["settings"]["max_tokens"]
    lines = []
    one = levels.get(1)
    if one and one["aggregate_tokens_per_sec"]:
        t_srv = 1000 / one["aggregate_tokens_per_sec"]
        t_dir = 1000 / direct["b1"]["tokens_per_sec"]
        a1 = alone.get("b1") or {}
        text = (f"**One client**: {t_srv:.2f} ms per token through the server against {t_dir:.2f} ms in direct "
                f"`generate` (same weights, prompt and greedy tokens, prefill included in both): the server adds "
                f"{t_srv - t_dir:.2f} ms per token.")
        if a1.get("step_aligned_ms") is not None:
            head = ("the int8 screen of the head (`GreedyHead`, as direct `generate` uses at batch 1)"
                    if a1.get("head", "").startswith("int8") else
                    "the float32 50257-row head's product (direct `generate` reads an int8 copy, `GreedyHead`)")
            text += (f" The server's model step alone (its backend's decode and greedy pick, no HTTP, in this "
                     f"process) takes {a1['step_aligned_ms']:.2f} ms at one row, of which {head} is "
                     f"{a1['head_ms']:.2f} ms. The rest, "
                     f"{t_srv - a1['step_aligned_ms']:.2f} ms per token, is the serving around the step: the "
                     f"hand-off of each step's tokens from the engine thread to the event loop, detokenizing, the JSON chunk, the SSE "
                     f"write, and the request's time to first text ({one['ttft_ms']['p50']:.1f} ms p50 per "
                     f"{n}-token request: {one['ttft_ms']['p50'] / n:.2f} ms per token).")
        text += (f" Server threads: {_threads(one)}; {one['server_cores_busy']:.2f} cores busy, the client "
                 f"{one['client_cores_busy']:.2f}.")
        lines.append(text)
    top = max(levels)
    hi, ref, at = levels[top], direct.get(f"b{top}"), alone.get(f"b{top}") or {}
    if ref and top != 1:
        text = (f"**{top} clients**: {hi['aggregate_tokens_per_sec']:.0f} tokens/s against "
                f"{ref['tokens_per_sec']:.0f} for direct `generate` at batch {top} "
                f"({1000 * ref['median_s'] / n:.2f} ms per step of {top} tokens).")
        if at.get("step_ragged_ms") is not None:
            text += (f" The server's step alone at {top} rows takes {at['step_aligned_ms']:.2f} ms with rows of one "
                     f"length and {at['step_ragged_ms']:.2f} ms with rows at different positions (what staggered "
                     f"clients give: a mask per row), of which the head's product (the float32 head) is "
                     f"{at['head_ms']:.2f} ms: a "
                     f"ceiling of {top * 1000 / at['step_ragged_ms']:.0f} tokens/s before any HTTP.")
        text += (f" Server threads: {_threads(hi)}; {hi['server_cores_busy']:.2f} cores busy, the client "
                 f"{hi['client_cores_busy']:.2f}, of the machine's {result['machine']['cpu_count']}.")
        lines.append(text)
    roles = [(c, lv["server_cores_by_role"]) for c, lv in sorted(levels.items())]
    lines.append(
        "**Threads**: the event loop and the engine's worker together kept "
        + ", ".join(f"{r['main'] + r['worker']:.2f}" for _, r in roles)
        + f" cores busy at {', '.join(str(c) for c, _ in roles)} clients, torch's other threads "
        + ", ".join(f"{r['rest']:.2f}" for _, r in roles)
        + ". Python runs one thread of a process at a time (the GIL), and a tiny-model step is mostly short "
          "operations dispatched from Python: the event loop's work per token (detokenizing, JSON, the SSE "
          "write) and the worker's step take turns on one core rather than overlapping.")
    return "\n\n".join(lines)


def _threads(level: dict) -> str:
    """CPU seconds by thread: `main` is the event loop (HTTP, SSE, JSON, detokenizing); the
    others are the engine's worker thread (the model step) and torch's intra-op threads."""
    items = sorted(level["server_cpu_s_by_thread"].items(), key=lambda kv: -kv[1])
    total = sum(v for _, v in items) or 1.0
    main = level["server_cpu_s_by_thread"].get("main", 0.0)
    others = [v for k, v in items if k != "main"]
    return (f"the event loop (main thread) {100 * main / total:.0f}% of the server's CPU time, the other "
            f"{len(others)} thread(s) (the engine's worker, torch's) "
            + "/".join(f"{100 * v / total:.0f}%" for v in others[:3]))


def _alone_row(alone: dict) -> str:
    if "error" in alone:
        return f"not measured ({alone['error']})"
    parts = []
    for key, row in alone.items():
        steps = " / ".join(f"{row[k]:.2f} {k.split('_')[1]}" for k in ("step_aligned_ms", "step_ragged_ms")
                           if row.get(k) is not None)
        if "error" in row:
            parts.append(f"batch {key[1:]}: not measured ({row['error']})")
            continue
        parts.append(f"batch {key[1:]}: step {steps or 'n/a'}, head {row['head_ms']:.2f} ({row['head']})")
    return "; ".join(parts)


def markdown(result: dict) -> str:
    m, mach, s, t = result["model"], result["machine"], result["settings"], result["targets"]
    direct = result["direct_generate"]
    rows = ["| clients | requests | tokens/request | aggregate tokens/s | vs 1 client | TTFT p50 / p95 (ms) "
            "| ITL p50 / p95 (ms) | tokens/event | errors | server cores | client cores |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = result["levels"][0]["aggregate_tokens_per_sec"] or 1.0
    for lv in result["levels"]:
        tpr = lv["completion_tokens_per_request"]
        tpr = str(tpr["min"]) if tpr["min"] == tpr["max"] else f"{tpr['min']}-{tpr['max']}"
        rows.append(f"| {lv['clients']} | {lv['requests']} | {tpr} | {lv['aggregate_tokens_per_sec']:.0f} | "
                    f"{lv['aggregate_tokens_per_sec'] / base:.2f}x | {lv['ttft_ms']['p50']} / {lv['ttft_ms']['p95']} | "
                    f"{lv['itl_ms']['p50']} / {lv['itl_ms']['p95']} | {lv['tokens_per_event']} | {lv['errors']} | "
                    f"{lv['server_cores_busy']} | {lv['client_cores_busy']} |")
    drow = ", ".join(f"batch {v['batch']} {v['tokens_per_sec']:.0f}" for k, v in direct.items() if k.startswith("b"))
    met = lambda ok: "met" if ok else "**missed**"  # noqa: E731
    return "\n".join([
        "# `gptforge serve` on the CPU: concurrent streaming clients, tiny model",
        "",
        f"- date: {result['date']}; machine: {mach['processor'] or mach['machine']}, {mach['cpu_count']} cores "
        f"({mach['machine']}, {mach['platform']}); load average (1 min) before/after: {result['load_average_1min']}",
        f"- torch {mach['torch']}, Python {mach['python']}; server OMP_NUM_THREADS {result['server']['omp_num_threads']}; "
        f"commit {result['commit']}{' with uncommitted changes under src/gptforge' if result['uncommitted_server_changes'] else ''}",
        f"- model: bench_generate's `tiny` ({m['n_layer']} layers x {m['n_head']} heads x {m['n_embd']}, block "
        f"{m['block_size']}, random weights, seed {s['seed']}, {m['params'] / 1e6:.1f}M parameters), GPT-2 tokenizer; "
        f"`gptforge serve --max-batch {s['max_batch']}`",
        f"- each request: `POST /v1/completions`, stream, temperature 0, prompt {s['prompt']!r} "
        f"({s['prompt_tokens']} tokens), max_tokens {s['max_tokens']}; {s['requests_per_client']} requests per client "
        f"in turn on one keep-alive connection; {s['rounds']} rounds of the levels in turn (aggregate: median "
        f"over rounds; latencies: over all requests of all rounds)",
        "",
        *rows,
        "",
        f"Direct `generate` (bench_generate's warm greedy measurement, same weights and prompt, {s['repeats']} "
        f"repeats, median), tokens/s: {drow}.",
        "",
        f"The server's model step alone (its backend's decode + argmax in this process, no HTTP; median ms): "
        f"{_alone_row(result.get('server_step_alone_ms') or {})}.",
        "",
        f"Targets (issue 18): aggregate at {t['top_clients']} clients / 1 client = {t['scaling']:.2f} (>= 6: "
        f"{met(t['scaling_met'])}); 1 client / direct batch-1 greedy = {t['single_vs_generate']:.3f} (>= 0.5: "
        f"{met(t['single_met'])}); worst p95 TTFT {t['worst_p95_ttft_ms']:.0f} ms (< 1000: {met(t['ttft_met'])}); "
        f"errors {t['errors']} ({met(t['errors_met'])}). Greedy text through the server equals direct `generate`'s: "
        f"{result['same_text_as_generate']}.",
        "",
        "## Where the time goes",
        "",
        where_the_time_goes(result),
        "",
        f"Command: `{result['command']}`",
        "",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,4,16", help="comma-separated concurrency levels (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=8, help="requests per client per round (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the levels in turn (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--repeats", type=int, default=15, help="direct generate's timing rounds (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1337, help="the weights' seed (bench_generate's default)")
    ap.add_argument("--tokenizer-path", default=None,
                    help="default: params.yaml's tokenizer.path (resolved), else tiktoken's gpt2")
    ap.add_argument("--server-threads", type=int, default=None,
                    help="OMP_NUM_THREADS for the server (default: torch's own choice)")
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--profile", default=None, metavar="DIR", help="cProfile every server thread into DIR")
    ap.add_argument("--out", default=None, help="also write this JSON, a markdown table (.md) and a plot (.png)")
    args = ap.parse_args()
    levels = sorted({int(c) for c in args.clients.split(",")})
    if levels[0] < 1 or args.requests < 1 or args.rounds < 1 or args.max_tokens < 1:
        ap.error("--clients, --requests, --rounds and --max-tokens must be >= 1")
    if args.tokenizer_path is None and (ROOT / "params.yaml").is_file():
        args.tokenizer_path = load_config(ROOT / "params.yaml").tokenizer.path
    load_before = round(os.getloadavg()[0], 2)

    torch.manual_seed(args.seed)  # as bench_generate: the same seed gives the same weights
    cfg = CONFIGS["tiny"]
    model = GPT(cfg).eval()
    enc = load_tokenizer(args.tokenizer_path)
    if args.max_tokens + len(enc.encode_ordinary(args.prompt)) > cfg.block_size:
        ap.error(f"prompt + --max-tokens must fit in the block size {cfg.block_size}")
    prompt, ids = pick_prompt(model, enc, args)
    direct = direct_generate(model, ids, args, levels if 1 in levels else [1, *levels])
    expected_text = enc.decode(direct.pop("new_ids"))
    pieces = step_alone(model, ids, args, levels)

    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        tmp = Path(tmp)
        ckpt = save_model(model, tmp / "tiny")
        port = free_port()
        log_path = tmp / "server.log"
        t_start = time.perf_counter()
        proc = start_server(ckpt, port, args, log_path)
        try:
            health = wait_healthy(proc, port, log_path, args.startup_timeout)
            startup_s = time.perf_counter() - t_start
            body = request_body(args, prompt)
            # Warm-up: one request alone, then one per batch slot at once (not timed).
            for c in (1, args.max_batch):
                _, raws = asyncio.run(run_level(port, c, 1, body))
                bad = [p["error"] for p in map(parse, raws) if "error" in p]
                if bad:
                    raise SystemExit(f"bench_serve: warm-up request failed: {bad[0]}\n{log_tail(log_path)}")
            idle0 = thread_cpu(proc.pid)
            time.sleep(1.0)
            idle_cpu = sum(cpu_delta(idle0, thread_cpu(proc.pid)).values())
            server_threads = psutil.Process(proc.pid).num_threads()
            by_level = measure_levels(port, proc.pid, args, body, levels)
        finally:
            stop_server(proc)
        server_log = log_tail(log_path, 4000)

    summaries = []
    for c in levels:
        s = summarize(c, by_level[c])
        texts = {p["text"] for r in by_level[c] for p in r["parsed"] if "error" not in p}
        s["same_text_as_generate"] = texts == {expected_text}
        summaries.append(s)
    agg = {s["clients"]: s["aggregate_tokens_per_sec"] for s in summaries}
    top = levels[-1]
    scaling = agg[top] / agg[levels[0]] if agg[levels[0]] else 0.0
    single = agg.get(1, 0.0) / direct["b1"]["tokens_per_sec"]
    worst_ttft = max((s["ttft_ms"]["p95"] or 0.0) for s in summaries)
    errors = sum(s["errors"] for s in summaries)
    result = {
        "benchmark": "serve",
        "config": "tiny",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "machine": platform.machine(),
                    "processor": _cpu_model(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "client_torch_threads": torch.get_num_threads()},
        "model": {**cfg.to_dict(), "params": model.num_params(non_embedding=False)},
        "settings": {"clients": levels, "requests_per_client": args.requests, "rounds": args.rounds,
                     "max_tokens": args.max_tokens, "max_batch": args.max_batch, "prompt": prompt,
                     "prompt_tokens": len(ids), "temperature": 0, "endpoint": "/v1/completions", "stream": True,
                     "repeats": args.repeats, "seed": args.seed, "tokenizer_path": _short(args.tokenizer_path),
                     "server_threads_env": args.server_threads, "profiled": bool(args.profile),
                     "client": "asyncio streams, HTTP/1.1 keep-alive, events parsed after each level"},
        "server": {"health": health, "startup_s": round(startup_s, 2), "idle_cpu_cores": round(idle_cpu, 3),
                   "omp_num_threads": args.server_threads or "unset (torch's default)",
                   "os_threads": server_threads, "log_tail": server_log[-1500:]},
        "direct_generate": direct,
        "server_step_alone_ms": pieces,
        "levels": summaries,
        "targets": {"top_clients": top, "scaling": round(scaling, 3), "scaling_met": scaling >= 6,
                    "single_vs_generate": round(single, 3), "single_met": single >= 0.5,
                    "worst_p95_ttft_ms": worst_ttft, "ttft_met": worst_ttft < 1000,
                    "errors": errors, "errors_met": errors == 0},
        "same_text_as_generate": all(s["same_text_as_generate"] for s in summaries),
        "load_average_1min": [load_before, round(os.getloadavg()[0], 2)],
        "command": "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:]),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_server_changes": bool(_git("status", "--porcelain", "--", "src/gptforge")),
    }
    result["targets"]["all_met"] = all(result["targets"][k] for k in
                                       ("scaling_met", "single_met", "ttft_met", "errors_met"))
    text = json.dumps(result, indent=2)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
        out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
        if plot(result, out.with_suffix(".png")):
            result["plot"] = str(out.with_suffix(".png"))
    print(text)
    return 0


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _short(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
