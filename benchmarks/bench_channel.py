"""The channel between `gptforge serve`'s API process and its engine process: a step's message
there and back, over the standard library's `multiprocessing.connection` on a Unix socket pair
(what serve.engine_process uses) and over ZeroMQ (pyzmq PAIR sockets on ipc://, what vLLM uses),
when pyzmq is installed.

    python benchmarks/bench_channel.py [--messages 2000] [--repeats 7]

The message is what the engine sends after a step of 16 rows: `Drawn` (16 (id, token) pairs,
the scheduler's Stats); the echo is what the API side sends most (`Cancel`). Both pickled,
as the engine does (`Connection.send`, pyzmq's `send_pyobj`): messages between two processes of
one server over a channel no other process can reach. Per channel: the round trip's median over
`--repeats` runs of `--messages` ping-pongs each (after one warm-up run), in microseconds. A model
step on this project's 2-core CPU takes milliseconds (bench_serve.py), so either channel is a small
part of it; the figures say how small.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gptforge.serve.messages import Cancel, Drawn, Stats  # noqa: E402

MESSAGE = Drawn([(i, 1000 + i) for i in range(16)], Stats(16, 1234, 5678, 910, 112, 1 << 20))


def _pipe_echo(conn) -> None:
    while True:
        message = conn.recv()
        if message is None:
            return
        conn.send(Cancel(7))


def _zmq_echo(address: str) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(address)
    while True:
        message = sock.recv_pyobj()
        if message is None:
            return
        sock.send_pyobj(Cancel(7))


def ping_pong(send, recv, messages: int, repeats: int) -> list[float]:
    """Microseconds a round trip, one figure per run of `messages`, after one warm-up run."""
    runs = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(messages):
            send(MESSAGE)
            recv()
        if r:
            runs.append((time.perf_counter() - t0) / messages * 1e6)
    send(None)
    return runs


def time_pipe(messages: int, repeats: int) -> list[float]:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_pipe_echo, args=(theirs,))
    proc.start()
    runs = ping_pong(mine.send, mine.recv, messages, repeats)
    proc.join()
    return runs


def time_zmq(messages: int, repeats: int) -> list[float] | str:
    try:
        import zmq
    except ImportError:
        return "pyzmq is not installed"
    address = f"ipc://{tempfile.mkdtemp()}/channel"
    sock = zmq.Context().socket(zmq.PAIR)
    sock.bind(address)
    proc = mp.get_context("spawn").Process(target=_zmq_echo, args=(address,))
    proc.start()
    runs = ping_pong(sock.send_pyobj, sock.recv_pyobj, messages, repeats)
    proc.join()
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"message: {len(pickle.dumps(MESSAGE))} bytes pickled; {os.cpu_count()} CPUs")
    for name, runs in (
        ("multiprocessing.connection (socketpair)", time_pipe(args.messages, args.repeats)),
        ("pyzmq PAIR over ipc://", time_zmq(args.messages, args.repeats)),
    ):
        if isinstance(runs, str):
            print(f"{name}: {runs}")
        else:
            print(
                f"{name}: round trip median {statistics.median(runs):.1f} us "
                f"(min {min(runs):.1f}, max {max(runs):.1f}; {args.repeats} runs of {args.messages})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
