"""`gptforge serve` as its users meet it: the official `openai` client and plain HTTP against
the real command on 127.0.0.1, serving a gptforge GPT, a Hugging Face Llama and a spam
classifier at once (with an API key, so every request below also passes the key check).

References are independent of the server: `gptforge generate` (the command line) for greedy
answers, `class_probabilities` for the classifier, the tokenizer for the usage counts.

Servers of their own (a full queue and a disconnect, the engine process killed or stopped,
start failures): tests/test_serve_process.py.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import openai
import psutil
import pytest
from hf_models import make_tiny_causal_lm
from serve_api_support import PROMPT, folders, metric, running, wait_until  # noqa: F401  (folders: a fixture)
from serve_support import PARAMS, Server, cli_generate

pytestmark = pytest.mark.slow

KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(folders):
    srv = Server(
        [
            f"tiny={folders['tiny']}",
            f"llama={folders['llama']}",
            f"spam={folders['spam']}",
            f"ours-llama={folders['ours-llama']}",
        ],
        folders["root"],
        "--api-key",
        KEY,
        "--max-batch",
        "12",
        "--max-queue",
        "8",
    )
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def encode(text: str) -> list[int]:
    from gptforge.config.load import load_config
    from gptforge.modeling.tokenizer import load_tokenizer

    return load_tokenizer(load_config(PARAMS).tokenizer.path).encode_ordinary(text)


# -- the OpenAI client -----------------------------------------------------------------------


def test_models_completions_chat_and_usage(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "llama", "spam", "ours-llama"}
    assert models["tiny"].model_extra["kind"] == "generate" and models["spam"].model_extra["kind"] == "classify"
    assert models["tiny"].model_extra["context_length"] == 1024

    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == len(encode(PROMPT))
    assert done.usage.completion_tokens == 12 and done.usage.total_tokens == done.usage.prompt_tokens + 12

    chat = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 3


def test_streamed_chat_is_the_answer_in_pieces(client):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        max_tokens=16,
        temperature=0,
    )
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
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_errors_are_the_clients_own_exceptions(server, client):
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="word " * 1100)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


# -- greedy answers equal `gptforge generate`, alone and in a full batch ----------------------


@pytest.mark.parametrize("model", ["tiny", "llama", "ours-llama"])
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
        with client.completions.create(
            model=model, prompt="Some other words " * (i + 1), max_tokens=900, temperature=0, stream=True
        ) as stream:
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
    answers = [
        client.completions.create(model=model, prompt=system + q, max_tokens=12, temperature=0).choices[0].text
        for q in questions
    ]
    assert hits() - before >= 48  # the second found at least the system prompt's first three blocks
    assert answers[1] == cli_generate(
        folders[model], system + questions[1], 12
    )  # the cached one, against the plain path


# -- classify ------------------------------------------------------------------------------


def test_classify_gives_the_classifiers_probabilities(folders, server):
    from gptforge.config.load import load_config
    from gptforge.finetune.classifier import class_probabilities, load_classifier
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


# -- streams ----------------------------------------------------------------------------------


def test_sse_wire_format(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth(), timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line for line in r.iter_lines() if line]
    assert data[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in data)
    events = [json.loads(line[6:]) for line in data[:-1]]
    assert events and all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# -- bad requests -----------------------------------------------------------------------------

BAD = [  # (what, method, path, body or raw bytes, headers, status, param)
    ("malformed JSON", "POST", "/v1/completions", b'{"model": "tiny", "prompt": ', {}, 400, None),
    (
        "wrong type",
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "temperature": "hot"},
        {},
        400,
        "temperature",
    ),
    (
        "max_tokens 0",
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "max_tokens": 0},
        {},
        400,
        "max_tokens",
    ),
    (
        "max_tokens over the context",
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "max_tokens": 5000},
        {},
        400,
        "max_tokens",
    ),
    (
        "message without a role",
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"content": "hi"}]},
        {},
        400,
        "messages.0.role",
    ),
    (
        "unknown model",
        "POST",
        "/v1/chat/completions",
        {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]},
        {},
        404,
        "model",
    ),
    (
        "prompt over the context",
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": "word " * 1100},
        {},
        400,
        "prompt",
    ),
    ("body over the limit", "POST", "/v1/completions", {"model": "tiny", "prompt": "x" * (2 << 20)}, {}, 413, None),
    ("no API key", "POST", "/v1/completions", {"model": "tiny", "prompt": "x"}, {"Authorization": ""}, 401, None),
    ("a classifier asked to generate", "POST", "/v1/completions", {"model": "spam", "prompt": "x"}, {}, 400, "model"),
]


def test_300_bad_requests_each_get_their_error_and_the_server_keeps_serving(server):
    proc = psutil.Process(server.proc.pid)
    with httpx.Client(base_url=server.url, timeout=60) as http:

        def send(case):
            _, method, path, body, headers, _, _ = case
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return http.request(
                method, path, content=content, headers={**auth(), "Content-Type": "application/json", **headers}
            )

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
        good = http.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
            headers=auth(),
        )
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
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another?"},
    ]
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
        for framing, data in (
            ("Content-Length", body),
            ("chunked", (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20))),
        ):
            with pytest.raises(urllib.error.HTTPError) as e:  # urllib also sends Connection: close
                urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60)
            yield f"urllib, {framing}", e.value.code, e.value.headers.get("Connection"), e.value.read()
        for close in (False, True):
            r = requests.post(
                url, data=body, headers={**headers, **({"Connection": "close"} if close else {})}, timeout=60
            )
            yield f"requests, Connection: close {close}", r.status_code, r.headers.get("Connection"), r.content

    for what, status, connection, content in answers():
        assert (status, connection) == (413, "close"), what
        assert json.loads(content)["error"] == {
            "message": "the request body is over the limit of 1048576 bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }, what
    good = httpx.post(
        url, json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}, headers=auth(), timeout=60
    )
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
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\n{length}\r\n\r\n"
    ).encode()
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
