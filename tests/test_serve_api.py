"""`gptforge serve` as its users meet it: the official `openai` client and plain HTTP against
the real command on 127.0.0.1, serving a gptforge GPT, a Hugging Face Llama and a spam
classifier at once (with an API key, so every request below also passes the key check).

References are independent of the server: `gptforge generate` (the command line) for greedy
answers, `class_probabilities` for the classifier, the tokenizer for the usage counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import openai
import psutil
import pytest

from conftest import BIN, Paused, free_port
from hf_models import make_tiny_causal_lm
from serve_support import PARAMS, Server, tiny_classifier, tiny_gpt

pytestmark = pytest.mark.slow

KEY = "test-key-123"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    gpt = tiny_gpt(root / "tiny")
    return {"tiny": gpt, "llama": make_tiny_causal_lm(root / "llama", "llama", max_positions=1024),
            "spam": tiny_classifier(root / "spam", gpt), "root": root}


@pytest.fixture(scope="module")
def server(folders):
    srv = Server([f"tiny={folders['tiny']}", f"llama={folders['llama']}", f"spam={folders['spam']}"],
                 folders["root"], "--api-key", KEY, "--max-batch", "12", "--max-queue", "8")
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def cli_generate(checkpoint, prompt: str, n: int, *extra: str) -> str:
    out = subprocess.run([str(BIN / "gptforge"), "generate", prompt, "--checkpoint", str(checkpoint),
                          "--temperature", "0", "--max-new-tokens", str(n), "--params", str(PARAMS), *extra],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout[:-1]  # generate prints the answer and a newline


def encode(text: str) -> list[int]:
    from gptforge.config.load import load_config
    from gptforge.modeling.tokenizer import load_tokenizer

    return load_tokenizer(load_config(PARAMS).tokenizer.path).encode_ordinary(text)


def running(server) -> float:
    return metric(server, "gptforge_running_requests")


def metric(server, name: str) -> float:
    """A series of the server's /metrics, summed over its models."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf'^{name}\{{model="[^"]+"\}} (\S+)$', text, re.M))


def wait_until(condition, what: str, timeout: float = 120) -> None:
    """Poll `condition` until true. The timeout is a bound against a hang only: what is waited
    for comes within a few steps of the model, seconds on a loaded machine."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.05)


# -- the OpenAI client -----------------------------------------------------------------------

def test_models_completions_chat_and_usage(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "llama", "spam"}
    assert models["tiny"].model_extra["kind"] == "generate" and models["spam"].model_extra["kind"] == "classify"
    assert models["tiny"].model_extra["context_length"] == 1024

    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == len(encode(PROMPT))
    assert done.usage.completion_tokens == 12 and done.usage.total_tokens == done.usage.prompt_tokens + 12

    chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 3


def test_streamed_chat_is_the_answer_in_pieces(client):
    kwargs = dict(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Name a colour."}], max_tokens=16,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 4  # streamed token by token, not in one piece
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_sampling_is_seeded_and_respects_top_k(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, top_k=5, top_p=0.9, seed=7)
    a = client.completions.create(**{k: v for k, v in kw.items() if k != "top_k"}, extra_body={"top_k": 5})
    b = client.completions.create(**{k: v for k, v in kw.items() if k != "top_k"}, extra_body={"top_k": 5})
    assert a.choices[0].text == b.choices[0].text
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=8)
    assert c.choices[0].text != a.choices[0].text


def test_stop_strings_end_the_answer_before_them(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = full[10:14]
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_errors_are_the_clients_own_exceptions(server, client):
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="word " * 1100)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


# -- greedy answers equal `gptforge generate`, alone and in a full batch ----------------------

@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_greedy_answers_equal_generate_alone_and_among_eight_others(folders, server, client, model):
    n = 40
    expected = cli_generate(folders[model], PROMPT, n)
    alone = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0).choices[0].text
    assert alone == expected

    # Eight streams of other prompts (other lengths: rows at other positions) are decoding when
    # the request goes in (the server counts them running) and still decoding when it ends (none
    # has finished: each may go on for 900 tokens, the request takes 40; they are closed after).
    chunks, finished, enough = {}, set(), threading.Event()

    def other(i: int) -> None:
        with client.completions.create(model=model, prompt="Some other words " * (i + 1), max_tokens=900,
                                       temperature=0, stream=True) as stream:
            for chunk in stream:
                chunks[i] = chunks.get(i, 0) + 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished.add(i)
                if enough.is_set():
                    break

    threads = [threading.Thread(target=other, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: running(server) == 8, "the eight other streams decoding")
        among = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0).choices[0].text
        ended_before = set(finished)
    finally:
        enough.set()
        for t in threads:
            t.join(timeout=120)
    assert among == expected
    assert not ended_before and sorted(chunks) == list(range(8))
    wait_until(lambda: running(server) == 0, "the closed streams to leave the batch")


@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_a_shared_prompt_prefix_comes_from_the_prefix_cache_and_answers_are_unchanged(folders, server, client, model):
    system = "You answer questions about the weather in short sentences. " * 6
    questions = ["Is it raining?", "Will it snow tomorrow?"]
    hits = lambda: metric(server, "gptforge_prefix_cache_hit_tokens_total")  # noqa: E731
    before = hits()
    answers = [client.completions.create(model=model, prompt=system + q, max_tokens=12, temperature=0).choices[0].text
               for q in questions]
    assert hits() - before >= 48  # the second found at least the system prompt's first three blocks
    assert answers[1] == cli_generate(folders[model], system + questions[1], 12)  # the cached one, against the plain path


# -- classify ------------------------------------------------------------------------------

def test_classify_gives_the_classifiers_probabilities(folders, server):
    from gptforge.config.load import load_config
    from gptforge.finetune.classify import class_probabilities, load_classifier
    from gptforge.modeling.tokenizer import load_tokenizer

    texts = ["WINNER!! Claim your prize now", "Ok lar, see you at lunch"]
    r = httpx.post(f"{server.url}/v1/classify", json={"input": texts}, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    enc = load_tokenizer(load_config(PARAMS).tokenizer.path)
    expected = class_probabilities(load_classifier(folders["spam"]), texts, enc)
    assert body["model"] == "spam" and [d["index"] for d in body["data"]] == [0, 1]
    for row, probs in zip(body["data"], expected.tolist()):
        assert row["probabilities"]["ham"] == pytest.approx(probs[0], abs=1e-6)
        assert row["probabilities"]["spam"] == pytest.approx(probs[1], abs=1e-6)
        assert row["label"] == ("spam" if probs[1] > probs[0] else "ham")
        assert row["probability"] == pytest.approx(max(probs), abs=1e-6)


# -- streams, disconnects, queue ------------------------------------------------------------

def test_sse_wire_format(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth(), timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line for line in r.iter_lines() if line]
    assert data[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in data)
    events = [json.loads(line[6:]) for line in data[:-1]]
    assert events and all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_disconnect_frees_the_slot_a_full_queue_answers_429_and_the_next_takes_the_slot(folders, tmp_path):
    # The engine holds after its 2nd step (gptforge.runtime.pause): the first request's prefill and one
    # decode step. The batch of one is full, and stays so until the test lets the engine go on.
    paused = Paused(tmp_path, 2)
    srv = Server([f"tiny={folders['tiny']}"], tmp_path, "--max-batch", "1", "--max-queue", "1",
                 env={**os.environ, **paused.env()})
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
    engines = [p for p in psutil.Process(srv.proc.pid).children()
               if "gptforge.serve.engine_process" in " ".join(p.cmdline())]
    assert len(engines) == 1, engines
    return engines[0]


def test_the_engine_process_killed_mid_stream_is_an_error_on_every_stream_and_a_non_zero_exit(folders, tmp_path):
    paused = Paused(tmp_path, 3)  # three streams are answering when the engine dies
    srv = Server([f"tiny={folders['tiny']}"], tmp_path, env={**os.environ, **paused.env()})
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True}
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            streams = [http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
                       for _ in range(3)]
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
        assert re.fullmatch(r"gptforge: error: gptforge serve stopped: the engine process of tiny stopped "
                            r"\(killed by SIGKILL\)", last), last
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


# -- bad requests -----------------------------------------------------------------------------

BAD = [  # (what, method, path, body or raw bytes, headers, status, param)
    ("malformed JSON", "POST", "/v1/completions", b'{"model": "tiny", "prompt": ', {}, 400, None),
    ("wrong type", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, {}, 400,
     "temperature"),
    ("max_tokens 0", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, {}, 400,
     "max_tokens"),
    ("max_tokens over the context", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 5000},
     {}, 400, "max_tokens"),
    ("message without a role", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"content": "hi"}]},
     {}, 400, "messages.0.role"),
    ("unknown model", "POST", "/v1/chat/completions",
     {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}, {}, 404, "model"),
    ("prompt over the context", "POST", "/v1/completions", {"model": "tiny", "prompt": "word " * 1100}, {}, 400,
     "prompt"),
    ("body over the limit", "POST", "/v1/completions", {"model": "tiny", "prompt": "x" * (2 << 20)}, {}, 413, None),
    ("no API key", "POST", "/v1/completions", {"model": "tiny", "prompt": "x"}, {"Authorization": ""}, 401, None),
    ("a classifier asked to generate", "POST", "/v1/completions", {"model": "spam", "prompt": "x"}, {}, 400,
     "model"),
]


def test_300_bad_requests_each_get_their_error_and_the_server_keeps_serving(server):
    proc = psutil.Process(server.proc.pid)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        def send(case):
            _, method, path, body, headers, _, _ = case
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return http.request(method, path, content=content,
                                headers={**auth(), "Content-Type": "application/json", **headers})

        for case in BAD:  # warm: every code path once
            send(case)
        rss_before = proc.memory_info().rss
        for i in range(300):
            case = BAD[i % len(BAD)]
            r = send(case)
            what, status, param = case[0], case[5], case[6]
            assert r.status_code == status, (what, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], what
            assert error["param"] == param, (what, error)
        rss_after = proc.memory_info().rss
        assert http.get("/health").json()["status"] == "ok"
        good = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                  "temperature": 0}, headers=auth())
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4
    assert rss_after < rss_before * 1.10, (rss_before, rss_after)
    assert running(server) == 0
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r'^gptforge_requests_total\{endpoint="/v1/completions",status="400"\} (\d+)', metrics, re.M)
    assert re.search(r"^gptforge_time_to_first_token_seconds_count\{model=\"tiny\"\} [1-9]", metrics, re.M)
    assert re.search(r"^gptforge_generated_tokens_total\{model=\"tiny\"\} [1-9]", metrics, re.M)


def test_the_page_is_open_and_sent_with_its_security_headers(server):
    page = httpx.get(f"{server.url}/", timeout=10)  # no API key: the page asks for it
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    script = httpx.get(f"{server.url}/static/chat.js", timeout=10)
    assert script.status_code == 200 and "content-security-policy" in script.headers
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401


def test_a_port_in_use_is_one_line_before_any_model_loads(folders):
    import socket

    from conftest import error_lines

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run([str(BIN / "gptforge"), "serve", f"tiny={folders['tiny']}", "--port", str(port),
                               "--params", str(PARAMS)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert error_lines(done.stderr) == [f"gptforge: error: --port {port}: cannot listen on 127.0.0.1:{port} "
                                        "(Address already in use); pick another port"]
    assert done.stderr.strip().splitlines()[-1].startswith("gptforge: error: --port")


def test_accepted_connections_send_small_writes_at_once():
    """`serve.listen`'s socket makes asyncio (uvicorn's loop) turn Nagle's algorithm off on each
    accepted connection: otherwise a stream's first event after the headers waits for the
    client's delayed ACK (40 ms on Linux)."""
    import asyncio
    import socket

    from gptforge.serve import listen

    async def main():
        sock = listen("127.0.0.1", 0)
        accepted = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(lambda r, w: accepted.set_result(w), sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        server_side = await accepted
        nodelay = server_side.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        server_side.close()
        server.close()
        return nodelay

    assert asyncio.run(main()) != 0


@pytest.mark.parametrize("flag", [["--prefill-chunk", "0"], ["--prefix-cache-mb", "-1"]])
def test_bad_engine_settings_are_one_line(folders, flag):
    from conftest import last_error_line

    done = subprocess.run([str(BIN / "gptforge"), "serve", f"tiny={folders['tiny']}", *flag,
                           "--params", str(PARAMS)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert last_error_line(done.stderr).startswith(f"gptforge: error: {flag[0]} must be >=")


def test_a_model_the_engine_process_cannot_load_is_one_line_and_leaves_no_process(folders, tmp_path):
    from conftest import last_error_line

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folders["tiny"] / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    t0 = time.time()
    proc = subprocess.Popen([str(BIN / "gptforge"), "serve", f"b={broken}", "--port", str(free_port()),
                             "--params", str(PARAMS)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = set()
    while proc.poll() is None:  # the engine processes it starts, while it runs
        with contextlib.suppress(psutil.Error):
            pids |= {c.pid for c in psutil.Process(proc.pid).children()}
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert re.fullmatch(rf"gptforge: error: {re.escape(str(broken))}/model.safetensors: not a readable "
                        r"safetensors file \(.*\)", last_error_line(stderr))
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).create_time() >= t0 - 1]
    assert not alive, "an engine process outlived the failed start"


def test_the_engine_in_a_thread_of_the_api_process_answers_as_the_engine_process(folders, server, client, tmp_path):
    srv = Server([f"tiny={folders['tiny']}"], tmp_path, "--engine-process", "off")
    try:
        assert [c.name() for c in psutil.Process(srv.proc.pid).children()] == []
        other = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        ask = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
        assert other.completions.create(**ask).choices[0].text == client.completions.create(**ask).choices[0].text
    finally:
        srv.stop()


def test_chat_without_a_chat_template_uses_the_instruct_template(tmp_path):
    """The registry's copy of a gptforge model is a Hugging Face folder without a chat template:
    its chat prompt is the one the gptforge checkpoint gets."""
    import types

    import torch

    from gptforge.config.load import load_config
    from gptforge.serve.loading import load_served, render_conversation

    cfg = load_config(PARAMS)
    folder = make_tiny_causal_lm(tmp_path / "plain", "llama", chat_template=None)
    src = types.SimpleNamespace(name="plain", kind="hf", path=folder, tokenizer=None, spec=str(folder))
    lm = load_served(src, cfg, max_batch=2, max_queue=2, device=torch.device("cpu"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"}]
    prompt = render_conversation(messages, cfg.instruct.template)
    assert prompt.startswith("Below is an instruction") and prompt.count("### Response:") == 2
    assert lm.chat_ids(messages) == lm.tokenizer(prompt)["input_ids"]


# -- a body over the limit, from clients that send it all before they read ----------------------

def test_a_body_over_the_limit_gets_its_413_even_from_clients_that_send_it_all_first(server):
    """urllib and requests write the whole body before they read: the server reads and drops it
    (up to its drain bound, 64 MiB), then answers 413 and closes, so they get the answer, not
    the reset a close with unread bytes makes. 16 MiB: more than the sockets' buffers hold."""
    import urllib.error
    import urllib.request

    import requests

    url = f"{server.url}/v1/completions"
    body = json.dumps({"model": "tiny", "prompt": "x" * (16 << 20)}).encode()
    headers = {**auth(), "Content-Type": "application/json"}

    def answers():
        for framing, data in (("Content-Length", body), ("chunked", (body[i:i + (1 << 20)]
                                                                    for i in range(0, len(body), 1 << 20)))):
            with pytest.raises(urllib.error.HTTPError) as e:  # urllib also sends Connection: close
                urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60)
            yield f"urllib, {framing}", e.value.code, e.value.headers.get("Connection"), e.value.read()
        for close in (False, True):
            r = requests.post(url, data=body, headers={**headers, **({"Connection": "close"} if close else {})},
                              timeout=60)
            yield f"requests, Connection: close {close}", r.status_code, r.headers.get("Connection"), r.content

    for what, status, connection, content in answers():
        assert (status, connection) == (413, "close"), what
        assert json.loads(content)["error"] == {
            "message": "the request body is over the limit of 1048576 bytes", "type": "invalid_request_error",
            "param": None, "code": "request_too_large"}, what
    good = httpx.post(url, json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
                      headers=auth(), timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_far_beyond_the_drain_bound_is_dropped_unbuffered_and_its_connection_closed(server, framing):
    """A body past the drain bound (declared, or found while a chunked one streams in) is not read
    to its end: the client gets the 413 or a closed connection, and the server neither holds the
    body in memory nor stops serving."""
    import socket

    proc = psutil.Process(server.proc.pid)
    rss_before = proc.memory_info().rss
    total, piece = 256 << 20, b"x" * (1 << 20)
    length = f"Content-Length: {total}" if framing == "content-length" else "Transfer-Encoding: chunked"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{length}\r\n\r\n").encode()
    frame = piece if framing == "content-length" else b"%x\r\n%s\r\n" % (len(piece), piece)
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        try:
            sock.sendall(head)
            while sent < total:
                sock.sendall(frame)
                sent += len(piece)
        except OSError:  # the server closed the connection: a reset, or a broken pipe
            pass
        try:
            while chunk := sock.recv(1 << 16):
                answer += chunk
        except ConnectionResetError:
            pass
    assert sent < total, "the server read the whole body"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    rss_after = proc.memory_info().rss
    assert rss_after - rss_before < 32 << 20, (rss_before, rss_after)
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
