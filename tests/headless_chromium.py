"""Open a local HTML file or a loopback URL in headless Chromium over the DevTools protocol (tests only).

Collects console messages, uncaught exceptions and browser log entries (failed resource loads), runs
a JavaScript expression in the page and saves a full-page screenshot. Needs Debian's ``chromium``
and the ``websockets`` package; ``unavailable()`` says why not when either is missing.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTALL = "Chromium absent: apt-get install -y chromium (and pip install websockets)"
# No network: the page must need none, and Chromium's own background requests would be refused.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--remote-debugging-port=0",
    "--window-size=1280,900",
]


def executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def unavailable() -> str | None:
    try:
        import websockets.sync.client  # noqa: F401
    except ImportError:
        return INSTALL
    return None if executable() else INSTALL


@dataclass
class PageResult:
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, failed loads
    value: Any = None  # the evaluated expression


class _Session:
    def __init__(self, ws: Any) -> None:
        self.ws, self.next_id, self.events = ws, 0, []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, event: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == event for e in self.events):
            self.events.append(json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.1))))

    def drain(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.events.append(json.loads(self.ws.recv(timeout=end - time.monotonic())))
            except TimeoutError:
                return


def open_page(html_file: Path, expression: str, screenshot: Path) -> PageResult:
    return open_url(html_file.resolve().as_uri(), expression, screenshot)


def open_url(url: str, expression: str, screenshot: Path) -> PageResult:
    from websockets.sync.client import connect

    # Chromium's helper processes (crashpad, utility) may still write to the profile for a moment after the
    # browser exits; a profile left behind in /tmp must not fail the page check that already passed.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [executable(), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            port = _devtools_port(proc, Path(profile))
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as resp:
                target = next(t for t in json.load(resp) if t["type"] == "page")
            with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
                return _inspect(_Session(ws), url, expression, screenshot)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _devtools_port(proc: subprocess.Popen, profile: Path) -> int:
    """Chromium writes the port it chose to DevToolsActivePort in its profile."""
    deadline = time.monotonic() + 60
    marker = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if marker.is_file() and marker.read_text().strip():
            return int(marker.read_text().splitlines()[0])
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError("chromium did not open its DevTools port within 60 s")


def _inspect(session: _Session, url: str, expression: str, screenshot: Path) -> PageResult:
    for domain in ("Page", "Runtime", "Log"):
        session.call(f"{domain}.enable")
    session.call("Page.navigate", url=url)
    session.wait_for("Page.loadEventFired")
    session.drain(0.5)  # late console messages
    value = session.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")
    metrics = session.call("Page.getLayoutMetrics")["cssContentSize"]
    shot = session.call(
        "Page.captureScreenshot",
        format="png",
        captureBeyondViewport=True,
        clip={"x": 0, "y": 0, "width": metrics["width"], "height": min(metrics["height"], 6000), "scale": 1},
    )
    screenshot.write_bytes(base64.b64decode(shot["data"]))
    result = PageResult(value=value)
    for e in session.events:
        method, params = e.get("method"), e.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            result.errors.append("console: " + " ".join(str(a.get("value")) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            result.errors.append("exception: " + params["exceptionDetails"].get("text", ""))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            result.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
    return result
