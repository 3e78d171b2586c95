"""The web page at / in headless Chromium, with a fake microphone playing espeak-ng speech, completes a turn."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tests_support import ServerThread
from websockets.asyncio.client import connect

from codec import EncodecTokenizer
from s2s import Engine, EngineConfig, ModelConfig, S2SModel
from server.app import ChatServer, ServerOptions
from server.audio import save_wav
from server.speech import synthesize

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


_ids = iter(range(1, 10**9))


async def evaluate(ws, expression: str) -> object:
    msg_id = next(_ids)
    await ws.send(
        json.dumps(
            {
                "id": msg_id,
                "method": "Runtime.evaluate",
                "params": {"expression": expression, "awaitPromise": True, "returnByValue": True},
            }
        )
    )
    while True:
        reply = json.loads(await ws.recv())
        if reply.get("id") == msg_id:
            result = reply["result"]
            if "exceptionDetails" in result:
                raise AssertionError(f"page error: {result['exceptionDetails']}")
            return result["result"].get("value")


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed here (scripts/setup.sh installs it as root)")
def test_web_page_completes_a_turn_in_headless_chromium() -> None:
    model = S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0)
    tok = EncodecTokenizer.from_pretrained(seed=0)
    engine = Engine(model, tok, EngineConfig(num_pages=512, max_context=2048, calibration_ticks=0, max_reply_frames=40))
    with tempfile.TemporaryDirectory() as tmp, ServerThread(ChatServer(engine, ServerOptions(port=0))) as port:
        wav = Path(tmp) / "mic.wav"
        speech = synthesize("Hello there. Can you hear me?")
        save_wav(wav, np.concatenate([np.zeros(12000, np.float32), speech, np.zeros(48000, np.float32)]))
        profile = Path(tmp) / "profile"
        browser = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--use-fake-ui-for-media-stream",
                "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={wav}%noloop",
                "--autoplay-policy=no-user-gesture-required",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                f"http://127.0.0.1:{port}/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            state = asyncio.run(drive(profile))
            sessions = engine.snapshot().sessions  # the page is still connected
        finally:
            browser.kill()
            browser.wait()
    assert state["handshake"], state
    assert state["micPeak"] > 0.05, f"the page heard no speech: {state}"
    assert state["sentBlocks"] > 20, state
    assert state["receivedSamples"] >= 10 * 320, f"no reply reached the page: {state}"
    assert not state["errors"], state
    [session] = sessions
    assert session["mode"] == "turn" and session["frames_out"] > 0, f"the server's VAD ended no turn: {session}"


async def drive(profile: Path) -> dict:
    port_file = profile / "DevToolsActivePort"
    for _ in range(200):
        if port_file.exists() and port_file.read_text().strip():
            break
        await asyncio.sleep(0.1)
    devtools = int(port_file.read_text().split()[0])
    for _ in range(100):
        pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{devtools}/json", timeout=5).read())
        page = next((p for p in pages if p.get("type") == "page" and "127.0.0.1" in p.get("url", "")), None)
        if page:
            break
        await asyncio.sleep(0.1)
    async with connect(page["webSocketDebuggerUrl"], max_size=None) as ws:
        for _ in range(100):
            if await evaluate(ws, "typeof window.s2sStart === 'function'"):
                break
            await asyncio.sleep(0.1)
        await evaluate(ws, "window.s2sStart()")
        deadline = time.monotonic() + 30
        state = {}
        while time.monotonic() < deadline:
            state = await evaluate(ws, "JSON.parse(JSON.stringify(window.s2s))")
            if state["receivedSamples"] >= 10 * 320:
                break
            await asyncio.sleep(0.25)
        return state
