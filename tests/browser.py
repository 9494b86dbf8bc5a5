"""Headless Chromium driven over the DevTools protocol, for checks of the Prefect and MLflow UIs.

Both UIs are single-page apps that fetch their data after the page loads, so a one-shot
`chromium --dump-dom` sees an empty shell. This opens the page, polls the rendered text until
the expected words appear (or a deadline passes), and saves a screenshot. Debian's `chromium`
package is enough: no driver, no browser download (FACTS: a download fails here).
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

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--window-size=1600,1000"]


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Browser:
    def __init__(self, binary: str, port: int) -> None:
        self.profile = tempfile.mkdtemp(prefix="gptforge-chromium-")
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}",
                                      f"--remote-debugging-port={port}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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

    def page_text_and_screenshot(self, url: str, expect: list[str], png: Path, timeout: float = 90) -> str:
        """Load `url`, wait until every string in `expect` is in the page's text, save a
        screenshot to `png`; returns the text (raises AssertionError naming what is missing)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(req, timeout=10) as r:
            target = json.load(r)
        ids = itertools.count(1)
        with connect(target["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=20) as ws:
            def call(method: str, **params):
                i = next(ids)
                ws.send(json.dumps({"id": i, "method": method, "params": params}))
                while True:
                    msg = json.loads(ws.recv(timeout=60))
                    if msg.get("id") == i:
                        if "error" in msg:
                            raise RuntimeError(f"{method}: {msg['error']}")
                        return msg.get("result", {})

            call("Page.enable")
            call("Page.navigate", url=url)
            deadline = time.monotonic() + timeout
            text = ""
            while time.monotonic() < deadline:
                text = call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                            returnByValue=True).get("result", {}).get("value", "")
                if all(word in text for word in expect):
                    time.sleep(1.0)  # let the last requests paint
                    break
                time.sleep(1.0)
            shot = call("Page.captureScreenshot", format="png")
            png.parent.mkdir(parents=True, exist_ok=True)
            png.write_bytes(base64.b64decode(shot["data"]))
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
