"""Headless Chromium with a fake microphone, driven over the DevTools protocol: what the web page's tests and
`s2s bench web` open the page with (shared/TESTING-NOTES.md has the flags and why each is needed)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One page's DevTools connection."""

    def __init__(self, ws: ClientConnection):
        self.ws, self._ids = ws, itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        msg_id = next(self._ids)
        await self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(await self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply["result"]

    async def evaluate(self, expression: str) -> object:
        result = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30) -> object:
        """Evaluate until the value is truthy; returns it. Raises TimeoutError with the page's state."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if value := await self.evaluate(expression):
                return value
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{expression!r} not true within {timeout_s:g} s; page state: {await self.state()}")

    async def state(self) -> dict:
        return await self.evaluate("JSON.parse(JSON.stringify(window.s2s ?? {}))")

    async def screenshot(self, path: Path) -> None:
        data = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))


@contextlib.asynccontextmanager
async def open_page(
    url: str, microphone: Path, width: int = 1100, height: int = 1400, flags: tuple[str, ...] = ()
) -> AsyncIterator[Page]:
    """Chromium showing `url`, its microphone playing `microphone` (a WAV file) once from when it is opened; `flags`
    are Chromium's, added."""
    if CHROMIUM is None:
        raise RuntimeError("Chromium is not installed (scripts/setup.sh installs it as root)")
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        browser = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--use-fake-ui-for-media-stream",
                "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={microphone}%noloop",
                "--autoplay-policy=no-user-gesture-required",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--window-size={width},{height}",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                *flags,
                url,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its renderer and helpers go with it
        )
        try:
            async with connect(await _page_socket(Path(profile), url), max_size=None) as ws:
                page = Page(ws)
                await page.wait_for("document.readyState === 'complete' && typeof window.s2sStart === 'function'")
                yield page
        finally:
            os.killpg(browser.pid, signal.SIGKILL)
            browser.wait()


async def _page_socket(profile: Path, url: str) -> str:
    port_file = profile / "DevToolsActivePort"
    for _ in range(300):
        if port_file.exists() and port_file.read_text().strip():
            break
        await asyncio.sleep(0.1)
    devtools = int(port_file.read_text().split()[0])
    for _ in range(100):
        with urllib.request.urlopen(f"http://127.0.0.1:{devtools}/json", timeout=5) as r:
            pages = json.loads(r.read())
        page = next((p for p in pages if p.get("type") == "page" and p.get("url", "").startswith(url[:20])), None)
        if page:
            return page["webSocketDebuggerUrl"]
        await asyncio.sleep(0.1)
    raise RuntimeError(f"Chromium opened no page for {url}")
