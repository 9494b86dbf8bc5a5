"""`gptforge serve` as a process, each test with a server of its own (one gptforge GPT, no API
key), started on 127.0.0.1 as a user starts it.

- A paused engine with its batch and queue full: the next request gets 429, and a client that
  disconnects mid-answer frees its slot for the one waiting.
- The engine process killed mid-stream: an error on every stream and a non-zero exit; SIGTERM
  stops the server and its engine process within the stop bound.
- Start failures are one line: a port in use (before any model loads), bad engine settings, a
  model the engine process cannot load (and no process left behind).

The API against one server of three models: tests/test_serve_api.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time

import httpx
import openai
import psutil
import pytest
from cli_support import BIN
from process_support import Paused, free_port
from serve_api_support import PROMPT, folders, metric, running, wait_until  # noqa: F401  (folders: a fixture)
from serve_support import PARAMS, Server

pytestmark = pytest.mark.slow


# -- a full queue, a disconnect, the engine process -------------------------------------------


def test_a_disconnect_frees_the_slot_a_full_queue_answers_429_and_the_next_takes_the_slot(folders, tmp_path):
    # The engine holds after its 2nd step (gptforge.runtime.pause): the first request's prefill and one
    # decode step. The batch of one is full, and stays so until the test lets the engine go on.
    paused = Paused(tmp_path, 2)
    srv = Server(
        [f"tiny={folders['tiny']}"],
        tmp_path,
        "--max-batch",
        "1",
        "--max-queue",
        "1",
        env={**os.environ, **paused.env()},
    )
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True}
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as a, httpx.Client(base_url=srv.url, timeout=60) as b:
            first = a.send(a.build_request("POST", "/v1/completions", json=body), stream=True)
            paused.wait(srv.proc, output=srv.log.read_text)
            assert next(first.iter_lines()).startswith("data: ")  # decoding
            # Its answer's headers come after the submission: waiting in the queue of one.
            second = b.send(b.build_request("POST", "/v1/completions", json={**body, "max_tokens": 5}), stream=True)
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.RateLimitError, match="waiting"):
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5)
            assert (running(srv), metric(srv, "gptforge_waiting_requests")) == (1, 1)
            first.close()  # the client goes away mid-answer
            paused.release()
            # Its slot goes to the waiting request, which answers in full.
            data = [line for line in second.iter_lines() if line]
            assert data[-1] == "data: [DONE]" and json.loads(data[-2][6:])["choices"][0]["finish_reason"] == "length"
        wait_until(lambda: running(srv) == 0, "the batch to empty")
        # The first was cancelled, not run on to its 1000 tokens: what it generated is the
        # total less the second's 5 (2 before the pause, and any step before its cancel landed).
        first_tokens = metric(srv, "gptforge_generated_tokens_total") - 5
        print(f"the disconnected request generated {first_tokens:.0f} tokens")
        assert 2 <= first_tokens < 1000
    finally:
        paused.release()
        srv.stop()


def engine_process(srv) -> psutil.Process:
    engines = [
        p for p in psutil.Process(srv.proc.pid).children() if "gptforge.serve.engine_process" in " ".join(p.cmdline())
    ]
    assert len(engines) == 1, engines
    return engines[0]


def test_the_engine_process_killed_mid_stream_is_an_error_on_every_stream_and_a_non_zero_exit(folders, tmp_path):
    paused = Paused(tmp_path, 3)  # three streams are answering when the engine dies
    srv = Server([f"tiny={folders['tiny']}"], tmp_path, env={**os.environ, **paused.env()})
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True}
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            streams = [
                http.send(http.build_request("POST", "/v1/completions", json=body), stream=True) for _ in range(3)
            ]
            paused.wait(srv.proc, output=srv.log.read_text)
            engine_process(srv).kill()
            t0 = time.monotonic()
            for stream in streams:
                events = [line for line in stream.iter_lines() if line]
                assert events[-1] == "data: [DONE]"
                assert json.loads(events[-2][6:])["error"]["type"] == "server_error"
        code = srv.proc.wait(timeout=30)
        took = time.monotonic() - t0
        print(f"the server exited {took:.1f} s after its engine was killed")
        assert code == 1 and took < 20  # the stop bound gptforge keeps
        last = srv.log.read_text().strip().splitlines()[-1]
        assert re.fullmatch(
            r"gptforge: error: gptforge serve stopped: the engine process of tiny stopped "
            r"\(killed by SIGKILL\)",
            last,
        ), last
    finally:
        paused.release()
        srv.stop()


def test_sigterm_stops_the_server_and_its_engine_process_within_the_stop_bound(folders, tmp_path):
    srv = Server([f"tiny={folders['tiny']}"], tmp_path)
    engine = engine_process(srv)
    t0 = time.monotonic()
    os.killpg(srv.proc.pid, signal.SIGTERM)  # as a service manager stops the whole group
    code = srv.proc.wait(timeout=30)
    engine.wait(timeout=30)
    took = time.monotonic() - t0
    print(f"stopped in {took:.1f} s")
    assert took < 20 and code in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    assert "engine process" not in srv.log.read_text()  # no engine loss reported: it was asked to stop


# -- start failures are one line -----------------------------------------------------------


def test_a_port_in_use_is_one_line_before_any_model_loads(folders):
    import socket

    from cli_support import error_lines

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [str(BIN / "gptforge"), "serve", f"tiny={folders['tiny']}", "--port", str(port), "--params", str(PARAMS)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    assert error_lines(done.stderr) == [
        f"gptforge: error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use); pick another port"
    ]
    assert done.stderr.strip().splitlines()[-1].startswith("gptforge: error: --port")


@pytest.mark.parametrize("flag", [["--prefill-chunk", "0"], ["--prefix-cache-mb", "-1"]])
def test_bad_engine_settings_are_one_line(folders, flag):
    from cli_support import last_error_line

    done = subprocess.run(
        [str(BIN / "gptforge"), "serve", f"tiny={folders['tiny']}", *flag, "--params", str(PARAMS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert last_error_line(done.stderr).startswith(f"gptforge: error: {flag[0]} must be >=")


def test_a_model_the_engine_process_cannot_load_is_one_line_and_leaves_no_process(folders, tmp_path):
    from cli_support import last_error_line

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folders["tiny"] / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    t0 = time.time()
    proc = subprocess.Popen(
        [str(BIN / "gptforge"), "serve", f"b={broken}", "--port", str(free_port()), "--params", str(PARAMS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = set()
    while proc.poll() is None:  # the engine processes it starts, while it runs
        with contextlib.suppress(psutil.Error):
            pids |= {c.pid for c in psutil.Process(proc.pid).children()}
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert re.fullmatch(
        rf"gptforge: error: {re.escape(str(broken))}/model.safetensors: not a readable "
        r"safetensors file \(.*\)",
        last_error_line(stderr),
    )
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).create_time() >= t0 - 1]
    assert not alive, "an engine process outlived the failed start"
