"""The HTTP side of `gptforge serve`: a FastAPI app speaking OpenAI's API.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (`stream: true`
answers with server-sent events ending in `data: [DONE]`), `POST /v1/classify`, `GET /health`,
`GET /metrics` (`serve.metrics`) and the chat page at `/` (`serve/static/`).

Every failure is answered with OpenAI's error object `{"error": {"message", "type", "param",
"code"}}` and the status its client maps to an exception: 400 (malformed JSON, wrong types,
out-of-range settings, a prompt longer than the context), 401 (a missing or wrong API key),
404 (unknown model or route), 413 (a body over the limit), 429 (the model's queue is full),
500 (the model failed: the engine goes on with the next requests).
With `--rag` (`serve.rag`), a chat request's last user message gets the retrieved chunks in
front of it (`rag: false` in the body turns that off) and the answer a top-level `sources` list
(in a stream, on the first chunk only).
A client that goes away (closes a stream, or drops a request still waiting for its answer)
cancels its request: its slot is free at the next decode step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from gptforge.serve.engine import Event, QueueFull, Sampling
from gptforge.serve.loading import RequestError, ServedClassifier, ServedLM
from gptforge.serve.metrics import CONTENT_TYPE_LATEST, ServeMetrics

STATIC = Path(__file__).parent / "static"
DEFAULT_BODY_LIMIT = 1 << 20  # 1 MiB: far above any prompt a served context holds
DRAIN_LIMIT = 64 << 20  # 64 MiB: the most of a body the app did not read that is read and dropped (`_Guard`)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_response(
    status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}}, status_code=status)


# -- request bodies (OpenAI's fields; unknown ones are accepted and ignored, as OpenAI's SDKs
#    send some of their own) ------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Generation(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(default=1, ge=1, le=1)


class CompletionBody(_Generation):
    prompt: Union[
        str, Annotated[list[str], Field(min_length=1, max_length=1)], Annotated[list[int], Field(min_length=1)]
    ]


class ChatBody(_Generation):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    rag: bool = True  # false: no retrieval for this request (a server started with --rag)


class ClassifyBody(_Body):
    model: str | None = None
    input: Union[str, Annotated[list[str], Field(min_length=1, max_length=256)]]


# -- the app -------------------------------------------------------------------------------


def create_app(models: list, *, api_key: str | None = None, body_limit: int = DEFAULT_BODY_LIMIT) -> FastAPI:
    """The server for `models` (`ServedLM` / `ServedClassifier`, loaded by `serve.loading`)."""
    by_name = {m.name: m for m in models}
    lms = {m.name: m for m in models if isinstance(m, ServedLM)}
    metrics = ServeMetrics()
    for lm in lms.values():
        lm.engine.observe = metrics.observer(lm.name)

    @asynccontextmanager
    async def lifespan(app):
        for lm in lms.values():
            lm.engine.start()
        yield
        for lm in lms.values():
            await lm.engine.stop()

    app = FastAPI(title="gptforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.models = by_name
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        request.state.error_type = e.type
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        request.state.error_type = "invalid_request_error"
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message, loc = f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})", []
        else:
            where = ".".join(loc) or "body"
            message = f"{where}: {first.get('msg', 'invalid value')}"
        return error_response(400, message, param=".".join(loc) or None, code=first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        request.state.error_type = "invalid_request_error"
        if isinstance(e.__cause__, _TooLarge):  # FastAPI wraps a failed body read into a 400
            return _too_large_response(body_limit)
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(e.status_code, message)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        request.state.error_type = "server_error"
        return error_response(500, f"{type(e).__name__}: {e}", type="server_error")

    @app.get("/health")
    async def health():
        dead = [n for n, lm in lms.items() if not lm.engine.alive]
        if dead:
            return error_response(503, f"engine stopped: {', '.join(dead)}", type="server_error")
        return {"status": "ok", "models": list(by_name)}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render({n: lm.engine for n, lm in lms.items()}), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {
            "object": "list",
            "data": [
                {
                    "id": m.name,
                    "object": "model",
                    "created": m.created,
                    "owned_by": "gptforge",
                    "kind": "classify" if isinstance(m, ServedClassifier) else "generate",
                    "context_length": m.context,
                }
                for m in by_name.values()
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        lm = _lm(lms, by_name, body.model)
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        if isinstance(prompt, str):
            ids = lm.encode(prompt)
        else:
            if any(not 0 <= t < _vocab(lm) for t in prompt):
                raise APIError(400, f"prompt: token ids must be in [0, {_vocab(lm)})", param="prompt")
            ids = list(prompt)
        return await _generate(request, lm, body, ids, chat=False, default_max=16, metrics=metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        lm = _lm(lms, by_name, body.model)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        extra = {}
        try:
            if body.rag and getattr(lm, "rag", None) is not None:
                _check_max_tokens(lm, body)  # before any retrieval
                augmented = await lm.rag.augment(lm, messages, body.max_tokens, metrics)
                messages, extra = augmented.messages, {"sources": augmented.sources}
            ids = lm.chat_ids(messages)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        return await _generate(request, lm, body, ids, chat=True, default_max=None, metrics=metrics, extra=extra)

    @app.post("/v1/classify")
    async def classify(body: ClassifyBody):
        classifiers = {n: m for n, m in by_name.items() if isinstance(m, ServedClassifier)}
        if body.model is None:
            if len(classifiers) != 1:
                raise APIError(
                    400,
                    f"model: name one of the classifiers ({', '.join(classifiers) or 'none served'})",
                    param="model",
                )
            served = next(iter(classifiers.values()))
        elif body.model not in by_name:
            raise APIError(
                404,
                f"model {body.model!r} is not served (GET /v1/models lists them)",
                param="model",
                code="model_not_found",
            )
        elif body.model not in classifiers:
            raise APIError(
                400, f"model {body.model!r} is a language model; /v1/classify takes a classifier", param="model"
            )
        else:
            served = classifiers[body.model]
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        if any(not t.strip() for t in texts):
            raise APIError(400, "input: every text needs at least one non-blank character", param="input")
        data = await asyncio.to_thread(served.classify, texts)
        return {"object": "list", "model": served.name, "data": data}

    if STATIC.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def page():
        index = STATIC / "index.html"
        if not index.is_file():
            raise APIError(404, "the chat page is not installed (serve/static/index.html)")
        return FileResponse(index, media_type="text/html")

    return _Guard(app, metrics, api_key=api_key, body_limit=body_limit)


# The chat page loads nothing but its own files and talks only to this server; model output is
# inserted as text (static/chat.js), and these headers are the second line of defence.
_PAGE_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        b"img-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]

_ENDPOINTS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/classify", "/health", "/metrics", "/"}


def _lm(lms: dict, by_name: dict, name: str) -> ServedLM:
    if name in lms:
        return lms[name]
    if name in by_name:
        raise APIError(400, f"model {name!r} is a classifier: use /v1/classify", param="model")
    raise APIError(
        404, f"model {name!r} is not served (GET /v1/models lists them)", param="model", code="model_not_found"
    )


def _vocab(lm: ServedLM) -> int:
    return lm.tokenizer.n_vocab if lm.kind == "gptforge" else len(lm.tokenizer)


async def _generate(
    request: Request,
    lm: ServedLM,
    body: _Generation,
    ids: list[int],
    *,
    chat: bool,
    default_max: int | None,
    metrics: ServeMetrics,
    extra: dict | None = None,
):
    if not ids:
        raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
    if len(ids) >= lm.context:
        raise APIError(
            400,
            f"the prompt is {len(ids)} tokens; model {lm.name} has a context of {lm.context} "
            "(prompt and answer together)",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    _check_max_tokens(lm, body)
    room = lm.context - len(ids)
    max_tokens = min(body.max_tokens or default_max or room, room)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=[s for s in stops if s],
        seed=body.seed,
    )
    try:
        job = lm.engine.submit(ids, sampling, lm.stop_ids)
    except QueueFull as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
    metrics.prompt_tokens.labels(lm.name).inc(len(ids))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())

    def usage() -> dict:
        return {
            "prompt_tokens": len(ids),
            "completion_tokens": len(job.generated),
            "total_tokens": len(ids) + len(job.generated),
        }

    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            _stream(job, lm.name, rid, created, chat, include_usage, usage, extra),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    text = await _collect(request, job)
    if job.finish_reason == "error":
        raise APIError(500, "the model failed while generating this answer", type="server_error")
    choice = (
        {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": job.finish_reason,
            "logprobs": None,
        }
        if chat
        else {"index": 0, "text": text, "finish_reason": job.finish_reason, "logprobs": None}
    )
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": lm.name,
        "choices": [choice],
        "usage": usage(),
        **(extra or {}),
    }


def _check_max_tokens(lm: ServedLM, body: _Generation) -> None:
    if body.max_tokens is not None and body.max_tokens > lm.context:
        raise APIError(
            400,
            f"max_tokens: {body.max_tokens} is more than the context of model {lm.name} ({lm.context})",
            param="max_tokens",
        )


async def _collect(request: Request, job) -> str:
    """The whole answer; a client that disconnects first cancels the request."""

    async def gone():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(gone())
    parts = []
    try:
        while True:
            getter = asyncio.create_task(job.events.get())
            done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                job.cancel()
                raise asyncio.CancelledError
            event: Event = getter.result()
            if event.finish_reason is not None:
                return "".join(parts)
            parts.append(event.text)
    finally:
        watcher.cancel()
        if not job.done:
            job.cancel()


async def _stream(
    job, model: str, rid: str, created: int, chat: bool, include_usage: bool, usage, extra: dict | None = None
):
    """Server-sent events of one answer, in OpenAI's chunk format, `extra` (the sources) on the
    first chunk only; closing the connection (Starlette cancels this generator) cancels the request."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    first = [extra or {}]

    def chunk(choices: list) -> str:
        more = first.pop() if first else {}
        return (
            "data: "
            + json.dumps(
                {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, **more},
                separators=(",", ":"),
            )
            + "\n\n"
        )

    def render(event: Event) -> tuple[str, bool]:
        """The SSE text of one event, and whether it was the last."""
        if event.finish_reason is None:
            if not event.text:
                return "", False
            piece = (
                {"index": 0, "delta": {"content": event.text}, "finish_reason": None}
                if chat
                else {"index": 0, "text": event.text, "finish_reason": None, "logprobs": None}
            )
            return chunk([piece]), False
        if event.finish_reason == "error":
            return "data: " + json.dumps(
                {
                    "error": {
                        "message": "the model failed while generating this answer",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
            ) + "\n\n", True
        end = {"index": 0, "finish_reason": event.finish_reason}
        text = chunk([{**end, "delta": {}} if chat else {**end, "text": "", "logprobs": None}])
        if include_usage:
            text += (
                "data: "
                + json.dumps(
                    {"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": usage()},
                    separators=(",", ":"),
                )
                + "\n\n"
            )
        return text, True

    try:
        if chat:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        last = False
        while not last:
            # Everything already queued goes out in one write: a client that fell behind catches up.
            events = [await job.events.get()]
            while not job.events.empty():
                events.append(job.events.get_nowait())
            parts = []
            for event in events:
                text, last = render(event)
                parts.append(text)
                if last:
                    break
            if any(parts):
                yield "".join(parts)
        yield "data: [DONE]\n\n"
    finally:
        if not job.done:
            job.cancel()


class _Guard:
    """ASGI wrapper around the app (pure ASGI, so streamed answers pass through untouched):
    counts every answer by endpoint and status, requires the API key on /v1/*, adds the page's
    security headers to / and /static/, and answers 413 to a body over `body_limit` bytes
    before the app reads it (by its Content-Length, or while a chunked body streams in).

    A body the app did not read to its end (a 413, a 401, an unknown route) is read and dropped
    before the answer goes out, up to DRAIN_LIMIT bytes in all: a client that sends its whole
    body before it reads (urllib, requests) then finds the answer. Closing with bytes unread
    makes the kernel reset the connection, and such a client sees the reset instead (uvicorn
    closes right after an answer when the client sent `Connection: close`, as urllib does).
    A body declared or found longer than DRAIN_LIMIT, or one its client holds back until a
    `100 Continue`, is left unread and the answer closes the connection; a 413 always does."""

    def __init__(self, app: FastAPI, metrics: ServeMetrics, *, api_key: str | None, body_limit: int):
        self.app, self.metrics, self.api_key, self.limit = app, metrics, api_key, body_limit
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "other"
        status = []
        page = path == "/" or path.startswith("/static/")
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        seen, ended = 0, not (declared or b"transfer-encoding" in headers)  # the body's bytes read; all read
        waiting = headers.get(b"expect", b"").lower() == b"100-continue"  # no 100 Continue sent yet

        async def counted_receive():
            nonlocal seen, ended, waiting
            waiting = False  # the server answers 100 Continue to the first read
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                ended = not message.get("more_body", False)
                if seen > self.limit:
                    raise _TooLarge
            else:
                ended = True
            return message

        async def drain() -> bool:
            """Read and drop the rest of the body; False where it is left unread (see the class)."""
            nonlocal seen, ended
            if ended:
                return True
            if waiting or (declared or 0) > DRAIN_LIMIT:
                return False
            while seen <= DRAIN_LIMIT:
                message = await receive()
                if message["type"] != "http.request":  # the client went away
                    ended = True
                    return True
                seen += len(message.get("body", b""))
                if not message.get("more_body", False):
                    ended = True
                    return True
            return False

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                extra = list(_PAGE_HEADERS) if page else []
                if not await drain() or message["status"] == 413:
                    extra.append((b"connection", b"close"))
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        if (
            path.startswith("/v1/")
            and self.api_key is not None
            and not hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {self.api_key}".encode())
        ):
            response = error_response(
                401, "a valid API key is required: send `Authorization: Bearer KEY`", code="invalid_api_key"
            )
            await response(scope, counted_receive, counted_send)
        elif declared is not None and declared > self.limit:
            await _too_large_response(self.limit)(scope, counted_receive, counted_send)
        else:
            await self.app(scope, counted_receive, counted_send)
        code = status[0] if status else 500
        self.metrics.requests.labels(endpoint, str(code)).inc()
        if code >= 400:
            error_type = (scope.get("state") or {}).get("error_type") or "invalid_request_error"
            self.metrics.errors.labels(endpoint, error_type).inc()


def _too_large_response(limit: int) -> JSONResponse:
    return error_response(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")


class _TooLarge(Exception):
    pass
