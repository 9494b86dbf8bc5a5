"""`gptforge serve`: the pipeline's models behind an OpenAI-compatible HTTP API, with a chat
page, on one machine; `--engine vllm` hands a Hugging Face folder to vLLM's own OpenAI server
on GPU workers.

- `sources`: what a MODEL argument names (registry URI, checkpoint, Hugging Face folder,
  classifier) and where its files are.
- `loading`: a served language model (tokenizer, chat prompt, engine) or classifier.
- `engine`: the API side of a model's engine: requests, their text and stop strings, the queue.
- `engine_process`: the engine in a process of its own (the default), and the channel to it.
- `engine_core`: the scheduler's loop, and its in-thread runner (`--engine-process off`).
- `scheduler`: which rows run in a step (decode, chunked and batched prefill), token picking.
- `prefix_cache`: prompt blocks' keys/values reused across requests.
- `gpt_backend`, `hf_backend`: the model side (gptforge GPT, transformers causal LMs).
- `app`: the FastAPI app (OpenAI's routes and error objects, classify, health, metrics, page).
- `metrics`: the Prometheus series.
- `vllm`: `--engine vllm`.
- `static/`: the chat page.
"""

from __future__ import annotations


def listen(host: str, port: int):
    """The server's listening socket, bound before any model loads: a port in use is a
    one-line error at once, not after the loading, and no other process can take it between."""
    import socket

    from gptforge.errors import BadInput

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise BadInput(f"--host {host}: {e.strerror or e}") from None
    family, kind, proto, _, address = infos[0]
    # The protocol number too (IPPROTO_TCP, not 0): asyncio sets TCP_NODELAY only on accepted
    # sockets that say TCP. Without it, a stream's first event waited for the client's delayed
    # ACK of the headers: 40 ms more time to first token (tests/test_serve_api.py).
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise BadInput(
            f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); pick another port"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_server(models: list, *, sock, host: str, port: int, api_key: str | None) -> int:
    """Serve loaded models on `sock` (`listen`) until SIGINT/SIGTERM (uvicorn's own handling:
    in-flight answers are given a few seconds, then the engines stop). An engine lost on the way
    (its process died) ends every open answer with an error and stops the server: StageFailed."""
    import uvicorn

    from gptforge.errors import StageFailed
    from gptforge.serve.app import create_app

    lost: list[str] = []
    server: uvicorn.Server | None = None

    def on_lost(message: str) -> None:
        lost.append(message)
        print(f"gptforge serve: {message}; stopping", flush=True)
        if server is not None:
            server.should_exit = True

    for m in models:
        if getattr(m, "engine", None) is not None:
            m.engine.on_lost = on_lost
    app = create_app(models, api_key=api_key)
    names = ", ".join(m.name for m in models)
    print(f"gptforge serve: {names} on http://{host}:{port} (chat page at /, API at /v1)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    if lost:
        raise StageFailed(f"gptforge serve stopped: {lost[0]}")
    return 0
