"""The synthesize stage against a scripted OpenAI-compatible server: exactly the good pairs kept,
each bad one dropped under its reason, the response cache (a second run asks nothing; a run that
stopped halfway asks only for what it lacks), and the one-line errors of the command.

With the rest of gptforge (no endpoint: the chunks for the index; `dvc repro` into fine-tuning;
`gptforge serve` as the endpoint): tests/test_synthesize_integration.py."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import pytest
import yaml
from chat_endpoint import ChatEndpoint
from cli_support import BIN, cli_env, last_error_line, run_cli, snapshot
from process_support import started, wait_until

from gptforge.config.load import load_config
from gptforge.errors import SourceUnreachable, StageFailed
from gptforge.synthesize.stage import synthesize

RIVERS = """# Rivers

## Rhine

The Rhine rises in the Swiss Alps and flows north through Basel, Strasbourg and Cologne before it
reaches the North Sea in the Netherlands. Its length is about 1,230 kilometres, and barges carry
coal, grain and containers along it.

## Danube

The Danube starts in the Black Forest of Germany and flows east through Vienna, Bratislava,
Budapest and Belgrade. It empties into the Black Sea through a large delta in Romania, where
pelicans and many other birds nest.

## Glaciers

Glaciers carve U-shaped valleys over thousands of years, leaving moraines of rock and gravel where
the ice stopped. Meltwater from glaciers feeds many rivers in summer.

## Salmon

Salmon hatch in fresh water, migrate to the ocean to feed for several years, and return to their
home river to spawn, often leaping up waterfalls on the way.

## Beavers

Beavers build dams from branches and mud, which turns streams into ponds that shelter their
lodges from wolves and other predators during the winter.
"""
DOC = (
    RIVERS
    + """
# 长江

长江是中国最长的河流，全长约六千三百公里，在上海注入东海。
"""
)


def _pairs(*pairs: tuple[str, str]) -> str:
    return json.dumps([{"question": q, "answer": a} for q, a in pairs], ensure_ascii=False)


GOOD = {
    "rhine": [
        ("Where does the Rhine rise?", "The Rhine rises in the Swiss Alps."),
        ("Which sea does the Rhine reach?", "The Rhine reaches the North Sea in the Netherlands."),
    ],
    "danube": [
        (
            "Where does the Danube start?",
            "The Danube starts in the Black Forest of Germany and flows east through Vienna, Bratislava, "
            "Budapest and Belgrade.",
        )
    ],
    "glaciers": [("What do glaciers carve over thousands of years?", "Glaciers carve U-shaped valleys.")],
    "salmon": [("Where do salmon return to spawn?", "Salmon return to their home river to spawn.")],
    "yangtze": [("长江全长约多少公里？", "长江全长约六千三百公里。")],
}
BAD = {  # reason -> (chunk, question, answer)
    "not_self_contained": [
        ("rhine", "What does the figure above show about the Rhine?", "The Rhine flows north through Basel."),
        ("yangtze", "如上图所示，长江在哪里注入东海？", "长江在上海注入东海。"),
    ],
    "ungrounded": [
        ("rhine", "Who first mapped the Rhine?", "Roman engineers under Julius Caesar charted it in 55 BC.")
    ],
    "duplicate": [("danube", "WHERE does the Danube start", "In the Black Forest of Germany.")],
    "near_duplicate": [
        (
            "danube",
            "Where does the Danube begin?",
            "The Danube starts in the Black Forest of Germany and flows east through Vienna, "
            "Bratislava, Budapest and Belgrade.",
        )
    ],
    "not_a_question": [
        ("danube", "The Danube and its delta.", "The Danube empties into the Black Sea through a delta.")
    ],
    "too_short": [("danube", "Danube?", "It flows east through Vienna.")],
    "repeats_question": [
        ("danube", "Which cities does the Danube flow through?", "Which cities does the Danube flow through?")
    ],
    "empty": [("danube", "What does the Danube empty into?", "   ")],
}
MARKERS = {
    "rhine": "Rhine rises",
    "danube": "Danube starts",
    "glaciers": "Glaciers carve",
    "salmon": "Salmon hatch",
    "beavers": "Beavers build",
    "yangtze": "长江是中国",
}


class ScriptedEndpoint(ChatEndpoint):
    """Answers by the chunk in the prompt: good pairs mixed with each kind of bad one; broken JSON
    for the glaciers chunk's first ask (its retry, another seed, parses), a fenced reply with a
    malformed item for the salmon chunk, prose for the beavers chunk every time."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.down_after: int | None = None  # answer HTTP 503 once this many requests were answered
        self.hold = threading.Event()
        self.hold.set()
        self.answered = 0

    def chunk_of(self, body: dict) -> str:
        text = body["messages"][-1]["content"]
        found = [name for name, marker in MARKERS.items() if marker in text]
        assert len(found) == 1, f"each chunk holds one section: {found}"
        return found[0]

    def answer(self, body: dict):
        self.hold.wait()
        with self.lock:
            if self.down_after is not None and self.answered >= self.down_after:
                return 503, {"error": {"message": "overloaded"}}
            self.answered += 1
        name = self.chunk_of(body)
        if name == "glaciers" and body["seed"] == 123:
            return 'Sure! Here are the pairs: [{"question": "What do glaciers carve?", "answer": "U-shaped'
        if name == "beavers":
            return "I am sorry, I cannot write questions about beavers."
        pairs = GOOD[name] + [(q, a) for items in BAD.values() for chunk, q, a in items if chunk == name]
        if name == "salmon":
            return "```json\n" + _pairs(*pairs)[:-1] + ', {"q": "Where do salmon feed?"}]\n```'
        return _pairs(*pairs)


@pytest.fixture
def endpoint(no_proxy):
    server = ScriptedEndpoint()
    yield server
    server.hold.set()
    server.close()


def _cfg(tmp_path: Path, endpoint, **overrides):
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    (docs / "rivers.md").write_text(DOC, encoding="utf-8")
    sets = {
        "tokenizer.path": "sample://gpt2_tokenizer",
        "synthesize.documents": {"rivers": str(docs)},
        "synthesize.endpoint.url": endpoint.url,
        "synthesize.endpoint.model": "scripted",
        "synthesize.chunk_tokens": 70,
        "synthesize.chunk_overlap": 0,
        "synthesize.min_chunk_tokens": 8,
        "synthesize.pairs_per_chunk": 3,
        "synthesize.concurrency": 4,
        "synthesize.endpoint.retries": 0,
        **overrides,
    }
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in sets.items()])


def _run(tmp_path: Path, cfg):
    return synthesize(
        cfg,
        out_root=tmp_path / "data/synthetic",
        reports_dir=tmp_path / "reports",
        metrics_dir=tmp_path / "metrics",
        cache_dir=tmp_path / "cache",
    )


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_keeps_exactly_the_good_pairs_and_drops_each_bad_one_under_its_reason(tmp_path, endpoint):
    cfg = _cfg(tmp_path, endpoint)
    metrics = _run(tmp_path, cfg)
    out = tmp_path / "data/synthetic/rivers"

    kept = _jsonl(out / "qa.jsonl")
    expected = [pair for name in MARKERS for pair in GOOD.get(name, [])]
    assert [(r["instruction"], r["output"]) for r in kept] == expected
    doc = DOC
    for record in kept:  # Alpaca records with their provenance: the span is the chunk's text in the document
        assert record["input"] == "" and record["source"] == "rivers.md"
        start, end = record["span"]
        assert record["output"][:6] in doc[start:end] or record["output"][:2] in doc[start:end]
        assert 0 <= record["scores"]["grounding"] <= 1
    dropped = _jsonl(out / "dropped.jsonl")
    by_reason = {}
    for record in dropped:
        by_reason.setdefault(record["reason"], []).append(record["instruction"])
    assert by_reason == {reason: [q for _, q, _ in items] for reason, items in BAD.items()}
    assert [r["duplicate_of"] for r in dropped if r["reason"] in ("duplicate", "near_duplicate")] == [
        "Where does the Danube start?"
    ] * 2

    chunks = _jsonl(out / "chunks.jsonl")
    assert len(chunks) == 6 and all(doc[c["span"][0] : c["span"][1]] == c["text"] for c in chunks)
    assert chunks[1]["headings"] == ["Rivers", "Danube"] and chunks[-1]["headings"] == ["长江"]
    assert {r["chunk"] for r in kept} <= {c["id"] for c in chunks}

    assert json.loads((out / "dataset_info.json").read_text()) == {
        "gptforge_rivers": {
            "file_name": "qa.jsonl",
            "formatting": "alpaca",
            "columns": {"prompt": "instruction", "query": "input", "response": "output"},
        }
    }
    n_bad = sum(len(v) for v in BAD.values())
    assert metrics["kept"] == 6 and metrics["pairs_returned"] == 6 + n_bad + 0
    assert metrics["unparseable"] == 1 and metrics["dropped_malformed"] == 1 and metrics["chunks"] == 6
    assert metrics["pairs_asked"] == 18
    assert {k: v for k, v in metrics.items() if k.startswith("dropped_") and v} == {
        "dropped_malformed": 1,
        **{f"dropped_{reason}": len(items) for reason, items in BAD.items()},
    }
    # one request per chunk, one more for each reply that did not parse (glaciers, beavers)
    assert metrics["requests"] == len(endpoint.requests) == 8
    assert json.loads((tmp_path / "metrics/synthesize_rivers.json").read_text()) == metrics
    first = endpoint.requests[0]["body"]
    assert first["model"] == "scripted" and "stream" not in first
    assert first["response_format"]["json_schema"]["schema"]["items"]["required"] == ["question", "answer"]
    assert "Authorization" not in endpoint.requests[0]["headers"]
    assert metrics["endpoint_tokens_per_sec"] > 0 and metrics["completion_tokens"] > 0

    report = (tmp_path / "reports/synthesize_rivers.md").read_text(encoding="utf-8")
    for reason in BAD:
        assert f"| {reason} | {len(BAD[reason])} |" in report and f"### {reason}" in report
    assert "| kept | 6 |" in report and "| unparseable | 1 |" in report

    # A second run with nothing changed asks the endpoint nothing and writes the same pairs.
    before = (out / "qa.jsonl").read_bytes()
    again = _run(tmp_path, cfg)
    assert len(endpoint.requests) == 8 and again["requests"] == 0 and again["cached_replies"] == 8
    assert (out / "qa.jsonl").read_bytes() == before


def test_a_run_that_stops_halfway_resumes_asking_only_for_the_chunks_it_lacks(tmp_path, endpoint):
    cfg = _cfg(tmp_path, endpoint, **{"synthesize.concurrency": 1})
    endpoint.down_after = 3
    with pytest.raises(SourceUnreachable) as stopped:
        _run(tmp_path, cfg)
    message = str(stopped.value)
    assert "\n" not in message and "HTTP 503" in message
    # glaciers (3rd chunk) was answered once, unparseably: its retry is what hit the 503
    assert re.search(r"2 of 6 chunks answered and cached, 4 left: run again to resume", message), message
    assert not (tmp_path / "data/synthetic/rivers").exists()  # nothing half-written
    asked_before = {json.dumps(r["body"]["messages"]) + str(r["body"]["seed"]) for r in endpoint.requests[:3]}

    endpoint.down_after = None
    n = len(endpoint.requests)
    metrics = _run(tmp_path, cfg)
    resumed = endpoint.requests[n:]
    # the 8 requests of a whole run, less the 3 answered before the endpoint went down
    assert len(resumed) == 5 and metrics["requests"] == 5 and metrics["cached_replies"] == 3
    assert not asked_before & {json.dumps(r["body"]["messages"]) + str(r["body"]["seed"]) for r in resumed}
    assert metrics["kept"] == 6


def test_endpoint_without_response_format_is_asked_without_it(tmp_path, endpoint):
    answer = endpoint.answer

    def refuse_response_format(body):
        if "response_format" in body:
            return 400, {"error": {"message": "response_format is not supported"}}
        return answer(body)

    endpoint.answer = refuse_response_format
    metrics = _run(tmp_path, _cfg(tmp_path, endpoint, **{"synthesize.concurrency": 1}))
    assert metrics["kept"] == 6
    assert ["response_format" in r["body"] for r in endpoint.requests] == [True] + [False] * 8


def test_llm_verify_and_curate_drop_what_the_endpoint_rejects(tmp_path, endpoint):
    answer = endpoint.answer

    def judge(body):
        text = body["messages"][-1]["content"]
        if "Reply with one word: yes or no" in text:  # verify: the Yangtze pair is "unsupported"
            return "No." if "六千三百" in text.split("Answer:")[1] else "Yes"
        if "from 1 to 10" in text:  # curate: the salmon pair rates 3
            return "3" if "salmon" in text.lower() else "9"
        return answer(body)

    endpoint.answer = judge
    metrics = _run(tmp_path, _cfg(tmp_path, endpoint, **{"synthesize.verify": True, "synthesize.curate.enabled": True}))
    kept = _jsonl(tmp_path / "data/synthetic/rivers/qa.jsonl")
    assert [r["instruction"] for r in kept] == [q for name in ("rhine", "danube", "glaciers") for q, _ in GOOD[name]]
    assert metrics["dropped_unsupported"] == 1 and metrics["dropped_low_rating"] == 1
    assert all(r["scores"]["verified"] == 1.0 and r["scores"]["curate"] == 9 for r in kept)


def test_no_pair_kept_fails_with_the_drop_counts_and_the_report(tmp_path, endpoint):
    endpoint.answer = lambda body: _pairs(("What does the table below list?", "The Rhine rises in the Swiss Alps."))
    with pytest.raises(StageFailed) as failed:
        _run(tmp_path, _cfg(tmp_path, endpoint))
    message = str(failed.value)
    assert "no pair kept of 6 returned" in message and "not_self_contained 6" in message
    assert str(tmp_path / "reports/synthesize_rivers.md") in message and "\n" not in message


def test_api_key_goes_in_the_authorization_header(tmp_path, endpoint, monkeypatch):
    monkeypatch.setenv("GPTFORGE_SYNTH_API_KEY", "sk-synth")
    _run(tmp_path, _cfg(tmp_path, endpoint))
    assert {r["headers"]["Authorization"] for r in endpoint.requests} == {"Bearer sk-synth"}


def test_a_chunk_the_endpoint_refuses_is_counted_and_the_others_go_on(tmp_path, endpoint):
    answer = endpoint.answer

    def too_long_for_beavers(body):
        if "Beavers build" in body["messages"][-1]["content"]:
            return 400, {"error": {"message": "the prompt is longer than the model's context"}}
        return answer(body)

    endpoint.answer = too_long_for_beavers
    metrics = _run(tmp_path, _cfg(tmp_path, endpoint))
    assert metrics["kept"] == 6 and metrics["refused_requests"] == 1 and metrics["unparseable"] == 0
    # the refused chunk was asked with response_format, then without it; the rest kept the field
    beavers = [r["body"] for r in endpoint.requests if "Beavers build" in r["body"]["messages"][-1]["content"]]
    assert ["response_format" in b for b in beavers] == [True, False]
    others = [r["body"] for r in endpoint.requests if "Beavers build" not in r["body"]["messages"][-1]["content"]]
    assert all("response_format" in b for b in others)


@pytest.mark.parametrize("given", ["url", "model"])
def test_an_endpoint_half_named_is_refused_in_one_line(given):
    from gptforge.errors import BadInput

    value = "http://127.0.0.1:9/v1" if given == "url" else "m"
    with pytest.raises(BadInput, match=f"synthesize.endpoint.{given} is set but synthesize.endpoint.") as e:
        load_config(None, ["synthesize.documents={rivers: docs}", f"synthesize.endpoint.{given}={value}"])
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# The command: one-line errors, nothing written; a stopped run resumes


def _workdir(tmp_path: Path, endpoint_url: str, documents: str = "docs") -> Path:
    work = tmp_path / "work"
    (work / "docs").mkdir(parents=True)
    (work / "docs" / "rivers.md").write_text(DOC, encoding="utf-8")
    (work / "params.yaml").write_text(
        yaml.safe_dump(
            {
                "tokenizer": {"path": "sample://gpt2_tokenizer"},
                "synthesize": {
                    "documents": {"rivers": documents},
                    "chunk_tokens": 70,
                    "chunk_overlap": 0,
                    "min_chunk_tokens": 8,
                    "concurrency": 1,
                    "endpoint": {"url": endpoint_url, "model": "scripted", "retries": 0},
                },
                "tracking": {"enabled": False},
            }
        )
    )
    return work


def _files(work: Path) -> dict[str, bytes]:
    """Every file but the stage's run lock (.gptforge/locks/, taken before the inputs are read)."""
    return {name: data for name, data in snapshot(work).items() if not name.startswith(".gptforge/locks/")}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing folder", "unreadable type", "401", "unreachable"])
def test_command_errors_are_one_line_and_write_nothing(tmp_path, endpoint, case):
    url = endpoint.url
    if case == "unreachable":
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    documents = {"missing folder": "nowhere", "unreadable type": "docs/notes.docx"}.get(case, "docs")
    work = _workdir(tmp_path, url, documents)
    (work / "docs" / "notes.docx").write_bytes(b"PK\x03\x04")
    if case == "401":
        endpoint.answer = lambda body: (401, {"error": {"message": "Incorrect API key provided"}})
    before = _files(work)
    out = run_cli(["synthesize"], work, cli_env(GPTFORGE_PREFECT="0"), timeout=120)
    expected = {
        "missing folder": (2, "synthesize.documents.rivers: nowhere not found"),
        "unreadable type": (2, "synthesize.documents.rivers: cannot read notes.docx: .docx is not one of"),
        "401": (
            2,
            f"synthesize.endpoint.url: {endpoint.url}/chat/completions answered HTTP 401 "
            "(Incorrect API key provided): set GPTFORGE_SYNTH_API_KEY",
        ),
        "unreachable": (1, f"synthesize.endpoint.url: {url}/chat/completions did not answer"),
    }[case]
    assert out.returncode == expected[0], out.stderr[-2000:]
    assert expected[1] in last_error_line(out.stderr), out.stderr[-2000:]
    assert _files(work) == before


@pytest.mark.slow
def test_command_stopped_halfway_resumes_with_only_the_missing_chunks(tmp_path, endpoint, prefect_api):
    """Ctrl-C while the fourth request waits for its answer: exit 130 at once, nothing written;
    the next run asks for the three chunks (and retries) it lacks, nothing more."""
    work = _workdir(tmp_path, endpoint.url)
    log = tmp_path / "synthesize.log"
    answer = endpoint.answer
    gate = threading.Event()

    def slow_fourth(body):
        if len(endpoint.requests) == 4:
            gate.wait(60)
        return answer(body)

    endpoint.answer = slow_fourth
    env = cli_env(PREFECT_API_URL=prefect_api)
    with started([str(BIN / "gptforge"), "synthesize"], work, env, log) as proc:
        wait_until(lambda: len(endpoint.requests) == 4, proc, log, "sending the fourth request", within=120)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 130, log.read_text()[-3000:]
    gate.set()
    assert not (work / "data").exists() or not any((work / "data").rglob("qa.jsonl"))
    endpoint.answer = answer
    n = len(endpoint.requests)
    out = run_cli(["synthesize"], work, env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # 8 requests make the whole run; 3 were answered before the stop (the 4th's answer was lost)
    assert len(endpoint.requests) - n == 5
    assert len(_jsonl(work / "data/synthetic/rivers/qa.jsonl")) == 6
    metrics = json.loads((work / "metrics/synthesize_rivers.json").read_text())
    assert metrics["requests"] == 5 and metrics["cached_replies"] == 3
