"""The client and the loads of benchmarks/bench_serve.py: a minimal HTTP/1.1 client on asyncio
streams, the parsing of its answers (after the timing), and the loads the measures send.

The client does the least it can while timing (on 2 cores it takes CPU from the server): send
the request, read the chunked or plain body, split the server-sent events and note each one's
arrival time. JSON is parsed after a level, by `parse` (streamed answers) and `parse_plain`
(one JSON body).

Loads (each returns the raw results, parsed later by the caller):
- `run_level`: `clients` clients at once, each sending `requests` requests in turn on one
  keep-alive connection (bench_serve's levels, the Hugging Face comparison, the prefix load);
- `run_long_prompt`: `streams` streams decoding, and a long prompt sent once every stream has
  had `before` events; what the streams' gaps look like before it and during its prefill
  (`long_prompt_gaps`).
Texts: `shared_prefix` (a system prompt of exactly N tokens), `questions` (short distinct
questions), `long_document` (a prompt of exactly N tokens, distinct per round).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from typing import Callable

# ---------------------------------------------------------------------------------------------
# Numbers


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def ms_stats(xs: list[float]) -> dict:
    return {"p50": ms(pct(xs, 0.5)), "p95": ms(pct(xs, 0.95)), "max": ms(max(xs, default=None)), "n": len(xs)}


# ---------------------------------------------------------------------------------------------
# The client: raw HTTP/1.1 over asyncio streams, keep-alive, chunked or plain bodies


class Connection:
    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None

    async def post_stream(self, path: str, body: bytes, on_event: Callable[[int], None] | None = None) -> dict:
        """Send one request; return status, the raw events with their arrival times, and the
        send time. Parsing the events is left for later. `on_event(n)` (optional) is called with
        the number of events so far whenever a chunk completes some (the long-prompt load's
        trigger)."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.reader, self.writer
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        t0 = time.perf_counter()
        writer.write(head + body)
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        events: list[tuple[float, bytes]] = []
        buf = b""
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()  # the blank line after the last chunk (no trailers)
                    break
                data = await reader.readexactly(size + 2)
                t = time.perf_counter()
                buf += data[:-2]
                if b"\n\n" in buf or b"\r\n\r\n" in buf:
                    buf = buf.replace(b"\r\n", b"\n")
                    *done, buf = buf.split(b"\n\n")
                    events.extend((t, e) for e in done)
                    if on_event is not None:
                        on_event(len(events))
        elif "content-length" in headers:
            buf = await reader.readexactly(int(headers["content-length"]))
        else:
            buf = await reader.read()
            headers["connection"] = "close"
        if buf.strip():
            events.append((time.perf_counter(), buf.replace(b"\r\n", b"\n").strip()))
        if headers.get("connection") == "close":
            await self.close()
        return {"status": status, "sent": t0, "events": events, "end": time.perf_counter()}


Bodies = bytes | list[list[bytes]]


def _body(bodies: Bodies, client: int, request: int) -> bytes:
    return bodies if isinstance(bodies, bytes) else bodies[client][request]


async def run_level(
    port: int, clients: int, requests: int, body: Bodies, path: str = "/v1/completions"
) -> tuple[float, list]:
    """`clients` clients at once, each sending `requests` requests in turn on its own connection;
    `body` is one request body for all, or `body[client][request]` (built before the timing).
    Returns the wall time and the raw results in client order (client 0's requests first; an
    exception's text in place of a failed one)."""

    async def client(i: int) -> list:
        conn, out = Connection(port), []
        for j in range(requests):
            try:
                out.append(await conn.post_stream(path, _body(body, i, j)))
            except Exception as e:  # counted as an error, the client goes on with a new connection
                out.append({"error": f"{type(e).__name__}: {e}"})
                await conn.close()
        await conn.close()
        return out

    t0 = time.perf_counter()
    results = await asyncio.gather(*(client(i) for i in range(clients)))
    return time.perf_counter() - t0, [r for rs in results for r in rs]


# ---------------------------------------------------------------------------------------------
# Parsing (after the timing)


def parse(raw: dict, require_done: bool = True) -> dict:
    """One streamed request's raw result -> ttft, the gaps between text events (and the text
    events' times), tokens, text, error. `require_done=False` for servers whose streams end
    without `data: [DONE]` (transformers serve's /v1/completions)."""
    if "error" in raw:
        return {"error": raw["error"]}
    if raw["status"] != 200:
        msg = b" ".join(e for _, e in raw["events"])[:300].decode(errors="replace")
        return {"error": f"status {raw['status']}: {msg}"}
    text_times, pieces, usage, done, error = [], [], None, False, None
    for t, event in raw["events"]:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                error = f"not JSON: {data[:100]!r}"
                continue
            if "error" in chunk:
                error = json.dumps(chunk["error"])[:300]
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content")
                if piece:
                    pieces.append(piece)
                    text_times.append(t)
    if error is None and require_done and not done:
        error = "no [DONE] event"
    if error is None and usage is None:
        error = "no usage chunk"
    if error is not None:
        return {"error": error}
    gaps = [b - a for a, b in zip(text_times, text_times[1:])]
    return {
        "ttft": (text_times[0] - raw["sent"]) if text_times else None,
        "gaps": gaps,
        "events": len(text_times),
        "completion_tokens": usage.get("completion_tokens"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "text": "".join(pieces),
        "seconds": (text_times[-1] - raw["sent"]) if text_times else None,
        "total_seconds": (raw["events"][-1][0] - raw["sent"]) if raw["events"] else None,
        "sent": raw["sent"],
        "times": text_times,
    }


def parse_plain(raw: dict) -> dict:
    """One non-streamed request's raw result (a JSON body) -> tokens (`usage`), text, seconds."""
    if "error" in raw:
        return {"error": raw["error"]}
    body = b" ".join(e for _, e in raw["events"])
    if raw["status"] != 200:
        return {"error": f"status {raw['status']}: {body[:300].decode(errors='replace')}"}
    try:
        answer = json.loads(body)
    except ValueError:
        return {"error": f"not JSON: {body[:100]!r}"}
    usage = answer.get("usage") or {}
    if "completion_tokens" not in usage:
        return {"error": f"no usage in the answer: {body[:200]!r}"}
    choice = (answer.get("choices") or [{}])[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("message") or {}).get("content") or ""
    return {
        "completion_tokens": usage["completion_tokens"],
        "prompt_tokens": usage.get("prompt_tokens"),
        "text": text,
        "seconds": raw["end"] - raw["sent"],
        "ttft": None,
        "gaps": [],
        "events": 1,
    }


# ---------------------------------------------------------------------------------------------
# Request bodies and /metrics


def completion_body(
    model: str,
    prompt: str,
    max_tokens: int,
    *,
    temperature: float = 0.0,
    stream: bool = True,
    seed: int | None = None,
    usage: bool = True,
    **extra,
) -> bytes:
    """A `/v1/completions` body. `usage` asks a stream for its usage chunk
    (`stream_options.include_usage`); a server that ignores it may still send one."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
        **extra,
    }
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    if seed is not None:
        body["seed"] = seed
    return json.dumps(body).encode()


def scrape_metrics(port: int, names: tuple[str, ...]) -> dict[str, float] | None:
    """The sums over labels of the named series on `GET /metrics` (Prometheus text), those
    present only; None if /metrics does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode(errors="replace")
    except OSError:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) in names:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


# ---------------------------------------------------------------------------------------------
# Texts: a shared prefix of exactly N tokens, short questions, long documents

_RULES = [
    "Greet every visitor by name when you know it, and in plain words when you do not.",
    "Books on the ground floor may be borrowed for three weeks; reference books stay in the reading room.",
    "The children's corner opens at nine and closes at five, except on public holidays.",
    "Late returns cost ten cents a day, never more than the price of the book itself.",
    "Answer questions about opening hours, fees, rooms and events; send other questions to the front desk.",
    "The map room on the second floor keeps old charts of the harbour, the river and the hills.",
    "Study rooms are booked for two hours at a time, at most twice a week for each reader.",
    "Printers take cards from the front desk; colour pages cost three times as much as grey ones.",
    "Keep answers short, polite and exact, and say so when you do not know something.",
    "The archive in the basement opens on Tuesdays and Thursdays, by appointment only.",
]
_TOPICS = [
    "birds",
    "ships",
    "bridges",
    "rivers",
    "stars",
    "gardens",
    "trains",
    "castles",
    "bees",
    "clocks",
    "maps",
    "forests",
    "kites",
    "whales",
    "storms",
    "mountains",
    "bread",
    "music",
    "glass",
    "coins",
]


def exact_tokens(encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], text: str, n: int) -> str:
    """A prefix of `text` that encodes to exactly `n` tokens: cut at the last word boundary
    within `n` tokens (before a token that starts with a space), then topped up with " a"
    (one token in GPT-2's BPE, and one pre-token, so it merges with nothing)."""
    ids = encode(text)
    if len(ids) < n:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {n}")
    m = n
    while m > 0 and not decode(ids[m : m + 1]).startswith(" "):
        m -= 1
    cut = decode(ids[:m]) + " a" * (n - m)
    if len(encode(cut)) != n:
        raise ValueError(f"the text cut to {n} tokens encodes to {len(encode(cut))}")
    return cut


def shared_prefix(encode, decode, n: int) -> str:
    """A system prompt of exactly `n` tokens: a library assistant's numbered rules."""
    parts, i = ["You are the assistant of the city library. Follow these rules."], 0
    while len(encode(" ".join(parts))) < n + 32:
        parts.append(f"Rule {i + 1}: {_RULES[i % len(_RULES)]}")
        i += 1
    return exact_tokens(encode, decode, " ".join(parts), n)


def questions(count: int, offset: int = 0) -> list[str]:
    """`count` short distinct questions (appended to the shared prefix)."""
    return [
        f"\n\nQuestion {offset + k + 1}: where are the books about {_TOPICS[(offset + k) % len(_TOPICS)]}?\nAnswer:"
        for k in range(count)
    ]


def long_document(encode, decode, n: int, round_index: int) -> str:
    """A prompt of exactly `n` tokens whose first tokens differ from round to round (so a
    prefix cache cannot serve one round's from another's)."""
    words = []
    k = round_index
    while len(words) < 2 * n:
        words.append(f"{_TOPICS[k % len(_TOPICS)]} {k * 7919 % 1000}")
        k += 3
    return exact_tokens(encode, decode, f"Report {round_index}: " + ", ".join(words) + ".", n)


# ---------------------------------------------------------------------------------------------
# The long-prompt load


async def run_long_prompt(
    port: int, stream_body: bytes, long_body: bytes, streams: int, before: int, timeout: float = 300.0
) -> dict:
    """`streams` streaming requests at once (each on its own connection); once every one has
    had `before` events, the long prompt's request is sent on another connection. Returns the
    raw results of the streams, the long request's, and when it was sent."""
    counts = [0] * streams
    go = asyncio.Event()

    def counter(i: int):
        def on_event(n: int) -> None:
            counts[i] = n
            if not go.is_set() and min(counts) >= before:
                go.set()

        return on_event

    async def stream(i: int) -> dict:
        conn = Connection(port)
        try:
            return await conn.post_stream("/v1/completions", stream_body, on_event=counter(i))
        except Exception as e:  # noqa: BLE001 (an error, reported)
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            await conn.close()

    async def long_request() -> dict:
        await go.wait()
        conn = Connection(port)
        try:
            return await conn.post_stream("/v1/completions", long_body)
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            await conn.close()

    tasks = [asyncio.ensure_future(stream(i)) for i in range(streams)]
    long_task = asyncio.ensure_future(long_request())
    done, _ = await asyncio.wait(tasks, timeout=timeout)
    if not go.is_set():  # the streams ended (or failed) before the trigger: no long request
        long_task.cancel()
        raws = [t.result() if t in done else {"error": "timed out"} for t in tasks]
        return {
            "streams": raws,
            "long": {"error": f"the streams ended before each had {before} events (counts {counts})"},
        }
    raws = [t.result() if t in done else {"error": "timed out"} for t in tasks]
    return {"streams": raws, "long": await asyncio.wait_for(long_task, timeout)}


def long_prompt_gaps(streams: list[dict], long: dict) -> dict:
    """Split the decoding streams' inter-token gaps by the long prompt's prefill window, from
    its send time to its first text event: `before` (gaps inside the steady state with all
    streams started, ending before it was sent), `during` (gaps overlapping the window),
    `after` (gaps starting after its first token). Arguments are parsed results."""
    ok = [s for s in streams if "error" not in s and s["times"]]
    if "error" in long or not long.get("times") or not ok:
        return {"error": long.get("error") or "no stream to measure"}
    sent, first = long["sent"], long["times"][0]
    all_started = max(s["times"][0] for s in ok)
    before, during, after = [], [], []
    ended_early = 0
    for s in ok:
        ts = s["times"]
        if ts[-1] < first:
            ended_early += 1
        for a, b in zip(ts, ts[1:]):
            if a >= all_started and b <= sent:
                before.append(b - a)
            elif b > sent and a < first:
                during.append(b - a)
            elif a >= first:
                after.append(b - a)
    return {
        "window_s": first - sent,
        "before": before,
        "during": during,
        "after": after,
        "streams_ended_before_prefill_done": ended_early,
    }
