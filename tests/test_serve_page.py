"""The chat page of `gptforge serve` in headless Chromium, driven as a person uses it: a real
server (subprocess, 127.0.0.1, an API key), real mouse clicks and typing over the DevTools
protocol (tests/browser.py).

The chat model is a tiny Hugging Face Llama whose greedy answer is a fixed string holding
`<script>` and an `<img onerror=...>` that would set `window.__pwned` if the page inserted the
answer unsanitized: the page renders answers as Markdown (the vendored marked) through the
vendored DOMPurify, and what it shows must hold neither. Its weights make greedy decoding follow
a chain of tokens: every layer's o_proj and down_proj are zero, so the residual stream carries
the current token's embedding to the final norm; the chain's tokens get orthogonal embeddings
and lm_head's row for token b is a large multiple of the embedding of the token before it, so
after a the largest logit is the next token of the chain, from the last token of the chat
template's generation prompt to the eos. Such a chain needs every token in it once (the state is
the current token), so the answer is spelled with distinct tokens (`distinct_tokens`): a piece
that comes back (`script`) is spelled with other tokens the second time. A twin whose chain goes
back to its first answer token instead of the eos answers for as long as max_tokens lets it: the
Stop button's test. The classifier is a random head on the first model (the test compares the
page with the API).

The server's engines hold once, after their 5th step (gptforge.runtime.pause, the same file for
both language models): the page is checked mid-answer, and stopped there, instead of racing the
model's speed. The Markdown rendering itself (code blocks, lists, tables, links, and more hostile
HTML) is checked on the page of a server without models, through the page's own renderMarkdown.
The screenshots, serve-chat.png, serve-classify.png and serve-markdown.png, are test artifacts
(under $GPTFORGE_TEST_ARTIFACTS or test-artifacts/).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import types
import urllib.request
from pathlib import Path

import pytest
import tomllib
from cli_support import BIN, REPO, cli_env
from hf_models import make_tokenizer
from process_support import Paused, free_port, stop_process, wait_http

pytestmark = pytest.mark.slow

STATIC = REPO / "src" / "gptforge" / "serve" / "static"  # the chat page's files
ARTIFACTS = Path(os.environ.get("GPTFORGE_TEST_ARTIFACTS", REPO / "test-artifacts"))
ANSWER = "Sure! Here is some HTML for you: <script>alert(0)</script><img src=\"x\" onerror='window.__pwned=1'> Enjoy."
SHOWN = "Sure! Here is some HTML for you:  Enjoy."  # ANSWER rendered: the <script> gone, the <img> shows no text
KEY = "page-test-key"
SPAM = "WINNER!! You have won a 1000 cash prize. Call 09061701461 now"
PAUSE_AT = 5  # each engine's step (token) at which it holds once


def distinct_tokens(tok, text: str, avoid: set[int]) -> list[int]:
    """Token ids that decode to `text`, none repeated and none in `avoid`: a depth-first search
    over the vocabulary's tokens that match at each place, longest first."""
    vocab = {tok.convert_tokens_to_string([t]): i for t, i in tok.get_vocab().items() if i not in avoid}
    starting: dict[str, list[tuple[str, int]]] = {}
    for piece, i in vocab.items():
        if piece:
            starting.setdefault(piece[0], []).append((piece, i))
    for pieces in starting.values():
        pieces.sort(key=lambda p: -len(p[0]))

    def search(pos: int, used: frozenset) -> list[int] | None:
        if pos == len(text):
            return []
        for piece, i in starting.get(text[pos], []):
            if i not in used and text.startswith(piece, pos):
                rest = search(pos + len(piece), used | {i})
                if rest is not None:
                    return [i, *rest]
        return None

    ids = search(0, frozenset())
    assert ids is not None and tok.decode(ids) == text, f"no tokenization of {text!r} with distinct tokens"
    return ids


def make_chain_lm(folder: Path, answer: str, loop: bool = False, positions: int = 256) -> Path:
    """A tiny Llama (GPT-2 tokenizer, ChatML template) whose greedy answer to any chat is `answer`;
    with `loop`, `answer` over and over until max_tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(folder)
    start = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)["input_ids"][-1]
    ids = distinct_tokens(tok, answer, {start, tok.eos_token_id})
    chain = [start, *ids, ids[0] if loop else tok.eos_token_id]
    hidden = 64
    assert len(chain) - 1 <= hidden, "the chain needs one orthogonal embedding per token"
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=positions,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        basis, _ = torch.linalg.qr(torch.randn(hidden, hidden))
        model.lm_head.weight.zero_()
        for k, (a, b) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[a] = basis[k]
            model.lm_head.weight[b] += 10.0 * basis[k]  # logit 80 after the final norm, 0 for the rest
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """The chain model, its looping twin (both checked with transformers' generate) and a
    classifier on the first (`folders`), and the text of the answer's first PAUSE_AT tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptforge.finetune import classifier as clf
    from gptforge.modeling.hf_causal import HFTokenizer

    root = tmp_path_factory.mktemp("serve-page")
    chat = make_chain_lm(root / "chain", ANSWER)
    lm = AutoModelForCausalLM.from_pretrained(str(chat)).eval()
    tok = AutoTokenizer.from_pretrained(str(chat))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Show me some HTML"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = lm.generate(**prompt, max_new_tokens=80, do_sample=False)
    start = prompt["input_ids"].shape[1]
    assert tok.decode(out[0, start:], skip_special_tokens=True) == ANSWER
    assert out.shape[1] - start > PAUSE_AT + 1  # the hold comes mid-answer
    prefix = tok.decode(out[0, start : start + PAUSE_AT])
    loop = make_chain_lm(root / "loop", ANSWER, loop=True, positions=4096)
    out = AutoModelForCausalLM.from_pretrained(str(loop)).generate(**prompt, max_new_tokens=100, do_sample=False)
    assert tok.decode(out[0, prompt["input_ids"].shape[1] :]).startswith(ANSWER + ANSWER)

    torch.manual_seed(1)
    classifier = clf.HFClassifier(lm, 2, max_length=64, tokenizer=HFTokenizer(tok))
    return {
        "folders": {"chat": chat, "loop": loop, "spam": clf.save_classifier(classifier, root / "classifier")},
        "prefix": prefix,
    }


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """`gptforge serve chat=... loop=... spam=... --api-key KEY` on a free loopback port, its
    engines to hold after step PAUSE_AT: `url`, `proc`, `paused` (process_support.Paused), `log`."""
    folder = tmp_path_factory.mktemp("serve-page-server")
    port = free_port()
    paused = Paused(folder, PAUSE_AT)
    log_path = folder / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            str(BIN / "gptforge"),
            "serve",
            *(f"{name}={path}" for name, path in models["folders"].items()),
            "--port",
            str(port),
            "--api-key",
            KEY,
        ],
        cwd=folder,
        env=cli_env(**paused.env()),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(f"{url}/health", timeout=180, proc=proc)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}\n{log_path.read_text()[-3000:]}") from None
        yield types.SimpleNamespace(url=url, proc=proc, paused=paused, log=lambda: log_path.read_text())
    finally:
        paused.release()  # an engine held at a failure would hold the server's shutdown too
        stop_process(proc)
        log.close()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def metric(url: str, name: str, model: str) -> float:
    """One series of the server's /metrics (labelled with `model`)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}} '):
            return float(line.split()[-1])
    raise LookupError(f"{name} for {model} not in /metrics")


def wait_until_idle(url: str, model: str, timeout: float = 120) -> float:
    """Wait until no request of `model` is decoding; returns its generated-tokens count. The
    timeout is a bound against a hang only: a cancelled row leaves at the engine's next step."""
    deadline = time.monotonic() + timeout
    while metric(url, "gptforge_running_requests", model) > 0:
        assert time.monotonic() < deadline, f"{model} still decoding {timeout:.0f} s after the page stopped it"
        time.sleep(0.1)
    return metric(url, "gptforge_generated_tokens_total", model)


def answer_is(text: str) -> str:
    """A JavaScript condition: the answer shown so far is `text`."""
    return f"(document.getElementById('answer') || {{}}).textContent === {json.dumps(text)}"


# Records, in the page, each render of the answer (its children replaced) and when, with the
# text it shows: the answer as it grows.
WATCH_ANSWER = """(() => {
  window.__renders = [];
  new MutationObserver((records) => {
    const now = performance.now();
    for (const r of records)
      if (r.target.id === "answer") window.__renders.push({t: now, text: r.target.textContent});
  }).observe(document.getElementById("messages"), {childList: true, subtree: true});
  return true;
})()"""


def live(root: str) -> str:
    """A JavaScript expression: the outerHTML of each element under `root` (a selector) that
    could run script: a <script>, <iframe>, <object> or <embed>, an on* attribute, a javascript:
    URL."""
    return (
        f"[...document.querySelectorAll({json.dumps(root + ' *')})].filter(e => "
        "['SCRIPT', 'IFRAME', 'OBJECT', 'EMBED'].includes(e.tagName) || [...e.attributes].some(a => "
        "a.name.startsWith('on') || /^\\s*javascript:/i.test(a.value))).map(e => e.outerHTML)"
    )


def images_settled(root: str) -> str:
    """A JavaScript condition: every <img> under `root` has loaded or failed (so an onerror
    handler left on one would have run)."""
    return f"[...document.querySelectorAll({json.dumps(root + ' img')})].every(i => i.complete)"


def test_chat_page_streams_answers_and_classifies(server, models, browser):
    url, prefix = server.url, models["prefix"]
    with browser.open(f"{url}/") as page:
        # The server wants a key: the first request answers 401 and the page asks for the key.
        page.wait_for_selector("#auth")
        page.type("#api-key", KEY)
        page.click("#api-key-save")
        page.wait_for("document.body.dataset.modelsLoaded === '1'", what="the model lists")
        options = "[...document.querySelectorAll('#{} option')].map(o => o.value)"
        assert page.evaluate(options.format("chat-model")) == ["chat", "loop"]
        assert page.evaluate(options.format("classify-model")) == ["spam"]
        assert page.evaluate("sessionStorage.getItem('gptforge-api-key')") == KEY

        # A question, greedy: the answer streams in as separate deltas and is shown as text.
        page.select("#chat-model", "chat")
        page.type("#temperature", "0")
        page.type("#max-tokens", "100")
        page.evaluate(WATCH_ANSWER)
        page.type("#prompt", "Show me some HTML")
        page.click("#send")
        # The engine holds after its 5th token: the page shows those 5 tokens' text, still streaming.
        server.paused.wait(server.proc, output=server.log)
        page.wait_for(answer_is(prefix), what=f"the first {PAUSE_AT} tokens' text {prefix!r}")
        assert page.evaluate("document.body.dataset.state") == "streaming"
        released = page.evaluate("performance.now()")
        server.paused.release()
        page.wait_for("document.body.dataset.state !== 'streaming'", what="the answer to end")
        assert page.text("#chat-error") == ""
        assert page.text("#answer") == SHOWN
        # The answer was rendered as it came: the first tokens' text before the hold, the rest after.
        renders = page.evaluate("window.__renders")
        before = [r["text"] for r in renders if r["t"] < released]
        assert before and before[-1] == prefix, (released, renders)
        assert len(before) < len(renders) and renders[-1]["text"] == SHOWN, (released, renders)

        # The answer's markup went through DOMPurify: its <script> is gone and its <img> has no
        # onerror; once the image has failed to load (src="x"), nothing from the answer has run.
        assert page.evaluate("document.querySelectorAll('#answer p').length") == 1
        assert page.evaluate(live("#messages")) == []
        page.wait_for(images_settled("#messages"), what="the answer's image to load or fail")
        assert page.evaluate("typeof window.__pwned") == "undefined"

        # The last answer's token count (the usage chunk's), tokens/s after the first token (from
        # the first delta to the last) and time to first token, against the page's own times
        # (#stats' data-*): the first delta came before the hold, the last after it.
        tps, ttft, n = page.text("#tps"), page.text("#ttft"), page.text("#ntokens")
        times = {k: float(v) for k, v in page.evaluate("({...document.getElementById('stats').dataset})").items()}
        usage = post(
            f"{url}/v1/chat/completions",
            {
                "model": "chat",
                "max_tokens": 100,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Show me some HTML"}],
            },
        )
        assert int(n) == usage["usage"]["completion_tokens"], (n, usage)
        assert times["sent"] < times["first"] < released < times["last"], (times, released)
        interval = (times["last"] - times["first"]) / 1000
        assert float(tps) == pytest.approx((int(n) - 1) / interval, abs=0.051), (tps, n, interval)  # shown to 0.1
        wait_ms = times["first"] - times["sent"]
        assert (
            abs(float(ttft[:-3]) - wait_ms) <= 0.5
            if ttft.endswith(" ms")
            else abs(float(ttft[:-2]) * 1000 - wait_ms) <= 5
        ), (ttft, wait_ms)
        print(f"page: {tps} tokens/s over {interval:.3f} s (the hold included), first token after {ttft}")
        page.screenshot(ARTIFACTS / "serve-chat.png")

        # A second turn goes on with the conversation: two user and two assistant messages.
        page.type("#prompt", "And again?")
        page.press("Enter", "Enter", 13)
        page.wait_for(
            "document.querySelectorAll('#messages .msg.assistant').length === 2 && "
            "document.body.dataset.state === 'idle'",
            what="the second answer",
        )
        assert page.text("#answer") == SHOWN
        assert page.evaluate("document.querySelectorAll('#messages .msg.user').length") == 2

        # Stop, in a new chat: an answer that would go on for 4000 tokens, held after its 5th
        # token, ends when the button is pressed, in the page and in the server (its slot is
        # freed, it generates no more).
        page.click("#clear")
        assert page.evaluate("document.querySelectorAll('#messages .msg').length") == 0
        page.select("#chat-model", "loop")
        page.type("#max-tokens", "4000")
        page.type("#prompt", "Go on and on")
        page.click("#send")
        server.paused.wait(server.proc, output=server.log)
        page.wait_for(answer_is(prefix), what=f"the first {PAUSE_AT} tokens' text {prefix!r}")
        page.click("#stop")
        page.wait_for("document.body.dataset.state === 'idle'", what="the stream to stop")
        stopped = page.text("#answer")
        assert stopped == prefix and page.text("#chat-error") == ""
        assert page.text("#messages").endswith("[stopped]")
        server.paused.release()
        generated = wait_until_idle(url, "loop")
        print(f"the stopped answer: {generated:.0f} tokens generated")
        assert PAUSE_AT <= generated < 4000, generated
        assert page.text("#answer") == stopped
        assert metric(url, "gptforge_generated_tokens_total", "loop") == generated
        page.select("#chat-model", "chat")
        page.click("#clear")

        # A request the server refuses: its error message is shown, the prompt comes back to its
        # box, and sent again within the limits it is answered.
        page.type("#max-tokens", "100000")
        page.type("#prompt", "Too long an answer, please")
        page.click("#send")
        error = page.wait_for("document.getElementById('chat-error').textContent", what="an error message")
        assert "max_tokens" in error, error
        page.type("#max-tokens", "100")
        assert page.evaluate("document.getElementById('prompt').value") == "Too long an answer, please"
        assert page.evaluate("document.querySelectorAll('#messages .msg').length") == 0
        page.click("#send")
        page.wait_for(
            "document.querySelectorAll('#messages .msg.assistant').length === 1 && "
            "document.body.dataset.state === 'idle'",
            what="an answer after the error",
        )
        assert page.text("#answer") == SHOWN and page.text("#chat-error") == ""

        # The second tab: the spam classifier.
        page.click("#tab-classify")
        page.wait_for_selector("#classify-input")
        assert page.evaluate("document.getElementById('panel-chat').hidden")
        page.type("#classify-input", SPAM)
        page.click("#classify-send")
        page.wait_for("document.querySelectorAll('#classify-probs tr').length === 2", what="the probabilities")
        want = post(f"{url}/v1/classify", {"model": "spam", "input": SPAM})["data"][0]
        assert page.text("#classify-label") == want["label"]
        rows = page.evaluate(
            "[...document.querySelectorAll('#classify-probs tr')]"
            ".map(tr => [tr.cells[0].textContent, tr.cells[1].textContent])"
        )
        assert {label: float(p) for label, p in rows} == pytest.approx(want["probabilities"], abs=1e-4)
        assert page.text("#classify-error") == ""
        page.screenshot(ARTIFACTS / "serve-classify.png")
        assert not [line for line in page.console if line.startswith("exception")], page.console


@pytest.fixture(scope="module")
def bare_server():
    """The app without models (create_app([])) under uvicorn in a thread, on a free loopback
    port: the page and its files with their headers, nothing to wait for. Its URL."""
    import uvicorn

    from gptforge.serve.app import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app([]), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


MARKDOWN = """Some `inline code` and a [link](https://example.org/).

```python
print("<b>not bold</b>")
```

- one
- two

| name | value |
|:-----|------:|
| a    | 1     |
"""

# Each would run script if the page inserted it unsanitized (and marked passes raw HTML through).
HOSTILE = [
    ANSWER,
    '<a href="javascript:window.__pwned=1">a javascript: link</a>',
    "[a Markdown javascript: link](javascript:window.__pwned=1)",
    "<svg><script>window.__pwned=1</script></svg>",
    '<iframe srcdoc="<script>parent.__pwned=1</script>"></iframe>',
    '<details open ontoggle="window.__pwned=1"><summary>s</summary></details>',
    '<img src="x" onerror="window.__pwned=1">',
]

# Shows each Markdown string of the argument as an answer is shown: the page's addMessage makes
# an assistant turn, its renderMarkdown fills it (the n-th turn's content gets the id md-n).
# Returns the HTML of each.
RENDER = """(texts => texts.map((text) => {
  const content = addMessage("assistant", "");
  content.id = "md-" + (document.getElementById("messages").children.length - 1);
  renderMarkdown(content, text);
  return content.innerHTML;
}))"""


def test_chat_page_renders_answers_as_sanitized_markdown(bare_server, browser):
    # The vendored libraries are served with the page's headers, the bytes of the package's files.
    for name in ("marked.umd.js", "purify.min.js"):
        with urllib.request.urlopen(f"{bare_server}/static/vendor/{name}", timeout=10) as r:
            assert "script-src 'self'" in r.headers["content-security-policy"]
            assert "javascript" in r.headers["content-type"], r.headers["content-type"]
            assert r.read() == (STATIC / "vendor" / name).read_bytes()

    with browser.open(f"{bare_server}/") as page:
        page.wait_for("document.body.dataset.modelsLoaded === '1'", what="the (empty) model lists")
        assert page.evaluate("typeof marked.parse === 'function' && DOMPurify.isSupported") is True
        html = page.evaluate(f"{RENDER}({json.dumps([MARKDOWN])})[0]")
        md = "document.querySelector('#md-0 {}')"
        assert (
            page.evaluate(md.format("pre > code.language-python") + ".textContent") == 'print("<b>not bold</b>")\n'
        ), html
        assert page.evaluate("document.querySelectorAll('#md-0 pre b').length") == 0, html
        assert page.evaluate(md.format("p > code") + ".textContent") == "inline code", html
        assert page.evaluate("[...document.querySelectorAll('#md-0 ul > li')].map(e => e.textContent)") == [
            "one",
            "two",
        ], html
        cells = "[...document.querySelectorAll('#md-0 table {}')].map(e => e.textContent)"
        assert page.evaluate(cells.format("thead th")) == ["name", "value"], html
        assert page.evaluate(cells.format("tbody td")) == ["a", "1"], html
        link = page.evaluate(f"(a => [a.href, a.target, a.rel])({md.format('a')})")
        assert link == ["https://example.org/", "_blank", "noopener noreferrer"], html
        page.screenshot(ARTIFACTS / "serve-markdown.png")

        # Hostile HTML, raw or as Markdown: nothing that could run is left, and nothing ran.
        shown = page.evaluate(f"{RENDER}({json.dumps(HOSTILE)})")
        assert page.evaluate(live("#messages")) == [], shown
        page.wait_for(images_settled("#messages"), what="the answers' images to load or fail")
        assert page.evaluate("typeof window.__pwned") == "undefined", shown
        # The javascript: links (turns md-2 and md-3) keep their text, without a URL.
        links = "[...document.querySelectorAll('#md-2 a, #md-3 a')].map(a => [a.textContent, a.getAttribute('href')])"
        assert page.evaluate(links) == [["a javascript: link", None], ["a Markdown javascript: link", None]], shown
        assert not [line for line in page.console if line.startswith("exception")], page.console


def test_page_files_are_package_data():
    """Every file of the page (static/ and its vendor/ folder) is in pyproject.toml's package
    data, so an installed gptforge serves it too."""
    package = REPO / "src" / "gptforge"
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gptforge"]
    covered = {p for pattern in patterns for p in package.glob(pattern) if p.is_file()}
    files = {p for p in STATIC.rglob("*") if p.is_file()}
    assert (STATIC / "vendor" / "purify.min.js") in files and files <= covered, sorted(map(str, files - covered))
