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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
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
from serve_loads import (completion_body, long_document, long_prompt_gaps, ms, ms_stats, parse,  # noqa: E402
                         parse_plain, pct, questions, run_level, run_long_prompt, scrape_metrics, shared_prefix)

MODEL_NAME = "tiny"
LONG_NAME = "tiny-2048"
HF_NAME = "llama"
DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog"
MEASURES = ("ceiling", "levels", "user", "hf", "prefix", "long")
CONTEXT_MODELS = ("gpt", "llama")  # the 2,048-position models of prefix and long
SAMPLED_TEMPERATURE = 0.8
HF_TOP_K = 50  # transformers' default top_k when sampling; sent to gptforge serve as well
PREFIX_METRICS = ("gptforge_prefix_cache_hit_tokens_total", "gptforge_prefix_cache_query_tokens_total")
LONG_MAX_TOKENS = 4  # tokens asked of the long prompt: its first is what ends the window

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


def note(msg: str) -> None:
    """Progress on stderr (stdout carries the JSON)."""
    print(f"bench_serve [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The server processes


class ServerFailed(SystemExit):
    """A server that exited or never answered /health (a SystemExit for the scripts that import
    wait_healthy; the measures here catch it, report it and go on)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gptforge_command() -> list[str]:
    script = Path(sys.executable).with_name("gptforge")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "gptforge.cli"]


def server_env(args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    env.pop("GPTFORGE_API_KEY", None)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the server's own thread count unless asked
        env.pop(key, None)
    if getattr(args, "server_threads", None):
        env["OMP_NUM_THREADS"] = str(args.server_threads)
    return env


def _dies_with_us(sig: int):
    """A preexec_fn: the child gets `sig` when this process dies (Linux's PR_SET_PDEATHSIG), so
    that a bench killed outright (a test's timeout) leaves no server running; elsewhere nothing."""
    def preexec() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    return preexec if sys.platform.startswith("linux") else None


def start_server(ckpt: Path, port: int, args, log_path: Path, *, name: str = MODEL_NAME,
                 extra: tuple[str, ...] = (), profile: bool = True) -> subprocess.Popen:
    serve_args = ["serve", f"{name}={ckpt}", "--host", "127.0.0.1", "--port", str(port),
                  "--max-batch", str(args.max_batch)]
    if getattr(args, "prefill_chunk", None):
        serve_args += ["--prefill-chunk", str(args.prefill_chunk)]
    serve_args += list(extra)
    if args.tokenizer_path:
        serve_args += ["-S", f"tokenizer.path={args.tokenizer_path}"]
    if args.profile and profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-c", PROFILE_WRAPPER, str(Path(args.profile).resolve()), *serve_args]
    else:
        cmd = [*gptforge_command(), *serve_args]
    log = open(log_path, "wb")
    # The server's working directory is the temporary folder: no params.yaml or checkpoints of
    # the repository are read; the settings come from the command line.
    # SIGTERM when this process dies: the server shuts down as on SIGINT, and stops its engine.
    return subprocess.Popen(cmd, cwd=log_path.parent, env=server_env(args), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_dies_with_us(signal.SIGTERM))


def transformers_command() -> list[str]:
    script = Path(sys.executable).with_name("transformers")
    return [str(script)] if script.is_file() else [
        sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.argv[0] = "
        "'transformers'; sys.exit(main())"]


def start_transformers_server(folder: Path, port: int, args, log_path: Path,
                              extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """`transformers serve FOLDER --continuous-batching`: the folder is the forced model (loaded at
    start, requests must name it by the same path), offline."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cmd = [*transformers_command(), "serve", str(folder), "--continuous-batching", "--host", "127.0.0.1",
           "--port", str(port), "--device", device, *extra]
    env = {**server_env(args), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    log = open(log_path, "wb")
    # SIGKILL when this process dies: its continuous-batching thread can keep it alive after SIGINT.
    return subprocess.Popen(cmd, cwd=log_path.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_dies_with_us(signal.SIGKILL))


def log_tail(log_path: Path, n: int = 2000) -> str:
    try:
        return log_path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def last_line(log_path: Path) -> str:
    """The log's last line that says something (progress bars and blank lines skipped)."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", log_tail(log_path, 20000)) if ln.strip()]
    lines = [ln for ln in lines if not re.search(r"\d+%\|", ln)] or lines
    return lines[-1][:400] if lines else "(empty log)"


def wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"bench_serve: the server exited with {proc.returncode}:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                body = json.loads(r.read())
            if body.get("status") == "ok":
                return body
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.2)
    raise ServerFailed(f"bench_serve: no healthy /health within {timeout:.0f} s:\n{log_tail(log_path)}")


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGINT (uvicorn shuts down on it, and --profile dumps its stats), SIGKILL to the server's
    process group after `grace` s; then whatever it started and left behind in its group (an
    engine process) is given 5 s and killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait(10)
    deadline = time.monotonic() + 5.0
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(proc.pid):
        _kill_group(proc.pid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _kill_group(pgid: int) -> None:
    """The server was started in a session of its own (start_new_session): its process group
    is its pid, and holds only it and what it started."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of the server: `main` (the event loop, HTTP)
    and the others by thread id (Python's thread names do not reach the OS), then the threads of
    the processes it started (an engine process: `child PID main`, `child PID tid T`)."""
    try:
        proc = psutil.Process(pid)
        out = {("main" if t.id == pid else f"tid {t.id}"): t.user_time + t.system_time for t in proc.threads()}
        children = proc.children(recursive=True)
    except psutil.Error:
        return {}
    for child in children:
        try:
            for t in child.threads():
                out[f"child {child.pid} " + ("main" if t.id == child.pid else f"tid {t.id}")] = t.user_time + t.system_time
        except psutil.Error:
            pass
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    names = set(before) | set(after)
    return {n: round(after.get(n, 0.0) - before.get(n, 0.0), 3) for n in sorted(names)
            if after.get(n, 0.0) - before.get(n, 0.0) > 0.0005}


@contextlib.contextmanager
def serving(kind: str, path: Path, args, tmp: Path, label: str, *, name: str | None = None,
            extra: tuple[str, ...] = (), profile: bool = False):
    """One server alone on the machine for the `with` block: `gptforge` (NAME=PATH) or
    `transformers` (the folder). Yields what the measures need: port, pid, the model field of
    the requests, the log, the startup time."""
    port, log_path = free_port(), tmp / f"{label}.log"
    t0 = time.perf_counter()
    if kind == "gptforge":
        proc = start_server(path, port, args, log_path, name=name, extra=extra, profile=profile)
    else:
        proc = start_transformers_server(path, port, args, log_path, extra=extra)
    note(f"{label}: starting {' '.join(map(str, proc.args[-12:]))}")
    try:
        try:
            health = wait_healthy(proc, port, log_path, args.startup_timeout)
        except ServerFailed:
            why = f"exited with {proc.returncode}" if proc.poll() is not None else "no healthy /health"
            raise ServerFailed(f"{label}: the server did not start ({why}): {last_line(log_path)}") from None
        yield types.SimpleNamespace(kind=kind, label=label, port=port, pid=proc.pid, log=log_path,
                                    model=name if kind == "gptforge" else str(path), health=health,
                                    startup_s=round(time.perf_counter() - t0, 2),
                                    flags=[*(["--prefill-chunk", str(args.prefill_chunk)] if kind == "gptforge"
                                             and args.prefill_chunk else []), *extra])
    finally:
        stop_server(proc, grace=30.0 if kind == "gptforge" else 10.0)


def run_session(open_session, jobs: list[tuple[str, object]], out: dict) -> None:
    """Start a server (`open_session()`, a context manager), run `jobs` ((key, fn(session)) in
    order) against it, each guarded: an error is recorded under its key and the next goes on. A
    server that does not start gives its error to every job."""
    if not jobs:
        return
    try:
        with open_session() as s:
            for key, fn in jobs:
                note(f"{s.label}: {key}")
                try:
                    out[key] = fn(s)
                except (Exception, ServerFailed) as e:  # noqa: BLE001 (reported, the others go on)
                    out[key] = {"error": f"{type(e).__name__}: {e}"[:1000]}
                    note(f"{s.label}: {key} failed: {out[key]['error'][:300]}")
    except (Exception, ServerFailed) as e:  # noqa: BLE001
        msg = str(e) if isinstance(e, ServerFailed) else f"{type(e).__name__}: {e}"
        note(msg[:400])
        for key, _ in jobs:
            out.setdefault(key, {"error": msg[:1000]})


# ---------------------------------------------------------------------------------------------
# Models


def tiny_model(args, block_size: int | None = None) -> GPT:
    """bench_generate's tiny GPT from `--seed` (as bench_generate: the same seed, the same
    weights), optionally with another block size."""
    torch.manual_seed(args.seed)
    cfg = CONFIGS["tiny"] if block_size is None else dataclasses.replace(CONFIGS["tiny"], block_size=block_size)
    return GPT(cfg).eval()


def tokenizer_folder(args) -> Path:
    """The GPT-2 BPE files (encoder.json + vocab.bpe) for the Llama folder's tokenizer: the
    project's tokenizer when it is such a folder, else the embedded sample."""
    if args.tokenizer_path and (Path(args.tokenizer_path) / "encoder.json").is_file():
        return Path(args.tokenizer_path)
    from gptforge.samples import resolve
    return Path(resolve("sample://gpt2_tokenizer"))


def make_llama_folder(folder: Path, args) -> dict:
    """A random Llama of about the tiny GPT's cost, saved with the GPT-2 tokenizer in `folder`."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    shape = dict(vocab_size=50257, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 bos_token_id=50256, eos_token_id=50256, tie_word_embeddings=True)
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    # Sampling settings of the folder: transformers serve samples only where the generation
    # config says do_sample (a request's temperature alone does not switch it on).
    model.generation_config.do_sample = True
    model.generation_config.temperature = SAMPLED_TEMPERATURE
    model.generation_config.top_k = HF_TOP_K
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    src = tokenizer_folder(args)
    with tempfile.TemporaryDirectory() as tmp:
        # In a folder of its own, where a GPT-2 config.json makes AutoTokenizer pick GPT-2's class.
        shutil.copy(src / "encoder.json", Path(tmp) / "vocab.json")
        shutil.copy(src / "vocab.bpe", Path(tmp) / "merges.txt")
        (Path(tmp) / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        AutoTokenizer.from_pretrained(tmp).save_pretrained(str(folder))
    return {**shape, "architecture": "LlamaForCausalLM", "params": sum(p.numel() for p in model.parameters()),
            "generation_config": {"do_sample": True, "top_k": HF_TOP_K}}


# ---------------------------------------------------------------------------------------------
# ceiling: direct generate, the server's step alone


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
    after 8): `serve.gpt_backend.GPTBackend` decoding `batch_sizes` rows and picking each row's
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

    from gptforge.serve.gpt_backend import GPTBackend

    def add(backend, prompt_ids: list[int]) -> torch.Tensor:  # a row for a prompt: its next-token logits
        backend.open_row()
        return backend.forward([(backend.rows - 1, prompt_ids)])[0]

    def decode(backend, toks: list[int]) -> torch.Tensor:  # one token per row: (rows, vocab) logits
        return backend.forward([(i, [t]) for i, t in enumerate(toks)])
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
                toks = [int(add(backend, ids + ids[:r % len(ids)] if kind == "ragged" else ids).argmax())
                        for r in range(b)]
                state = {"toks": toks}

                def step():
                    backend.keep(list(range(b)))
                    if b == 1 and hasattr(backend, "decode_greedy"):
                        state["toks"] = [backend.decode_greedy(state["toks"][0])]
                    else:
                        state["toks"] = decode(backend, state["toks"]).argmax(dim=-1).tolist()
                row[f"step_{kind}_ms"] = median_ms(step)
        except Exception as e:  # noqa: BLE001 (the server's API moved: say so in the report)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        out[f"b{b}"] = row
    return out


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


def timed_level(port: int, server_pid: int, clients: int, requests: int, body, parser=parse,
                path: str = "/v1/completions") -> dict:
    """One level: the wall time, the parsed results, the server's and this process's CPU."""
    s0, c0 = thread_cpu(server_pid), time.process_time()
    wall, raws = asyncio.run(run_level(port, clients, requests, body, path))
    s1, c1 = thread_cpu(server_pid), time.process_time()
    parsed = [parser(r) for r in raws]
    return {"wall_s": wall, "parsed": parsed, "server_cpu_s": cpu_delta(s0, s1), "client_cpu_s": c1 - c0,
            "tokens": sum(p.get("completion_tokens") or 0 for p in parsed)}


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
    out = generate(model, torch.tensor([ids]), args.max_tokens, temperature=0)[0, len(ids):].tolist()
    if enc.eot_token in out:
        raise SystemExit(f"bench_serve: the greedy continuation of --prompt {args.prompt!r} reaches end-of-text "
                         f"after {out.index(enc.eot_token)} tokens; pick another prompt or fewer --max-tokens")
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
    return {"levels": summaries,
            "server": {"health": s.health, "startup_s": s.startup_s, "idle_cpu_cores": round(idle_cpu, 3),
                       "omp_num_threads": args.server_threads or "unset (torch's default)", "os_threads": os_threads,
                       "flags": s.flags, "log_tail": log_tail(s.log, 1500)}}


# ---------------------------------------------------------------------------------------------
# user: next to `gptforge generate`


def run_generate_cli(ckpt: Path, prompt: str, args, cwd: Path, extra: tuple[str, ...] = ()) -> dict:
    """`gptforge generate PROMPT --temperature 0 --max-new-tokens N` on the checkpoint, as a user
    runs it; the tokens and seconds it prints on stderr (model loading excluded)."""
    cmd = [*gptforge_command(), "generate", prompt, "--checkpoint", str(ckpt), "--temperature", "0",
           "--max-new-tokens", str(args.max_tokens), *extra]
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
    return {"tokens": tokens, "seconds": seconds, "printed_tokens_per_sec": float(m.group(3)),
            "tokens_per_sec": round(tokens / seconds, 2) if seconds else float(m.group(3)),
            "text": done.stdout[:-1] if done.stdout.endswith("\n") else done.stdout}


def user_measure(s, args, ckpt: Path, prompt: str, streams: int, cwd: Path) -> dict:
    greedy = request_body(args, prompt)

    def sampled(r: int) -> list[list[bytes]]:
        return [[completion_body(MODEL_NAME, prompt, args.max_tokens, temperature=SAMPLED_TEMPERATURE,
                                 seed=args.seed + 1000 * r + i)] for i in range(streams)]

    warm_up(s, greedy, sampled(-1), streams)
    rounds = []
    for r in range(args.user_rounds):
        cli = run_generate_cli(ckpt, prompt, args, cwd)
        one = timed_level(s.port, s.pid, 1, 1, greedy)["parsed"][0]
        many = timed_level(s.port, s.pid, streams, 1, sampled(r))
        errors = [p["error"] for p in many["parsed"] if "error" in p]
        rounds.append({
            "cli": {k: v for k, v in cli.items() if k != "text"},
            "cli_same_text_as_server": ("error" not in cli and "error" not in one and cli["text"] == one["text"]),
            "single_stream": ({"error": one["error"]} if "error" in one else
                              {"tokens": one["completion_tokens"], "seconds": round(one["total_seconds"], 4),
                               "tokens_per_sec": round(one["completion_tokens"] / one["total_seconds"], 2),
                               "ttft_ms": ms(one["ttft"])}),
            "sampled_streams": {"streams": streams, "tokens": many["tokens"], "wall_s": round(many["wall_s"], 4),
                                "aggregate_tokens_per_sec": round(many["tokens"] / many["wall_s"], 2),
                                "errors": len(errors), "error_examples": sorted(set(errors))[:3]},
        })

    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    cli_tps = med([r["cli"].get("tokens_per_sec") for r in rounds])
    one_tps = med([r["single_stream"].get("tokens_per_sec") for r in rounds])
    many_tps = med([r["sampled_streams"]["aggregate_tokens_per_sec"] for r in rounds
                    if not r["sampled_streams"]["errors"]])
    return {"cli_tokens_per_sec": cli_tps, "single_stream_tokens_per_sec": one_tps,
            "sampled_streams_tokens_per_sec": many_tps, "streams": streams,
            "single_vs_cli": round(one_tps / cli_tps, 3) if cli_tps and one_tps else None,
            "sampled_vs_cli": round(many_tps / cli_tps, 3) if cli_tps and many_tps else None,
            "cli_errors": sorted({r["cli"]["error"] for r in rounds if "error" in r["cli"]}),
            "cli_same_text_as_server": all(r["cli_same_text_as_server"] for r in rounds),
            "rounds": rounds}


# ---------------------------------------------------------------------------------------------
# hf: gptforge serve and transformers serve on the Llama folder


def hf_measure(s, args, levels: list[int], *, extra: dict) -> dict:
    """The same load on either server: for each round, level and mode (non-streamed `plain`,
    streamed `stream`), the level's clients each sending `--hf-requests` sampled requests."""
    modes = ("plain", "stream")
    stream_parser = (lambda raw: parse(raw, require_done=False)) if s.kind == "transformers" else parse

    def bodies(mode: str, clients: int, r: int) -> list[list[bytes]]:
        return [[completion_body(s.model, args.prompt, args.max_tokens, temperature=SAMPLED_TEMPERATURE,
                                 stream=mode == "stream", seed=args.seed + 10000 * (r + 1) + 100 * i + j, **extra)
                 for j in range(args.hf_requests)] for i in range(clients)]

    top = max(levels)
    warm_up(s, bodies("plain", 1, -1)[0][0], bodies("plain", top, -1), top, parse_plain)
    warm_up(s, bodies("stream", 1, -1)[0][0], bodies("stream", top, -1), top, stream_parser)
    runs: dict[tuple[str, int], list] = {(m, c): [] for c in levels for m in modes}
    for r in range(args.hf_rounds):
        for c in levels:
            for m in modes:
                runs[(m, c)].append(timed_level(s.port, s.pid, c, args.hf_requests, bodies(m, c, r),
                                                parse_plain if m == "plain" else stream_parser))
    rows = []
    for (m, c), rs in runs.items():
        parsed = [p for r in rs for p in r["parsed"]]
        ok = [p for p in parsed if "error" not in p]
        errors = [p["error"] for p in parsed if "error" in p]
        tokens = [p["completion_tokens"] for p in ok]
        wall = sum(r["wall_s"] for r in rs)
        cpu = sum(sum(r["server_cpu_s"].values()) for r in rs)
        row = {"mode": m, "clients": c, "requests": len(parsed),
               "aggregate_tokens_per_sec": round(statistics.median(r["tokens"] / r["wall_s"] for r in rs), 2),
               "aggregate_tokens_per_sec_rounds": [round(r["tokens"] / r["wall_s"], 2) for r in rs],
               "completion_tokens_per_request": {"min": min(tokens, default=None), "max": max(tokens, default=None),
                                                 "mean": round(statistics.mean(tokens), 1) if tokens else None},
               "seconds_per_request_p50": round(pct([p["seconds"] for p in ok], 0.5), 4) if ok else None,
               # sampled with a seed per request: one text for all would mean the server decoded greedily
               "distinct_texts": len({p["text"] for p in ok}),
               "errors": len(errors), "error_examples": sorted(set(errors))[:3],
               "server_cores_busy": round(cpu / wall, 3) if wall else None}
        if m == "stream":
            row["ttft_ms"] = ms_stats([p["ttft"] for p in ok if p["ttft"] is not None])
            row["itl_ms"] = ms_stats([g for p in ok for g in p["gaps"]])
        rows.append(row)
    rows.sort(key=lambda row: (row["mode"], row["clients"]))
    return {"server": s.kind, "command_flags": s.flags, "startup_s": s.startup_s, "levels": rows,
            "log_last_line": last_line(s.log)}


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
    return {"flags": s.flags, "requests": len(parsed), "errors": len(errors), "error_examples": sorted(set(errors))[:3],
            "prompt_tokens": sorted({p["prompt_tokens"] for p in ok}),
            "ttft_ms": ms_stats([p["ttft"] for p in ok if p["ttft"] is not None]),
            "itl_ms": ms_stats([g for p in ok for g in p["gaps"]]),
            "aggregate_tokens_per_sec": round(level["tokens"] / level["wall_s"], 2),
            "wall_s": round(level["wall_s"], 3),
            "server_cores_busy": round(sum(level["server_cpu_s"].values()) / level["wall_s"], 3),
            "prefix_cache_metrics": cache if cache is not None else "not on /metrics",
            "texts": [p.get("text") for p in parsed]}


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
        out["first_difference"] = {"request": diff[0], "with_cache": (diff[1] or "")[:200],
                                   "without": (diff[2] or "")[:200]}
    return out


# ---------------------------------------------------------------------------------------------
# long: a long prompt arriving while streams decode


def long_measure(s, args, encode, decode) -> dict:
    n = args.long_streams
    stream_body = completion_body(s.model, args.prompt, args.long_decode_tokens, temperature=0)

    def long_body(r: int) -> bytes:
        return completion_body(s.model, long_document(encode, decode, args.long_prompt_tokens, r), LONG_MAX_TOKENS,
                               temperature=0)

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
        rounds.append({"prefill_window_ms": ms(g["window_s"]), "long_prompt_tokens": long["prompt_tokens"],
                       "itl_p95_ms": p95, "during_over_before": round(p95["during"] / p95["before"], 3)
                       if p95["during"] and p95["before"] else None,
                       "gaps": {k: len(g[k]) for k in pooled},
                       "streams_ended_before_prefill_done": g["streams_ended_before_prefill_done"]})
    stats = {k: ms_stats(v) for k, v in pooled.items()}
    b, d = stats["before"]["p95"], stats["during"]["p95"]
    windows = [r["prefill_window_ms"] for r in rounds if "prefill_window_ms" in r]
    return {"flags": s.flags, "streams": n, "decode_tokens": args.long_decode_tokens,
            "queued": n + 1 > args.max_batch,  # more requests than batch slots: some wait, not what is meant
            "streams_ended_before_prefill_done": sum(r.get("streams_ended_before_prefill_done", 0) for r in rounds),
            "long_prompt_tokens": args.long_prompt_tokens, "sent_after_events": args.long_before,
            "itl_ms": stats, "itl_p95_during_over_before": round(d / b, 3) if b and d else None,
            "prefill_window_ms_p50": round(statistics.median(windows), 2) if windows else None,
            "errors": len(errors), "error_examples": sorted(set(errors))[:3], "rounds": rounds}


# ---------------------------------------------------------------------------------------------
# Targets


def legacy_targets(levels: list[dict], direct: dict) -> dict:
    """Issue 18's targets on the levels."""
    if not levels:
        return {}
    agg = {s["clients"]: s["aggregate_tokens_per_sec"] for s in levels}
    first, top = levels[0]["clients"], levels[-1]["clients"]
    scaling = agg[top] / agg[first] if agg[first] else 0.0
    single = agg.get(1, 0.0) / direct["b1"]["tokens_per_sec"] if direct.get("b1") else None
    worst_ttft = max((s["ttft_ms"]["p95"] or 0.0) for s in levels)
    errors = sum(s["errors"] for s in levels)
    t = {"top_clients": top, "scaling": round(scaling, 3), "scaling_met": scaling >= 6,
         "single_vs_generate": None if single is None else round(single, 3),
         "single_met": None if single is None else single >= 0.5,
         "worst_p95_ttft_ms": worst_ttft, "ttft_met": worst_ttft < 1000, "errors": errors, "errors_met": errors == 0}
    t["all_met"] = all(t[k] for k in ("scaling_met", "single_met", "ttft_met", "errors_met"))
    return t


def issue30_targets(result: dict) -> list[dict]:
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
            add("levels", f"{c} streaming client(s) / direct generate batch {c} (tokens/s)", value, ">=", 0.85,
                result.get("levels_error") or direct.get("error"))
    if "user" in sel:
        u = result.get("user") or {}
        add("user", "one greedy stream / `gptforge generate` printed tokens/s", u.get("single_vs_cli"), ">=", 0.85,
            u.get("error") or "; ".join(u.get("cli_errors") or []) or None)
        add("user", f"{u.get('streams', 16)} sampled streams together / `gptforge generate`", u.get("sampled_vs_cli"),
            ">=", 1.0, u.get("error"))
    if "hf" in sel:
        hf = result.get("hf") or {}
        err = hf.get("error") or (hf.get("transformers") or {}).get("error") or (hf.get("gptforge") or {}).get("error")
        ratios = {(r["mode"], r["clients"]): r["ratio"] for r in hf.get("ratios") or []}
        top = max(result["settings"]["clients"])
        for mode in ("plain", "stream"):
            for c, target in ((top, 1.5), (1, 1.0)):
                add("hf", f"gptforge / transformers serve, {c} client(s), "
                    f"{'non-streamed' if mode == 'plain' else 'streamed'} (tokens/s)",
                    ratios.get((mode, c)), ">=", target, err)
    for key, what in (("prefix", "p50 TTFT without / with the prefix cache"),
                      ("long", "ITL p95 during the long prefill / before it")):
        if key not in sel:
            continue
        for model, r in ((result.get(key) or {}).get("models") or {}).items():
            if key == "prefix":
                add(key, f"{model}: {what}", r.get("ttft_p50_off_over_on"), ">=", 4, r.get("error"))
                add(key, f"{model}: greedy answers the same with and without (1 = all)",
                    None if r.get("all_same") is None else float(r["all_same"]), ">=", 1, r.get("error"))
            else:
                add(key, f"{model}: {what}", r.get("itl_p95_during_over_before"), "<=", 3, r.get("error"))
    return rows


# ---------------------------------------------------------------------------------------------
# Reports


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
    for ax in axes[len(panels):]:
        ax.axis("off")
    for ax, panel in zip(axes, panels):
        if panel == "levels":
            xs = [lv["clients"] for lv in levels]
            ax.plot(xs, [lv["aggregate_tokens_per_sec"] for lv in levels], "o-", label="gptforge serve (streamed, greedy)")
            direct = result.get("direct_generate") or {}
            bs = sorted(v["batch"] for k, v in direct.items() if k.startswith("b") and isinstance(v, dict))
            if bs:
                ax.plot(bs, [direct[f"b{b}"]["tokens_per_sec"] for b in bs], "s--",
                        label="direct generate, batch = clients (ceiling)")
            u = result.get("user") or {}
            if u.get("cli_tokens_per_sec"):
                ax.axhline(u["cli_tokens_per_sec"], color="gray", lw=0.8, ls=":", label="`gptforge generate` (CLI)")
                if u.get("sampled_streams_tokens_per_sec"):
                    ax.plot([u["streams"]], [u["sampled_streams_tokens_per_sec"]], "^",
                            label=f"{u['streams']} sampled streams (T {SAMPLED_TEMPERATURE})")
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
                        ax.plot(*zip(*pts), style + ls, label=f"{server} serve, "
                                f"{'non-streamed' if mode == 'plain' else 'streamed'}")
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
            bars += [(f"{model} prefix, cache", on["ttft_ms"]["p50"]), (f"{model} prefix, no cache", off["ttft_ms"]["p50"])]
    for model, r in ((result.get("long") or {}).get("models") or {}).items():
        itl = r.get("itl_ms") or {}
        if (itl.get("before") or {}).get("p95") and (itl.get("during") or {}).get("p95"):
            bars += [(f"{model} ITL before long", itl["before"]["p95"]), (f"{model} ITL during long", itl["during"]["p95"])]
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
                     f"{t_srv - a1['step_aligned_ms']:.2f} ms per token, is the serving around the step: each "
                     f"step's tokens crossing from the engine process to the API process, detokenizing, the JSON "
                     f"chunk, the SSE write (a send to the socket per token), the two processes sharing the "
                     f"machine's cores, and the request's time to first text ({one['ttft_ms']['p50']:.1f} ms p50 per "
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
        "**Processes**: the API process (HTTP, SSE, JSON, detokenizing) kept "
        + ", ".join(f"{r['main']:.2f}" for _, r in roles)
        + f" cores busy at {', '.join(str(c) for c, _ in roles)} clients, the engine process's loop "
        + ", ".join(f"{r['worker']:.2f}" for _, r in roles)
        + " and torch's other intra-op threads there "
        + ", ".join(f"{r['rest']:.2f}" for _, r in roles)
        + ". The two no longer share an interpreter lock, but on a machine of two cores the API process's "
          "work per token takes some of the core that the engine's second intra-op thread would use.")
    return "\n\n".join(lines)


def _threads(level: dict) -> str:
    """Shares of the server's CPU time: the API process (its event loop, HTTP, SSE, JSON,
    detokenizing) and the engine process's threads (its loop and torch's intra-op threads)."""
    cpu = level["server_cpu_s_by_thread"]
    total = sum(cpu.values()) or 1.0
    api = sum(v for k, v in cpu.items() if not k.startswith("child "))
    engine = sorted((v for k, v in cpu.items() if k.startswith("child ")), reverse=True)
    return (f"the API process {100 * api / total:.0f}% of the server's CPU time, the engine process's "
            f"{len(engine)} busy thread(s) " + "/".join(f"{100 * v / total:.0f}%" for v in engine[:3]))


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
    drow = ", ".join(f"batch {v['batch']} {v['tokens_per_sec']:.0f}" for k, v in direct.items()
                     if k.startswith("b") and isinstance(v, dict))
    single = (f"1 client / direct batch-1 greedy = {t['single_vs_generate']:.3f} (>= 0.5: {_met(t['single_met'])})"
              if t.get("single_vs_generate") is not None else "1 client / direct batch 1: not measured (no ceiling)")
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
        (f"Direct `generate` (bench_generate's warm greedy measurement, same weights and prompt, {s['repeats']} "
         f"repeats, median), tokens/s: {drow}." if drow else "Direct `generate`: not measured (`ceiling` not run)."),
        "",
        f"The server's model step alone (its backend's decode + argmax in this process, no HTTP; median ms): "
        f"{_alone_row(result.get('server_step_alone_ms') or {'error': 'ceiling not run'})}.",
        "",
        f"Targets (issue 18): aggregate at {t['top_clients']} clients / 1 client = {t['scaling']:.2f} (>= 6: "
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
        ""]
    return out


def hf_markdown(hf: dict) -> list[str]:
    out = ["## The Llama folder: gptforge serve against transformers serve (hf)", ""]
    if "error" in hf:
        return out + [f"Not measured: {hf['error']}", ""]
    m = hf["model"]
    out += [f"A random Llama ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} "
            f"heads / {m['num_key_value_heads']} key-value heads, MLP {m['intermediate_size']}, "
            f"{m['max_position_embeddings']} positions, {m['params'] / 1e6:.1f}M parameters), each server alone; "
            f"`POST /v1/completions`, temperature {SAMPLED_TEMPERATURE}, top_k {HF_TOP_K}, a seed per request, "
            f"max_tokens {hf['max_tokens']}, {hf['requests_per_client']} requests per client, {hf['rounds']} round(s); "
            f"tokens = `usage.completion_tokens`.", "",
            "| server | mode | clients | aggregate tokens/s | tokens/request (mean) | TTFT p50 / p95 (ms) "
            "| distinct answers | errors | server cores |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for server in ("gptforge", "transformers"):
        sec = hf.get(server) or {}
        if "error" in sec:
            out.append(f"| {server} serve | - | - | not measured: {sec['error'][:200]} | | | | | |")
            continue
        for r in sec.get("levels") or []:
            out.append(f"| {server} serve | {'non-streamed' if r['mode'] == 'plain' else 'streamed'} | {r['clients']} "
                       f"| {r['aggregate_tokens_per_sec']:.0f} | {_f(r['completion_tokens_per_request']['mean'], '.1f')} "
                       f"| {_pair(r.get('ttft_ms')) if r['mode'] == 'stream' else '-'} "
                       f"| {r['distinct_texts']}/{r['requests'] - r['errors']} | {r['errors']} "
                       f"| {_f(r['server_cores_busy'], '.2f')} |")
    if hf.get("ratios"):
        out += ["", "gptforge / transformers: " + "; ".join(
            f"{'non-streamed' if r['mode'] == 'plain' else 'streamed'} at {r['clients']} "
            f"{_f(r['ratio'], '.2f')}x" for r in hf["ratios"]) + " (targets: >= 1.5 at 16 clients, >= 1.0 at 1)."]
    out += ["", f"transformers serve: `{hf.get('transformers_command', '')}`"]
    return out + [""]


def prefix_markdown(p: dict) -> list[str]:
    out = ["## A shared system prompt (prefix)", ""]
    if "error" in p:
        return out + [f"Not measured: {p['error']}", ""]
    out += [f"{p['clients']} clients, {p['requests_per_client']} requests each in turn, every prompt the same "
            f"{p['prefix_tokens']}-token system prompt + a short distinct question; greedy, streamed, "
            f"max_tokens {p['max_tokens']}.", "",
            "| model | prefix cache | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | aggregate tokens/s | cache hit rate "
            "| errors |", "|---|---|---:|---:|---:|---:|---:|"]
    for model, r in p["models"].items():
        for key, label in (("with_cache", "on (default)"), ("without_cache", "off (`--prefix-cache-mb 0`)")):
            x = r.get(key) or {}
            if "error" in x:
                out.append(f"| {model} | {label} | not measured: {x['error'][:200]} | | | | |")
                continue
            c = x.get("prefix_cache_metrics")
            rate = (f"{100 * c['hit_rate']:.0f}%" if isinstance(c, dict) and c.get("hit_rate") is not None
                    else "-" if isinstance(c, dict) else "n/a")
            out.append(f"| {model} | {label} | {_pair(x.get('ttft_ms'))} | {_pair(x.get('itl_ms'))} "
                       f"| {_f(x.get('aggregate_tokens_per_sec'))} | {rate} | {x.get('errors')} |")
    out.append("")
    for model, r in p["models"].items():
        if "error" in r:
            out.append(f"- {model}: {r['error'][:300]}")
        else:
            out.append(f"- {model}: p50 TTFT without / with the cache {_f(r.get('ttft_p50_off_over_on'), '.2f')}x "
                       f"(target >= 4); greedy answers the same: {r.get('same_answers')}")
    return out + [""]


def long_markdown(lg: dict) -> list[str]:
    out = ["## A long prompt arriving while streams decode (long)", ""]
    if "error" in lg:
        return out + [f"Not measured: {lg['error']}", ""]
    out += [f"{lg['streams']} greedy streams of {lg['decode_tokens']} tokens; once each has had {lg['before']} "
            f"events, a {lg['prompt_tokens']}-token prompt arrives; {lg['rounds']} round(s); the streams' "
            f"inter-token gaps before it, during its prefill (sent -> its first token) and after. Server flags: "
            f"{lg['prefill_chunk'] or 'the default prefill chunk'}.", "",
            "| model | prefill window p50 (ms) | ITL p95 before (ms) | during | after | during / before "
            "| streams done before it | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model, r in lg["models"].items():
        if "error" in r:
            out.append(f"| {model} | not measured: {r['error'][:200]} | | | | | | |")
            continue
        itl = r["itl_ms"]
        out.append(f"| {model} | {_f(r['prefill_window_ms_p50'], '.1f')} | {_f(itl['before']['p95'], '.1f')} "
                   f"| {_f(itl['during']['p95'], '.1f')} | {_f(itl['after']['p95'], '.1f')} "
                   f"| {_f(r['itl_p95_during_over_before'], '.2f')}x | {r['streams_ended_before_prefill_done']} "
                   f"| {r['errors']} |")
        if r.get("queued"):
            out.append(f"| {model} | (--max-batch is below {r['streams']} streams + 1: requests queued, "
                       f"the figures are not the measure's) | | | | | | |")
    return out + ["", "Target: during / before <= 3. `streams done before it`: streams that ended before the long "
                  "prompt's first token (over all rounds; raise --long-decode-tokens if not 0).", ""]


def markdown(result: dict) -> str:
    mach, s = result["machine"], result["settings"]
    m = result["model"]
    lines = [
        "# `gptforge serve` on the CPU: concurrent clients, tiny models",
        "",
        f"- date: {result['date']}; machine: {mach['processor'] or mach['machine']}, {mach['cpu_count']} cores "
        f"({mach['machine']}, {mach['platform']}); load average (1 min) before/after: {result['load_average_1min']}",
        f"- torch {mach['torch']}, Python {mach['python']}; server OMP_NUM_THREADS {result['server']['omp_num_threads']}; "
        f"commit {result['commit']}{' with uncommitted changes under src/gptforge' if result['uncommitted_server_changes'] else ''}",
        f"- measures: {', '.join(result['measures'])}; gptforge serve flags: `--max-batch {s['max_batch']}`"
        + (f" `--prefill-chunk {s['prefill_chunk']}`" if s.get("prefill_chunk") else ""),
        f"- model `tiny`: bench_generate's ({m['n_layer']} layers x {m['n_head']} heads x {m['n_embd']}, block "
        f"{m['block_size']}, random weights, seed {s['seed']}, {m['params'] / 1e6:.1f}M parameters), GPT-2 tokenizer; "
        f"`tiny-2048`: the same with block 2048",
        "",
        "## Targets (issue 30)",
        "",
        "| measure | figure | value | target | |",
        "|---|---|---:|---:|---|",
    ]
    for t in result["issue30_targets"]:
        note_ = f" ({t['error'][:120]})" if t.get("error") and t["met"] is None else ""
        lines.append(f"| {t['measure']} | {t['what']} | {_f(t['value'], '.3f')} | {t['target']} | {_met(t['met'])}{note_} |")
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


# ---------------------------------------------------------------------------------------------
# main


def parse_measures(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if "all" in names:
        return list(MEASURES)
    unknown = [m for m in names if m not in MEASURES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--measures: unknown {', '.join(unknown) or '(none)'}; "
                                         f"choose from {', '.join(MEASURES)} or all")
    return [m for m in MEASURES if m in names]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--measures", type=parse_measures, default=list(MEASURES),
                    help=f"comma-separated, from {', '.join(MEASURES)}, or all")
    ap.add_argument("--clients", default="1,4,16", help="comma-separated concurrency levels (levels, hf; the top one "
                    "is the number of streams of user and of clients of prefix)")
    ap.add_argument("--requests", type=int, default=8, help="requests per client per round (levels)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the levels in turn (levels)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (levels, user, hf)")
    ap.add_argument("--max-batch", type=int, default=16, help="gptforge serve --max-batch")
    ap.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                    help="gptforge serve --prefill-chunk N for every gptforge server (default: not passed, the "
                    "server's own)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--repeats", type=int, default=15, help="direct generate's timing rounds (ceiling)")
    ap.add_argument("--user-rounds", type=int, default=3, help="rounds of CLI, one stream, sampled streams (user)")
    ap.add_argument("--hf-requests", type=int, default=2, help="requests per client per round and mode (hf)")
    ap.add_argument("--hf-rounds", type=int, default=1, help="rounds of the levels and modes (hf)")
    ap.add_argument("--context-models", default="gpt,llama",
                    help="the 2,048-position models of prefix and long: gpt (tiny-2048), llama, or both")
    ap.add_argument("--prefix-tokens", type=int, default=512, help="the shared system prompt's tokens (prefix)")
    ap.add_argument("--prefix-requests", type=int, default=4, help="requests per client (prefix)")
    ap.add_argument("--prefix-max-tokens", type=int, default=16, help="tokens per answer (prefix)")
    ap.add_argument("--long-prompt-tokens", type=int, default=1000, help="the long prompt's tokens (long)")
    ap.add_argument("--long-streams", type=int, default=8, help="streams decoding when it arrives (long)")
    ap.add_argument("--long-decode-tokens", type=int, default=256, help="tokens per decoding stream (long)")
    ap.add_argument("--long-before", type=int, default=32,
                    help="events every stream has had before the long prompt is sent (long)")
    ap.add_argument("--long-rounds", type=int, default=3, help="rounds (long)")
    ap.add_argument("--seed", type=int, default=1337, help="the weights' seed (bench_generate's default)")
    ap.add_argument("--tokenizer-path", default=None,
                    help="default: params.yaml's tokenizer.path (resolved), else tiktoken's gpt2")
    ap.add_argument("--server-threads", type=int, default=None,
                    help="OMP_NUM_THREADS for the servers (default: torch's own choice)")
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--profile", default=None, metavar="DIR", help="cProfile every thread of the `tiny` server into DIR")
    ap.add_argument("--out", default=None, help="also write this JSON, a markdown table (.md) and a plot (.png)")
    args = ap.parse_args()
    measures = args.measures
    levels = sorted({int(c) for c in args.clients.split(",")})
    counts = (levels[0], args.requests, args.rounds, args.max_tokens, args.user_rounds, args.hf_requests, args.hf_rounds,
              args.prefix_tokens, args.prefix_requests, args.prefix_max_tokens, args.long_prompt_tokens,
              args.long_streams, args.long_decode_tokens, args.long_before, args.long_rounds)
    if min(counts) < 1 or (args.prefill_chunk is not None and args.prefill_chunk < 1):
        ap.error("the counts (--clients, --requests, --rounds, --max-tokens, --*-rounds, --*-requests, --*-tokens, "
                 "--long-*, --prefill-chunk) must be >= 1")
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
        "machine": {"platform": platform.platform(), "machine": platform.machine(),
                    "processor": _cpu_model(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "client_torch_threads": torch.get_num_threads()},
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
            run_session(lambda: serving("gptforge", ckpt, args, tmp, "gptforge-tiny", name=MODEL_NAME, profile=True),
                        jobs, out)
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
                run_session(lambda: serving("gptforge", ckpt2, args, tmp, "gptforge-tiny-2048-no-prefix-cache",
                                            name=LONG_NAME, extra=no_cache),
                            [("prefix_gpt_off", lambda s: prefix_measure(s, args, top, prefix_text))], out)
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
                    run_session(lambda: serving("transformers", folder, args, tmp, "transformers-llama"),
                                [("hf_transformers", lambda s: hf_measure(s, args, levels, extra={}))], out)
                if llama_ctx and want_prefix:
                    run_session(lambda: serving("gptforge", folder, args, tmp, "gptforge-llama-no-prefix-cache",
                                                name=HF_NAME, extra=no_cache),
                                [("prefix_llama_off", lambda s: prefix_measure(s, args, top, prefix_text))], out)

    # The report
    lv = out.get("levels") or {}
    summaries = lv.get("levels") or []
    result.update({
        "model": model_info,
        "settings": {"clients": levels, "requests_per_client": args.requests, "rounds": args.rounds,
                     "max_tokens": args.max_tokens, "max_batch": args.max_batch, "prefill_chunk": args.prefill_chunk,
                     "prompt": prompt, "prompt_tokens": len(ids), "temperature": 0, "endpoint": "/v1/completions",
                     "stream": True, "repeats": args.repeats, "seed": args.seed,
                     "tokenizer_path": _short(args.tokenizer_path), "server_threads_env": args.server_threads,
                     "profiled": bool(args.profile),
                     "client": "asyncio streams, HTTP/1.1 keep-alive, events parsed after each level"},
        "server": lv.get("server") or {"omp_num_threads": args.server_threads or "unset (torch's default)"},
        "direct_generate": direct,
        "server_step_alone_ms": pieces,
        "levels": summaries,
    })
    if "levels" in measures and "error" in lv:
        result["levels_error"] = lv["error"]
    result["targets"] = legacy_targets(summaries, direct)
    result["same_text_as_generate"] = all(s["same_text_as_generate"] for s in summaries) if summaries else None
    if "user" in measures:
        result["user"] = out.get("user") or {"error": "not run"}
    if "hf" in measures:
        hf = {"model": llama_info, "endpoint": "/v1/completions", "max_tokens": args.max_tokens,
              "temperature": SAMPLED_TEMPERATURE, "top_k": HF_TOP_K, "requests_per_client": args.hf_requests,
              "rounds": args.hf_rounds, "gptforge": out.get("hf_gptforge") or {"error": "not run"},
              "transformers": out.get("hf_transformers") or {"error": "not run"},
              "transformers_command": "transformers serve FOLDER --continuous-batching --host 127.0.0.1 --port PORT "
                                      f"--device {'cuda' if torch.cuda.is_available() else 'cpu'} "
                                      "(HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1)"}
        if llama_info is None:
            hf["error"] = (out.get("hf_gptforge") or {}).get("error", "the Llama folder was not made")
        ratios = []
        rows = {srv: {(r["mode"], r["clients"]): r for r in (hf[srv].get("levels") or [])}
                for srv in ("gptforge", "transformers")}
        for mode in ("plain", "stream"):
            for c in levels:
                g, t = rows["gptforge"].get((mode, c)), rows["transformers"].get((mode, c))
                if g and t:
                    ratios.append({"mode": mode, "clients": c, "gptforge": g["aggregate_tokens_per_sec"],
                                   "transformers": t["aggregate_tokens_per_sec"],
                                   "ratio": round(g["aggregate_tokens_per_sec"] / t["aggregate_tokens_per_sec"], 3)
                                   if t["aggregate_tokens_per_sec"] else None})
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
        result["prefix"] = {"prefix_tokens": args.prefix_tokens, "clients": top,
                            "requests_per_client": args.prefix_requests, "max_tokens": args.prefix_max_tokens,
                            "metrics": list(PREFIX_METRICS), "models": models}
    if "long" in measures:
        result["long"] = {"streams": args.long_streams, "decode_tokens": args.long_decode_tokens,
                          "before": args.long_before, "prompt_tokens": args.long_prompt_tokens,
                          "rounds": args.long_rounds, "prefill_chunk": args.prefill_chunk,
                          "models": {names[m]: out.get(f"long_{m}") or {"error": "not run"} for m in context_models}}
    result["issue30_targets"] = issue30_targets(result)
    judged = [t["met"] for t in result["issue30_targets"] if t["met"] is not None]
    result["targets"]["issue30_all_met"] = bool(judged) and all(judged) and len(judged) == len(result["issue30_targets"])
    result.update({
        "wall_s": round(time.perf_counter() - t_start, 1),
        "load_average_1min": [load_before, round(os.getloadavg()[0], 2)],
        "command": "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:]),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_server_changes": bool(_git("status", "--porcelain", "--", "src/gptforge")),
    })
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
