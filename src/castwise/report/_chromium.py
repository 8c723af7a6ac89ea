"""Open an HTML report in headless Chromium and look at it: for the tests, the 7B benchmark and
the screenshots in docs/. Standard library only.

It speaks the DevTools protocol over ``--remote-debugging-pipe`` (Chromium reads commands on fd 3
and writes replies on fd 4, NUL-separated JSON), so no websocket client is needed. It records
every console message, uncaught exception and network request the page makes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

from castwise.errors import BrowserError as BrowserError

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
)


def find_chromium() -> str | None:
    """The Chromium executable ($CASTWISE_CHROMIUM, or chromium / chromium-browser on PATH)."""
    for name in (os.environ.get("CASTWISE_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


@dataclass
class PageLog:
    console: list[tuple[str, str]] = field(default_factory=list)  # (level, text)
    exceptions: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # URLs the page asked for

    @property
    def errors(self) -> list[str]:
        return [t for lv, t in self.console if lv in ("error", "assert")] + self.exceptions


class Chromium:
    """One headless Chromium with one page; a context manager."""

    def __init__(self, executable: str | None = None, width: int = 1280, height: int = 900) -> None:
        exe = executable or find_chromium()
        if exe is None:
            raise BrowserError(
                "headless Chromium not found; install it (Debian: apt-get install chromium) or set "
                "CASTWISE_CHROMIUM to its path"
            )
        self._profile = tempfile.mkdtemp(prefix="castwise-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # above 10 so the child's dup2 onto 3 and 4 cannot clobber one with the other
        high_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
        high_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
        for fd in (to_child_r, from_child_w):
            os.close(fd)

        def wire() -> None:  # in the child: the protocol's fixed descriptors
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        args = [
            exe,
            *FLAGS,
            f"--user-data-dir={self._profile}",
            "--remote-debugging-pipe",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=wire,
            pass_fds=(3, 4, high_r, high_w),
        )
        os.close(high_r)
        os.close(high_w)
        self._buf = b""
        self._next = 0
        self.session = ""
        self.log = PageLog()
        self.width, self.height = width, height
        self._open_page()

    # -- protocol ---------------------------------------------------------------------------

    def _read_message(self) -> dict[str, Any]:
        while b"\0" not in self._buf:
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                raise BrowserError("Chromium closed the DevTools pipe (it exited)")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def _record(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.log.console.append((params.get("type", ""), text))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.log.exceptions.append(str(details.get("exception", {}).get("description") or details.get("text")))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.log.console.append((entry.get("level", ""), str(entry.get("text", ""))))
        elif method == "Network.requestWillBeSent":
            self.log.requests.append(str(params.get("request", {}).get("url", "")))

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: bool = True) -> dict[str, Any]:
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self._record(reply)

    def wait_for(self, event: str) -> dict[str, Any]:
        while True:
            message = self._read_message()
            self._record(message)
            if message.get("method") == event:
                return message

    def _open_page(self) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False},
        )

    # -- page -------------------------------------------------------------------------------

    def open(self, path: str) -> None:
        """Load a local file and wait until it has loaded."""
        self.log = PageLog()
        self.send("Page.navigate", {"url": "file://" + os.path.abspath(path)})
        self.wait_for("Page.loadEventFired")

    def eval(self, expression: str) -> Any:
        """Evaluate JavaScript in the page; its value (JSON-serialisable)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"script failed: {result['exceptionDetails'].get('text')}: {expression[:80]}")
        return result.get("result", {}).get("value")

    def click(self, selector: str) -> None:
        """A real mouse click in the middle of the first element matching ``selector``."""
        box = self.eval(
            f"(() => {{const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            "return [r.left + Math.min(r.width / 2, 40), r.top + r.height / 2];})()"
        )
        if box is None:
            raise BrowserError(f"nothing matches {selector}")
        for kind in ("mousePressed", "mouseReleased"):
            self.send(
                "Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1}
            )

    def screenshot(self, path: str) -> None:
        import base64

        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as fh:
            fh.write(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):
            self.send("Browser.close", session=False)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
