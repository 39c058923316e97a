"""Headless Chromium driven over the Chrome DevTools Protocol (CDP): load a page, evaluate
JavaScript in it, take a screenshot. For the dashboard's browser test and `python -m
bench.dashboard_shot`; needs Debian's `chromium` package (`which chromium`) and `websockets`.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websockets

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    """The path of a Chromium on PATH, or None."""
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


class Browser:
    """One headless Chromium process and one page of it, used from a single asyncio task."""

    def __init__(self, binary: str, width: int = 1400, height: int = 1000) -> None:
        self.binary, self.width, self.height = binary, width, height
        self._profile = tempfile.TemporaryDirectory(prefix="weir-chromium-")
        self._process: subprocess.Popen[bytes] | None = None
        self._ws: Any = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Browser:
        self._process = subprocess.Popen(  # our own arguments
            [
                self.binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-port=0",
                "--remote-allow-origins=*",
                f"--user-data-dir={self._profile.name}",
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            port = await self._devtools_port()
            page = await asyncio.to_thread(self._page_socket, port)
            self._ws = await websockets.connect(page, max_size=64 << 20)
            await self.call("Page.enable")
            await self.call(
                "Emulation.setDeviceMetricsOverride",
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        # Chromium's helper processes (renderer, crashpad) may still write into the profile for a
        # moment after the main process exits: retry, then leave what is left to the OS's /tmp
        for _attempt in range(50):
            try:
                self._profile.cleanup()
                return
            except OSError:
                await asyncio.sleep(0.1)
        shutil.rmtree(self._profile.name, ignore_errors=True)

    async def _devtools_port(self, timeout_s: float = 30.0) -> int:
        """The port Chromium chose, from the DevToolsActivePort file it writes into its profile."""
        marker = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self._process.returncode} before it listened")
            if marker.exists() and (lines := marker.read_text().split()):
                return int(lines[0])
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.binary} did not open its DevTools port within {timeout_s} s")

    @staticmethod
    def _page_socket(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as answer:
            targets = json.load(answer)
        return next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one CDP command and return its result (events in between are dropped)."""
        message_id = next(self._ids)
        await self._ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self._ws.recv())
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (an exception raises)."""
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll a JavaScript expression until it is truthy; its value, or TimeoutError with the last."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = await self.evaluate(expression)
            except RuntimeError as exc:  # e.g. the page is still loading
                last = f"error: {exc}"
            else:
                if last:
                    return last
            await asyncio.sleep(0.25)
        raise TimeoutError(f"{expression[:120]} still not true after {timeout_s} s (last: {last!r})")

    async def screenshot(self, path: Path) -> None:
        """The whole page as PNG."""
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))
