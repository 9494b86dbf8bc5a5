"""`gptforge serve`: the pipeline's models behind an OpenAI-compatible HTTP API, with a chat
page, on one machine; `--engine vllm` hands a Hugging Face folder to vLLM's own OpenAI server
on GPU workers.

- `sources`: what a MODEL argument names (registry URI, checkpoint, Hugging Face folder,
  classifier) and where its files are.
- `loading`: a served language model (tokenizer, chat prompt, engine) or classifier.
- `backends`: the model side of continuous batching (gptforge GPT, transformers models).
- `engine`: the scheduler: queue, admission, one decode step for every running request, stops.
- `app`: the FastAPI app (OpenAI's routes and error objects, classify, health, metrics, page).
- `metrics`: the Prometheus series.
- `vllm`: `--engine vllm`.
- `static/`: the chat page.
"""

from __future__ import annotations


def run_server(models: list, *, host: str, port: int, api_key: str | None) -> int:
    """Serve loaded models until SIGINT/SIGTERM (uvicorn's own handling: in-flight answers are
    given a few seconds, then the engines stop)."""
    import uvicorn

    from gptforge.serve.app import create_app

    app = create_app(models, api_key=api_key)
    names = ", ".join(m.name for m in models)
    print(f"gptforge serve: {names} on http://{host}:{port} (chat page at /, API at /v1)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
