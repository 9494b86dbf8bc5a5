"""Headless Chromium driven over the DevTools protocol, for checks of the Prefect and MLflow UIs
and of the chat page of `gptforge serve`.

The UIs are single-page apps that fetch their data after the page loads, so a one-shot
`chromium --dump-dom` sees an empty shell. `Browser.page_text_and_screenshot` opens a page,
polls the rendered text until the expected words appear (or a deadline passes), and saves a
screenshot. `Browser.open(url)` gives a `Page` that is driven as a person uses it: real key and
mouse input (`type`, `click`), waits for an element or a condition, reads text, evaluates
JavaScript, screenshots. Debian's `chromium` package is enough: no driver, no browser
download (FACTS: a download fails here).
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1600,1000",
]


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Browser:
    def __init__(self, binary: str, port: int) -> None:
        self.profile = tempfile.mkdtemp(prefix="gptforge-chromium-")
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile}", f"--remote-debugging-port={port}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.port = port
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("chromium did not start its DevTools endpoint")
                time.sleep(0.3)

    def open(self, url: str) -> "Page":
        """A new tab on `url` (a context manager: leaving it closes the connection)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(req, timeout=10) as r:
            target = json.load(r)
        page = Page(target["webSocketDebuggerUrl"])
        page.call("Page.enable")
        page.call("Runtime.enable")
        nav = page.call("Page.navigate", url=url)
        if nav.get("errorText"):
            page.close()
            raise RuntimeError(f"{url}: {nav['errorText']}")
        deadline = time.monotonic() + 60
        while True:  # until the new document has loaded (evaluate may fail while it commits)
            try:
                if page.evaluate("location.href !== 'about:blank' && document.readyState === 'complete'"):
                    return page
            except RuntimeError:
                pass
            if time.monotonic() > deadline:
                page.close()
                raise TimeoutError(f"{url} did not load within 60 s")
            time.sleep(0.05)

    def page_text_and_screenshot(self, url: str, expect: list[str], png: Path, timeout: float = 90) -> str:
        """Load `url`, wait until every string in `expect` is in the page's text, save a
        screenshot to `png`; returns the text (raises AssertionError naming what is missing)."""
        with self.open(url) as page:
            deadline = time.monotonic() + timeout
            text = ""
            while time.monotonic() < deadline:
                text = page.evaluate("document.body ? document.body.innerText : ''")
                if all(word in text for word in expect):
                    time.sleep(1.0)  # let the last requests paint
                    break
                time.sleep(1.0)
            page.screenshot(png)
        missing = [w for w in expect if w not in text]
        assert not missing, f"{url}: {missing} not on the page after {timeout:.0f} s (screenshot {png})"
        return text

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    """One tab over its DevTools websocket. Elements are named by CSS selectors; every wait
    raises TimeoutError naming what it waited for; JavaScript errors raise RuntimeError."""

    def __init__(self, ws_url: str) -> None:
        self.ws = connect(ws_url, max_size=64 * 2**20, open_timeout=20)
        self.ids = itertools.count(1)
        self.console: list[str] = []  # the page's console messages and uncaught exceptions

    def __enter__(self) -> "Page":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.ws.close()

    def call(self, method: str, **params) -> dict:
        """Send one DevTools command and return its result (events in between are kept as
        console lines when they are console output or exceptions, else dropped)."""
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if msg.get("method") == "Runtime.consoleAPICalled":
                args = msg["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif msg.get("method") == "Runtime.exceptionThrown":
                details = msg["params"]["exceptionDetails"]
                self.console.append("exception: " + details.get("exception", {}).get("description", details["text"]))

    def evaluate(self, expression: str, await_promise: bool = False):
        """The value of a JavaScript expression (JSON-serialisable values come back as Python)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=await_promise)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(
                f"{expression[:80]!r}: {details.get('exception', {}).get('description', details.get('text'))}"
            )
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 30, interval: float = 0.05, what: str | None = None):
        """Poll a JavaScript expression until it is truthy (as JavaScript judges it: an element
        is); returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            truthy, value = self.evaluate(f"(v => [!!v, v])({expression})")
            if truthy:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what or expression}")
            time.sleep(interval)

    def wait_for_selector(self, selector: str, timeout: float = 30, visible: bool = True) -> None:
        """Wait until an element matches `selector` (and, with `visible`, has a box on screen)."""
        sel = json.dumps(selector)
        check = (
            f"(() => {{ const e = document.querySelector({sel}); "
            f"return !!e && {'e.getClientRects().length > 0' if visible else 'true'}; }})()"
        )
        self.wait_for(check, timeout, what=f"{'a visible ' if visible else ''}{selector}")

    def wait_for_text(self, selector: str, text: str, timeout: float = 30) -> str:
        """Wait until the element's textContent contains `text`; returns that textContent."""
        sel, want = json.dumps(selector), json.dumps(text)
        self.wait_for(
            f"(() => {{ const e = document.querySelector({sel}); return !!e && e.textContent.includes({want}); }})()",
            timeout,
            what=f"{text!r} in {selector}",
        )
        return self.text(selector)

    def text(self, selector: str) -> str:
        """The element's textContent (raises when nothing matches)."""
        value = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
            "return e === null ? null : e.textContent; })()"
        )
        if value is None:
            raise LookupError(f"no element matches {selector}")
        return value

    def _center(self, selector: str) -> tuple[float, float]:
        """Scroll the element into view and return its center in the viewport; raises when it
        has no box or another element covers its center (a person could not click it)."""
        sel = json.dumps(selector)
        box = self.evaluate(f"""(() => {{
            const e = document.querySelector({sel});
            if (e === null) return {{error: "no element matches"}};
            e.scrollIntoView({{block: "center", inline: "center"}});
            const r = e.getBoundingClientRect();
            if (r.width === 0 || r.height === 0) return {{error: "it has no box (hidden?)"}};
            const x = r.left + r.width / 2, y = r.top + r.height / 2;
            const top = document.elementFromPoint(x, y);
            if (top === null || !(top === e || e.contains(top)))
                return {{error: "its center is covered by " + (top ? top.outerHTML.slice(0, 80) : "nothing")}};
            return {{x, y}};
        }})()""")
        if "error" in box:
            raise RuntimeError(f"cannot click {selector}: {box['error']}")
        return box["x"], box["y"]

    def click(self, selector: str) -> None:
        """A left click at the element's center: mouse move, press, release (real input events)."""
        x, y = self._center(selector)
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", buttons=1, clickCount=1)

    def type(self, selector: str, text: str, clear: bool = True) -> None:
        """Click into the element and type `text` (Input.insertText: input events as from a
        keyboard); with `clear`, select what is there first so the typing replaces it."""
        self.click(selector)
        if clear:
            self.evaluate(f"document.querySelector({json.dumps(selector)}).select()")
        self.call("Input.insertText", text=text)

    def press(self, key: str, code: str | None = None, key_code: int | None = None) -> None:
        """Press and release one key, e.g. press("Enter", "Enter", 13)."""
        params = {"key": key, "code": code or key}
        if key_code is not None:
            params.update(windowsVirtualKeyCode=key_code, nativeVirtualKeyCode=key_code)
        text = {"Enter": "\r"}.get(key, key if len(key) == 1 else "")
        self.call("Input.dispatchKeyEvent", type="keyDown", text=text, **params)
        self.call("Input.dispatchKeyEvent", type="keyUp", **params)

    def select(self, selector: str, value: str) -> None:
        """Choose an <option> of a <select> by its value. Headless Chromium draws no popup to
        click, so this sets the value and fires the input and change events a choice fires."""
        ok = self.evaluate(f"""(() => {{
            const s = document.querySelector({json.dumps(selector)});
            if (s === null || ![...s.options].some(o => o.value === {json.dumps(value)})) return false;
            s.focus(); s.value = {json.dumps(value)};
            s.dispatchEvent(new Event("input", {{bubbles: true}}));
            s.dispatchEvent(new Event("change", {{bubbles: true}}));
            return true;
        }})()""")
        if not ok:
            raise LookupError(f"{selector} has no option {value!r}")

    def screenshot(self, png: Path) -> Path:
        shot = self.call("Page.captureScreenshot", format="png")
        png.parent.mkdir(parents=True, exist_ok=True)
        png.write_bytes(base64.b64decode(shot["data"]))
        return png
