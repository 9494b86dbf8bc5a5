"""The engine in a process of its own (vLLM V1's layout): the API process parses, tokenizes,
detokenizes and streams; this process loads the model and runs the scheduler's loop
(`serve.engine_core.serve_loop`). Before the split the two shared one interpreter lock, and on
2 cores they took turns (together 0.91-0.94 of a core busy, bench_serve.py).

The channel is a Unix socket pair carrying pickled messages (`multiprocessing.connection`, the
standard library's): one message per model step each way at most, a few hundred bytes. The pair
has no path and no port: only these two processes hold its ends, so what is unpickled there
comes from this server's own code. Against
ZeroMQ (pyzmq) it is a dependency fewer, and for messages this small no slower:
benchmarks/bench_channel.py measures both (docs/serving.md). The API side reads it on its
event loop (`loop.add_reader`), so no thread of its own waits on it.

    python -m gptforge.serve.engine_process FD

The child gets the socket as FD, reads an `EngineSpec`, loads the model, answers `Ready`
(context, n_vocab, stop_ids) or `LoadFailed` (one line), then serves (`serve.messages`). It ignores
SIGINT and SIGTERM (a Ctrl-C in the terminal, or a stop sent to the process group, reaches both
processes; the API process decides when the engine stops, after its in-flight answers, and says
so with a `Stop` message) and exits when the socket closes, so it never outlives the API
process. The API process treats the socket's end as the engine's
death: every open stream gets an error event and the server stops with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Callable

from gptforge.errors import BadInput
from gptforge.serve.engine_core import STOP_SECONDS
from gptforge.serve.messages import LoadFailed, Ready, Stop

READY_SECONDS = 600.0  # loading a model from a slow disk; the child's own errors come at once


@dataclass
class EngineSpec:
    """What the engine process loads and how it schedules."""

    kind: str  # "gptforge" or "hf"
    path: str
    device: str = "cpu"
    max_batch: int = 16
    prefill_chunk: int = 256
    prefix_cache_mb: float = 256.0
    name: str = "model"
    dtype: str = "auto"  # Hugging Face models: hf_causal.inference_dtype
    quantize: str | None = None  # "int8" / "int4": the lean decode step's linears (Llama-family Hugging Face models)
    speculate: int = 0  # a lone greedy row drafts up to this many tokens (serve.scheduler)


def build_scheduler(spec: EngineSpec):
    """(scheduler, Ready) for `spec`: the model loaded, its backend, the prefix cache."""
    import torch

    from gptforge.serve.prefix_cache import PrefixCache
    from gptforge.serve.scheduler import Scheduler

    device = torch.device(spec.device)
    if spec.kind == "gptforge":
        from gptforge.modeling.hf_causal import inference_dtype
        from gptforge.modeling.weights import load_model
        from gptforge.serve.gpt_backend import GPTBackend

        model = load_model(spec.path, map_location=device)
        if spec.dtype != "auto" or spec.quantize:  # auto alone: the checkpoint's own dtype
            model.to(inference_dtype(spec.dtype, device.type, spec.quantize))
        weights = spec.quantize or "native"
        if model.config.arch == "llama":  # served as its LlamaForCausalLM, through the lean Llama decoder
            from gptforge.modeling.hf_convert import to_hf
            from gptforge.serve.hf_backend import HFBackend

            backend = HFBackend(to_hf(model), spec.max_batch, model.config.block_size, weights=weights)
            info = Ready(model.config.block_size, model.config.n_vocab, [])
        else:
            backend = GPTBackend(model, spec.max_batch, weights)
            info = Ready(backend.context, model.config.n_vocab, [])
    else:
        from gptforge.modeling.hf_causal import inference_dtype, load_causal_lm, stop_ids
        from gptforge.serve.hf_backend import HFBackend

        dtype = inference_dtype(spec.dtype, device.type, spec.quantize)
        model, tok = load_causal_lm(spec.path, param="MODEL", dtype=dtype)
        model.to(device)
        context = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        backend = HFBackend(model, spec.max_batch, context, weights=spec.quantize or "native")
        info = Ready(context, int(model.config.vocab_size), stop_ids(tok, model))
    cache = PrefixCache(int(spec.prefix_cache_mb * (1 << 20)))
    if spec.speculate and not getattr(backend, "verifies_drafts", False):
        raise BadInput(f"--speculate runs in gptforge's lean Llama-family decoder, which does not serve {spec.path}")
    scheduler = Scheduler(backend, prefill_chunk=spec.prefill_chunk, prefix_cache=cache, speculate=spec.speculate)
    return scheduler, info


def main(fd: int) -> int:
    """The engine process (the module's docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        spec = EngineSpec(**conn.recv())
        scheduler, info = build_scheduler(spec)
    except EOFError:
        return 0
    except Exception as e:  # noqa: BLE001 - one line for the API process to print
        message = str(e) if isinstance(e, BadInput) else f"{type(e).__name__}: {e}"
        conn.send(LoadFailed(" ".join(message.split())))
        return 2
    conn.send(info)
    from gptforge.serve.engine_core import serve_loop

    def receive(block: bool) -> list:
        messages = []
        if block:
            messages.append(conn.recv())
        while conn.poll():
            messages.append(conn.recv())
        return messages

    try:
        serve_loop(scheduler, receive, conn.send)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the API process went away
        return 0
    return 0


class ProcessCore:
    """The API side's handle on an engine process (`start_engine_process` makes one)."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, info: Ready, spec: EngineSpec):
        self.proc, self.conn, self.info, self.spec = proc, conn, info, spec
        self.max_batch, self.context = spec.max_batch, info.context
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_lost: Callable[[str], None] | None = None
        self._closed = False

    def start(
        self, loop: asyncio.AbstractEventLoop, on_message: Callable[[object], None], on_lost: Callable[[str], None]
    ) -> None:
        self._loop, self._on_lost = loop, on_lost
        fd = self.conn.fileno()

        def readable() -> None:
            try:
                while self.conn.poll():
                    on_message(self.conn.recv())
            except (EOFError, OSError):
                self._gone()

        loop.add_reader(fd, readable)

    def _gone(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self.conn.fileno())
        try:
            code = self.proc.wait(timeout=5)  # its socket closed: it has exited or is exiting
        except subprocess.TimeoutExpired:
            code = None
        how = (
            f"killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
            if code is not None
            else "its socket closed"
        )
        self._on_lost(f"the engine process of {self.spec.name} stopped ({how})")

    def send(self, message) -> None:
        if self._closed:
            return
        try:
            self.conn.send(message)
        except OSError:
            self._gone()

    async def stop(self) -> None:
        """Ask the engine to stop; after STOP_SECONDS it is killed."""
        if not self._closed:
            self._closed = True
            if self._loop is not None:
                self._loop.remove_reader(self.conn.fileno())
            try:
                self.conn.send(Stop())
            except OSError:
                pass
        try:
            await asyncio.to_thread(self.proc.wait, STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        self.conn.close()

    def kill(self) -> None:
        """Stop the engine at once (loading failed on the API side; the server did not start)."""
        self._closed = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()

    @property
    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None


def start_engine_process(spec: EngineSpec) -> Callable[[], ProcessCore]:
    """Start the engine process for `spec` (it loads the model while the caller loads the
    tokenizer); the returned function waits for it to be ready and gives its `ProcessCore`,
    or raises BadInput with the engine's one-line error."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptforge.serve.engine_process", str(theirs.fileno())], pass_fds=(theirs.fileno(),)
    )
    theirs.close()
    conn = Connection(os.dup(mine.fileno()))
    mine.close()
    conn.send(asdict(spec))

    def ready() -> ProcessCore:
        try:
            if not conn.poll(READY_SECONDS):
                raise BadInput(f"{spec.name}: the engine process did not load the model in {READY_SECONDS:.0f} s")
            answer = conn.recv()
        except (EOFError, OSError):
            code = proc.wait()
            raise BadInput(f"{spec.name}: the engine process exited while loading (exit code {code})") from None
        except BaseException:
            proc.kill()
            proc.wait()
            conn.close()
            raise
        if isinstance(answer, LoadFailed):
            proc.wait()
            conn.close()
            raise BadInput(answer.reason)
        return ProcessCore(proc, conn, answer, spec)

    def abandon() -> None:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        conn.close()

    ready.abandon = abandon
    return ready


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
