"""`gptforge serve --rag` as its users meet it: the real command on 127.0.0.1 serving a tiny
Llama of 256 positions (GPT-2 tokenizer, ChatML template) with an index built here from a small
Markdown document, whose "The Nile" section is longer than the model's whole context.

What the server put in front of a question is checked independently of it: the test rebuilds
the documented prompt layout from the response's `sources` (which chunks, how many characters
of the cut one), renders it with the model's own tokenizer and chat template (transformers,
not the server), and compares the token count with `usage.prompt_tokens` and with
`positions - max_tokens` (within a few tokens of it: the cut chunk fills the room). Through
the engine: the same token ids sent again as a plain completion find every full block of the
augmented prompt in the engine's prefix cache (a block is found only when the tokens agree one
for one up to its end) and get the same greedy answer. Also: `rag: false`, the official
`openai` client (streamed too; the raw first chunk carries the sources), /metrics, the chat
page's citations in headless Chromium (screenshot serve-rag.png in the test artifacts) and
the one-line refusal of a missing index.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import openai
import pytest
from cli_support import REPO, cli_env, error_lines, run_cli
from hf_models import make_tiny_causal_lm
from process_support import free_port
from serve_support import PARAMS, Server

pytestmark = pytest.mark.slow

ARTIFACTS = Path(os.environ.get("GPTFORGE_TEST_ARTIFACTS", REPO / "test-artifacts"))
POSITIONS = 256
MAX_TOKENS = 16
BLOCK = 16  # the engine's prefix-cache block (serve.prefix_cache.BLOCK_SIZE)
INSTRUCTION = "Answer the question using the context below. If the context does not hold the answer, say so."
NILE_QUESTION = "Which river flows through Khartoum and Cairo?"
DANUBE_QUESTION = "Which river flows through Vienna and Budapest?"

NILE = " ".join(
    [
        "The Nile is a major north-flowing river in northeastern Africa and flows into the Mediterranean Sea.",
        "It runs through Khartoum, where the White Nile and the Blue Nile meet, and then through Cairo.",
        "Its drainage basin covers eleven countries, and for thousands of years it fed the farms of Egypt.",
    ]
    + [
        f"At the {n} cataract the boatmen of the old stories carried their boats around rapids of granite, "
        f"and the villages on both banks traded dates, grain and linen with the caravans from the desert."
        for n in ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")
    ]
)
DANUBE = (
    "The Danube is the second-longest river in Europe. It flows through Vienna, Bratislava, Budapest and "
    "Belgrade before it reaches the Black Sea."
)
AMAZON = "The Amazon carries more water than any other river and flows through Manaus and the rainforest of Brazil."
DOCUMENT = f"# Rivers\n\n## The Nile\n\n{NILE}\n\n## The Danube\n\n{DANUBE}\n\n## The Amazon\n\n{AMAZON}\n"


def make_index(folder: Path):
    """An index of DOCUMENT, one chunk per section (spans into the document, heading paths)."""
    from gptforge.rag.index import build
    from gptforge.synthesize.chunks import Chunk

    chunks = []
    for i, (heading, text) in enumerate((("The Nile", NILE), ("The Danube", DANUBE), ("The Amazon", AMAZON))):
        start = DOCUMENT.index(text)
        chunks.append(
            Chunk(f"rivers.md#{i}", "rivers.md", ("Rivers", heading), start, start + len(text), text, len(text.split()))
        )
    return build(chunks, folder, name="rivers", chunks_sha256="test")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("serve-rag")
    llama = make_tiny_causal_lm(root / "llama", "llama", max_positions=POSITIONS)
    index = make_index(root / "index" / "rivers")
    server = Server([f"short={llama}"], root, "--rag", str(index.folder), "--rag-top-k", "3")
    try:
        yield {
            "server": server,
            "index": index,
            "root": root,
            "llama": llama,
            "tok": AutoTokenizer.from_pretrained(str(llama)),
        }
    finally:
        server.stop()


@pytest.fixture
def client(setup):
    return openai.OpenAI(base_url=f"{setup['server'].url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_tokens(tok, content: str) -> list[int]:
    """The ids of a one-message chat as the model's own template renders it (not the server's code)."""
    enc = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return list(enc if isinstance(enc, list) else enc["input_ids"])


def layout(question: str, parts: list[tuple[str, str]]) -> str:
    """The documented prompt layout (docs/serving.md), written out here."""
    context = "\n\n".join(f"[{n}] {where}\n{text}" for n, (where, text) in enumerate(parts, 1))
    return f"{INSTRUCTION}\n\nContext:\n{context}\n\nQuestion: {question}"


def next_word(text: str, kept: int) -> int:
    """How many characters more the cut text would keep with one more word."""
    end = text.find(" ", kept + 1)
    return (end if end > 0 else len(text)) - kept


def rebuilt(index, question: str, sources: list[dict], cut_extra: int = 0) -> str:
    """The user's turn that `sources` describe (the cut chunk `cut_extra` characters longer)."""
    chunks = {c.id: c for c in index.chunks}
    parts = []
    for s in sources:
        c = chunks[s["id"]]
        if s["included"] == "whole":
            parts.append((" > ".join([c.source, *c.headings]), c.text))
        elif s["included"] == "cut":
            parts.append((" > ".join([c.source, *c.headings]), c.text[: s["chars_included"] + cut_extra]))
    return layout(question, parts)


def metrics_text(setup) -> str:
    return httpx.get(f"{setup['server'].url}/metrics", timeout=10).text


def series(text: str, name: str, default: float | None = None, **labels) -> float:
    """One series of /metrics text; `default` when it is not there (a counter not counted yet)."""
    for line in text.splitlines():
        found = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if found and dict(re.findall(r'(\w+)="([^"]*)"', found.group(1))) == labels:
            return float(found.group(2))
    assert default is not None, f"{name}{labels} not in /metrics"
    return default


def test_the_best_chunk_is_cut_to_fit_and_the_engine_gets_that_prompt(setup):
    url, index, tok = setup["server"].url, setup["index"], setup["tok"]
    hits = index.search(NILE_QUESTION, 3)
    assert hits[0].chunk.id == "rivers.md#0"  # the Nile's section, longer than the whole context
    assert len(tok(NILE)["input_ids"]) > POSITIONS

    r = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "short",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": [{"role": "user", "content": NILE_QUESTION}],
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    sources = body["sources"]
    assert [s["id"] for s in sources] == [h.chunk.id for h in hits]
    assert [s["rank"] for s in sources] == [1, 2, 3]
    assert [s["included"] for s in sources] == ["cut", "dropped", "dropped"]
    nile = sources[0]
    assert nile["file"] == "rivers.md" and nile["headings"] == ["Rivers", "The Nile"]
    assert nile["span"] == [DOCUMENT.index(NILE), DOCUMENT.index(NILE) + len(NILE)]
    assert nile["score"] == pytest.approx(hits[0].score, rel=1e-5)
    kept = nile["chars_included"]
    assert 100 < kept < len(NILE) and NILE[kept] == " "  # cut at a word boundary, most of a context's worth

    # The prompt, rebuilt and tokenized here, is what the server counted, and it fills the room
    # before max_tokens.
    prompt = chat_tokens(tok, rebuilt(index, NILE_QUESTION, sources))
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert len(prompt) <= POSITIONS - MAX_TOKENS
    # and the cut is the longest at a word's end: one word more would not fit
    longer = chat_tokens(tok, rebuilt(index, NILE_QUESTION, sources, next_word(NILE, kept)))
    assert len(longer) > POSITIONS - MAX_TOKENS
    print(f"cut the Nile to {kept} of {len(NILE)} characters: a prompt of {len(prompt)} tokens")

    # Through the engine: those ids as a plain completion find the whole augmented prompt in its
    # prefix cache, and the greedy answer is the same.
    before = series(metrics_text(setup), "gptforge_prefix_cache_hit_tokens_total", 0.0, model="short")
    again = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": "short", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
    )
    assert again.status_code == 200, again.text
    hit = series(metrics_text(setup), "gptforge_prefix_cache_hit_tokens_total", model="short") - before
    assert hit == (len(prompt) - 1) // BLOCK * BLOCK, (hit, len(prompt))
    assert again.json()["choices"][0]["text"] == body["choices"][0]["message"]["content"]
    assert "sources" not in again.json()  # plain completions are not augmented


def test_rag_false_sends_the_plain_question(setup):
    r = httpx.post(
        f"{setup['server'].url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "short",
            "max_tokens": MAX_TOKENS,
            "rag": False,
            "messages": [{"role": "user", "content": NILE_QUESTION}],
        },
    )
    assert r.status_code == 200, r.text
    assert "sources" not in r.json()
    assert r.json()["usage"]["prompt_tokens"] == len(chat_tokens(setup["tok"], NILE_QUESTION))
    bad = httpx.post(
        f"{setup['server'].url}/v1/chat/completions",
        timeout=60,
        json={"model": "short", "rag": "no", "messages": [{"role": "user", "content": NILE_QUESTION}]},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rag", bad.text


def test_whole_chunks_come_first_and_a_conversation_keeps_its_earlier_turns(setup):
    """The Danube's and the Amazon's short sections fit whole, the Nile's is cut behind them; only the last user
    message is augmented, and without max_tokens a quarter of the context is left to the answer."""
    index, tok = setup["index"], setup["tok"]
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": DANUBE_QUESTION},
    ]
    r = httpx.post(
        f"{setup['server'].url}/v1/chat/completions", timeout=60, json={"model": "short", "messages": messages}
    )
    assert r.status_code == 200, r.text
    sources = r.json()["sources"]
    assert [s["id"] for s in sources] == [h.chunk.id for h in index.search(DANUBE_QUESTION, 3)]
    assert [s["id"] for s in sources] == ["rivers.md#1", "rivers.md#2", "rivers.md#0"]
    assert [s["included"] for s in sources] == ["whole", "whole", "cut"]
    room = POSITIONS // 4  # no max_tokens: the chunks leave a quarter of this short context to the answer

    def tokens(cut_extra: int = 0) -> int:
        turn = rebuilt(index, DANUBE_QUESTION, sources, cut_extra)
        enc = tok.apply_chat_template([*messages[:2], {"role": "user", "content": turn}], add_generation_prompt=True)
        return len(enc if isinstance(enc, list) else enc["input_ids"])

    assert r.json()["usage"]["prompt_tokens"] == tokens()
    assert tokens() <= POSITIONS - room < tokens(next_word(NILE, sources[2]["chars_included"]))


def test_the_openai_client_streamed_and_not(setup, client):
    messages = [{"role": "user", "content": NILE_QUESTION}]
    done = client.chat.completions.create(model="short", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].message.role == "assistant" and done.usage.completion_tokens >= 1
    raw = client.chat.completions.with_raw_response.create(
        model="short", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert raw.parse().choices[0].message.content == done.choices[0].message.content
    assert raw.http_response.json()["sources"][0]["included"] == "cut"
    off = client.chat.completions.with_raw_response.create(
        model="short", messages=messages, max_tokens=MAX_TOKENS, extra_body={"rag": False}
    )
    assert "sources" not in off.http_response.json()

    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="short", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == done.choices[0].message.content

    # The raw stream: the sources on the first chunk only.
    with httpx.stream(
        "POST",
        f"{setup['server'].url}/v1/chat/completions",
        timeout=60,
        json={"model": "short", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True},
    ) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["sources"] == raw.http_response.json()["sources"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("sources" not in c for c in chunks[1:]) and len(chunks) > 2


def test_metrics_count_retrieval(setup):
    before = metrics_text(setup)
    n = series(before, "gptforge_rag_retrieval_seconds_count", model="short")
    dropped = series(before, "gptforge_rag_chunks_total", model="short", included="dropped")
    r = httpx.post(
        f"{setup['server'].url}/v1/chat/completions",
        timeout=60,
        json={"model": "short", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": NILE_QUESTION}]},
    )
    assert r.status_code == 200, r.text
    after = metrics_text(setup)
    assert series(after, "gptforge_rag_retrieval_seconds_count", model="short") == n + 1
    assert series(after, "gptforge_rag_fit_seconds_count", model="short") == n + 1
    assert series(after, "gptforge_rag_requests_total", model="short") == n + 1
    assert series(after, "gptforge_rag_chunks_total", model="short", included="dropped") == dropped + 2
    assert series(after, "gptforge_rag_chunks_total", model="short", included="cut") >= 1
    seconds = series(after, "gptforge_rag_retrieval_seconds_sum", model="short")
    assert 0 < seconds < n + 1  # well under a second a search
    fit = series(after, "gptforge_rag_fit_seconds_sum", model="short")
    print(
        f"retrieval: {1000 * seconds / (n + 1):.2f} ms a search, {1000 * fit / (n + 1):.1f} ms fitting, "
        f"over {n + 1:.0f} requests"
    )
    assert series(after, "gptforge_rag_retrieval_seconds_bucket", model="short", le="+Inf") == n + 1


def test_the_chat_page_shows_the_citations_of_a_streamed_answer(setup, browser):
    with browser.open(f"{setup['server'].url}/") as page:
        page.wait_for("document.body.dataset.modelsLoaded === '1'", what="the model list")
        page.type("#temperature", "0")
        page.type("#max-tokens", str(MAX_TOKENS))
        page.type("#prompt", DANUBE_QUESTION)
        page.click("#send")
        page.wait_for(
            "document.querySelectorAll('#messages .msg.assistant').length === 1 && "
            "document.body.dataset.state === 'idle'",
            what="the answer",
        )
        assert page.text("#chat-error") == ""
        cites = page.evaluate(
            "[...document.querySelectorAll('#messages .msg.assistant .sources li')].map(li => li.textContent)"
        )
        assert cites[0] == "[1] rivers.md > Rivers > The Danube", cites
        assert cites[1] == "[2] rivers.md > Rivers > The Amazon", cites
        assert re.fullmatch(r"\[3\] rivers\.md > Rivers > The Nile \(cut to \d+ of \d+ characters\)", cites[2]), cites
        assert len(cites) == 3, cites
        # Under the answer, at the end of its message.
        assert page.evaluate("document.getElementById('answer').parentNode.lastElementChild.className") == "sources"
        page.screenshot(ARTIFACTS / "serve-rag.png")
        assert not [line for line in page.console if line.startswith("exception")], page.console


def test_a_missing_index_is_one_line(setup, tmp_path):
    out = run_cli(
        [
            "serve",
            str(setup["llama"]),
            "--rag",
            str(tmp_path / "missing"),
            "--port",
            str(free_port()),
            "--params",
            str(PARAMS),
        ],
        tmp_path,
        cli_env(),
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and "--rag" in lines[0] and "not a gptforge index" in lines[0], out.stderr
    assert out.stderr.strip() == lines[0], out.stderr
    out = run_cli(
        [
            "serve",
            str(setup["llama"]),
            "--rag",
            str(setup["index"].folder),
            "--rag-top-k",
            "0",
            "--params",
            str(PARAMS),
        ],
        tmp_path,
        cli_env(),
        timeout=120,
    )
    assert out.returncode == 2 and error_lines(out.stderr) == ["gptforge: error: --rag-top-k must be >= 1, got 0"], (
        out.stderr
    )
