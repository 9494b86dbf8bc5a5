"""A scripted OpenAI-compatible chat server on 127.0.0.1, for the tests and the benchmarks.

`ChatEndpoint` answers POST /v1/chat/completions with `self.answer(body)` (a subclass's, or one
set on the instance) and records every request: the instruct stage's judge, the synthesize
stage's endpoint in tests/test_synthesize.py, the fixed-delay endpoint of
benchmarks/bench_synthesize.py. Standard library only.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ChatEndpoint:
    """A scripted OpenAI-compatible server on 127.0.0.1: POST /v1/chat/completions answers
    `self.answer(body)`, which returns the reply's content (a str: a chat completion with usage
    counts) or (status, payload) for an HTTP error. Every request is recorded (path, headers,
    body). `fail_first` requests answer HTTP `fail_status` first."""

    def __init__(self, fail_first: int = 0, fail_status: int = 500):
        self.requests: list[dict] = []
        self.fail_first, self.fail_status = fail_first, fail_status
        self.lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint.lock:
                    endpoint.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    failing = len(endpoint.requests) <= endpoint.fail_first
                if failing:
                    return self._send(endpoint.fail_status, {"error": "busy"})
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": "no such path"})
                answer = endpoint.answer(body)
                if not isinstance(answer, str):
                    return self._send(*answer)
                self._send(
                    200,
                    {
                        "id": "chatcmpl-1",
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [
                            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}
                        ],
                        "usage": {
                            "prompt_tokens": len(json.dumps(body["messages"])) // 4,
                            "completion_tokens": max(1, len(answer) // 4),
                        },
                    },
                )

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def answer(self, body: dict) -> str | tuple[int, dict]:
        raise NotImplementedError

    def close(self):
        self.server.shutdown()
        self.server.server_close()
