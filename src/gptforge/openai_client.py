"""The one client gptforge uses to talk to an OpenAI-compatible chat endpoint.

The instruct stage's judge and the `synthesize` stage both send `/chat/completions` requests to
a server the user names by its base URL with `/v1` (vLLM, Ollama, a hosted API, `gptforge
serve`). `ChatClient.complete` sends one request (never streamed) and returns the reply's text,
its finish reason and its `usage` counts; connection errors, timeouts, 429 and 5xx are retried
with doubling backoff (a `Retry-After` header is honoured), everything else is raised at once.

Why not the official `openai` package: its 3.x client refuses to send a request without
credentials unless the header is omitted through private hooks, while local servers (vLLM,
Ollama, gptforge serve) take none and a key must stay optional; it costs about 1 s of import in
every stage process that merely might call it; and its major versions have moved under us. This
is urllib and about 100 lines. The test suite still drives our own server with the official
client, as its users do.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

Message = Mapping[str, str]


class EndpointError(Exception):
    """The endpoint answered with an HTTP error that retrying does not cure (or kept answering one)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}" if detail else f"HTTP {status}")
        self.status = status
        self.detail = detail


class Unreachable(Exception):
    """The connection itself kept failing (refused, reset, timed out) through every retry."""


class BadReply(Exception):
    """The endpoint answered 200 with something that is not a chat completion."""


@dataclass(frozen=True)
class Completion:
    content: str
    finish_reason: str | None
    prompt_tokens: int | None  # the endpoint's own `usage` counts (None when it sent none)
    completion_tokens: int | None
    seconds: float  # wall time of the request that answered (retries not included)


def check_url(url: Any, param: str) -> str:
    if not isinstance(url, str) or not re.match(r"https?://", url):
        raise ValueError(f"{param}: {url!r} is not an http:// or https:// URL")
    return url


class ChatClient:
    """`url` is the base URL with its /v1; `api_key` None or empty sends no Authorization header."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        retries: int = 2,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model = model
        self.timeout, self.retries, self.backoff, self.max_backoff = timeout, retries, backoff, max_backoff
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._sleep = sleep  # None: time.sleep

    def complete(self, messages: Sequence[Message], **params: Any) -> Completion:
        """One chat completion. Raises Unreachable, EndpointError or BadReply."""
        body = json.dumps({"model": self.model, "messages": list(messages), **params}).encode()
        reply, seconds = self._post(body)
        try:
            choice = reply["choices"][0]
            content = choice["message"]["content"]
            if not isinstance(content, str):
                raise TypeError(type(content).__name__)
        except (KeyError, IndexError, TypeError) as exc:
            raise BadReply(f"not a chat completion ({type(exc).__name__}: {exc})") from None
        usage = reply.get("usage") or {}
        return Completion(
            content=content,
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=_count(usage.get("prompt_tokens")),
            completion_tokens=_count(usage.get("completion_tokens")),
            seconds=seconds,
        )

    def _post(self, body: bytes) -> tuple[dict, float]:
        delay = self.backoff
        for attempt in range(self.retries + 1):
            wait = delay
            t0 = time.monotonic()
            try:
                request = urllib.request.Request(self.endpoint, data=body, headers=self.headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                    raw = answer.read()
                seconds = time.monotonic() - t0
                try:
                    reply = json.loads(raw)
                except ValueError:
                    raise BadReply(f"not JSON ({raw[:80]!r})") from None
                if not isinstance(reply, dict):
                    raise BadReply(f"not a JSON object ({type(reply).__name__})")
                return reply, seconds
            except urllib.error.HTTPError as exc:  # before URLError: it is a subclass
                retryable = exc.code == 429 or exc.code >= 500
                if attempt == self.retries or not retryable:
                    raise EndpointError(exc.code, _detail(exc)) from None
                wait = max(delay, _retry_after(exc) or 0.0)
            except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, timeout, cut off
                if attempt == self.retries:
                    reason = getattr(exc, "reason", exc)
                    raise Unreachable(f"{type(reason).__name__}: {reason}") from None
            (self._sleep or time.sleep)(min(wait, self.max_backoff))
            delay *= 2
        raise AssertionError("unreachable")


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _retry_after(exc: urllib.error.HTTPError) -> float | None:
    try:
        return float(exc.headers.get("Retry-After", ""))
    except (TypeError, ValueError, AttributeError):
        return None


def _detail(exc: urllib.error.HTTPError) -> str:
    """The server's error message (OpenAI's {"error": {"message": ...}} or FastAPI's {"detail": ...}), short."""
    try:
        raw = exc.read()
    except Exception:  # noqa: BLE001 - the status alone is still worth reporting
        return ""
    try:
        data = json.loads(raw)
        error = data.get("error") if isinstance(data, dict) else None
        text = (error.get("message") if isinstance(error, dict) else error) or data.get("detail") or raw.decode()
    except (ValueError, AttributeError, UnicodeDecodeError):
        text = raw.decode("utf-8", "replace")
    return " ".join(str(text).split())[:200]
