"""Headless Chromium driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: commands on fd 3, answers on fd 4, NUL-separated JSON),
so a test needs no WebSocket library."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--remote-debugging-pipe", "--window-size=1280,900",
)  # fmt: skip

NAVIGATING = ("navigated or closed", "context was destroyed", "Cannot find default execution context")


class Chromium:
    def __init__(self) -> None:
        exe = shutil.which("chromium")
        assert exe is not None, "chromium is not installed (.ci/run installs the Debian package)"
        self.profile = tempfile.mkdtemp(prefix="kvmesh-chromium-")
        cmd_r, self._cmd_w = os.pipe()  # we write, the browser reads (its fd 3)
        self._out_r, out_w = os.pipe()  # the browser writes (its fd 4), we read
        shell = f'exec "$0" "$@" 3<&{cmd_r} 4>&{out_w} {cmd_r}<&- {out_w}>&-'
        self.proc = subprocess.Popen(
            ["bash", "-c", shell, exe, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            pass_fds=(cmd_r, out_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._id = 0
        self.session: str | None = None

    def send(self, method: str, params: dict[str, Any] | None = None, timeout: float = 30.0, session: bool = True) -> Any:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session is not None:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            assert left > 0, f"no answer to {method}"
            ready, _, _ = select.select([self._out_r], [], [], left)
            if ready:
                chunk = os.read(self._out_r, 1 << 20)
                assert chunk, "chromium closed its DevTools pipe"
                self._buf += chunk

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": url}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        return result["result"].get("value")

    def poll(self, expression: str) -> Any:
        """``evaluate`` for a wait loop: None while the page is between documents (a
        reload answers "Inspected target navigated or closed" or "context was destroyed"
        for an expression sent at that moment); other errors still raise."""
        try:
            return self.evaluate(expression)
        except RuntimeError as e:
            if any(s in str(e) for s in NAVIGATING):
                return None
            raise

    def screenshot(self, path: str) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False, timeout=5)
        except (AssertionError, RuntimeError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        os.close(self._cmd_w)
        os.close(self._out_r)
        shutil.rmtree(self.profile, ignore_errors=True)
