"""The web page at / in headless Chromium, with a fake microphone playing espeak-ng speech (`bench/browser.py`): a
turn in each mode with each codec, the voice picker, and what the page says when it cannot talk."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tests_support import ServerThread, engine_read_async

from bench import web_bench
from bench.browser import CHROMIUM, open_page
from s2s import Engine, EngineConfig
from server.app import ServerOptions

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/setup.sh installs it)"),
    pytest.mark.paced,  # a browser and a server at real time: alone and last (tests/conftest.py)
]
ROWS = "[...document.querySelectorAll('#turns tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
WAV = """(async () => {
  const wav = new DataView(await (await fetch(document.getElementById("download").href)).arrayBuffer());
  let you = 0, model = 0;
  for (let at = 44; at + 4 <= wav.byteLength; at += 4) {
    you = Math.max(you, Math.abs(wav.getInt16(at, true)));
    model = Math.max(model, Math.abs(wav.getInt16(at + 2, true)));
  }
  const seconds = (wav.byteLength - 44) / 4 / 24000;
  return [wav.getUint16(22, true), wav.getUint32(24, true), seconds, you / 32768, model / 32768];
})()"""


@pytest.fixture(scope="module")
def microphone(tmp_path_factory) -> Path:
    return web_bench.microphone(tmp_path_factory.mktemp("mic"), web_bench.SENTENCES[:1])


def serve(parts, body, options: ServerOptions | None = None, voices: dict | None = None, **engine_kw):
    """The server on a thread of its own (Chromium talks to it), `body(url, engine)` run against it."""
    model, tok = parts
    cfg = EngineConfig(num_pages=512, max_context=2048, calibration_ticks=0, max_reply_frames=40, **engine_kw)
    engine = Engine(model, tok, cfg)
    for name, codes in (voices or {}).items():
        engine.add_voice(name, codes)
    with ServerThread(engine, options or ServerOptions(port=0)) as port:
        return asyncio.run(body(f"http://127.0.0.1:{port}", engine))


@pytest.mark.parametrize("codec", ["opus", "pcm16"])
@pytest.mark.parametrize("mode", ["turn", "duplex"])
def test_a_turn_in_each_mode_and_codec(parts, microphone: Path, mode: str, codec: str) -> None:
    async def body(url, engine):
        async with open_page(f"{url}/?mode={mode}&codec={codec}", microphone) as page:
            await page.evaluate("window.s2sStart()")
            answered = "window.s2s.turns.some(t => t.latencyMs !== null) && window.s2s.receivedSamples >= 3200"
            await page.wait_for(answered, 45)
            [session] = engine.snapshot().sessions  # the page is still connected
            state, rows = await page.state(), await page.evaluate(ROWS)
            await page.evaluate("window.s2sStop()")
            return state, rows, session, await page.evaluate(WAV)

    state, rows, session, wav = serve(parts, body)
    channels, rate, seconds, you_peak, model_peak = wav
    assert (channels, rate) == (2, 24000) and seconds > 2, wav  # the recording: you left, the model right
    assert you_peak > 0.05 and model_peak > 0, wav
    assert state["handshake"] and state["micPeak"] > 0.05 and not state["problem"], state
    assert f"mode={mode}" in state["url"] and f"codec={codec}" in state["url"]
    assert session["mode"] == mode and session["frames_out"] > 0, session
    answered = [row for row in rows if row[3] != "-"]  # the turns table: latency in the fourth column
    assert answered and all(int(row[3]) >= 0 and float(row[2]) >= float(row[1]) for row in answered), rows


def test_the_voice_picker_lists_the_prompts_and_sends_the_one_chosen(parts, microphone: Path) -> None:
    cfg = parts[0].config
    voices = {
        name: np.random.default_rng(i).integers(0, cfg.codebook_size, (cfg.num_codebooks, 20 + 10 * i))
        for i, name in enumerate(["alice", "bob"])
    }

    async def body(url, engine):
        with urllib.request.urlopen(f"{url}/api/voices", timeout=5) as r:
            settings = json.loads(r.read())
        async with open_page(f"{url}/", microphone) as page:
            await page.wait_for("document.querySelectorAll('#voice option').length === 3")
            options = await page.evaluate("[...document.querySelectorAll('#voice option')].map(o => o.value)")
            await page.evaluate("document.getElementById('voice').value = 'bob'")
            await page.evaluate("window.s2sStart()")
            await page.wait_for("window.s2s.connected")
            await page.wait_for("window.s2s.sentBlocks > 5")
            prompts = await engine_read_async(engine, lambda: [s.prompt_frames for s in engine.sessions.values()])
            return settings, options, await page.state(), prompts

    settings, options, state, prompts = serve(parts, body, voices=voices)
    assert settings["voices"] == ["alice", "bob"] and settings["sampling"]["temperature"] == 0.8
    assert options == ["", "alice", "bob"]
    assert "voice=bob" in state["url"] and prompts == [30], prompts


def test_a_refusal_and_a_wrong_token_each_show_a_message_and_a_retry(parts, microphone: Path) -> None:
    async def body(url, engine):
        engine.open("turn")  # the one conversation the engine admits
        shown = []
        for query in ("token=right", "token=wrong"):
            async with open_page(f"{url}/?{query}", microphone) as page:
                await page.evaluate("window.s2sStart()")
                shown.append(await page.wait_for("window.s2s.problem"))
                assert await page.evaluate("!document.getElementById('problem').hidden")
                assert await page.evaluate("document.activeElement.id") == "retry"
        return shown

    refused, wrong = serve(parts, body, ServerOptions(port=0, token="right"), max_conversations=1)
    assert refused.startswith("The server cannot take this conversation now") and "maximum of 1" in refused
    assert wrong.startswith("Wrong or missing token")


def test_a_lost_connection_is_told_with_a_retry(parts, microphone: Path) -> None:
    """The server closes the connection (here: the page's 80 ms pcm16 messages are over its message size)."""

    async def body(url, engine):
        async with open_page(f"{url}/?codec=pcm16", microphone) as page:
            await page.evaluate("window.s2sStart()")
            return await page.wait_for("window.s2s.problem"), await page.evaluate("window.s2s.errors")

    shown, _ = serve(parts, body, ServerOptions(port=0, max_message_bytes=1000))
    assert shown.startswith("Connection lost (1009"), shown


def test_the_page_over_https_talks_over_wss(parts, microphone: Path, tmp_path: Path) -> None:
    """From another machine a browser gives the page its microphone only over https: the server serves TLS itself."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            key,
            "-out",
            cert,
        ],
        check=True,
        capture_output=True,
    )
    options = ServerOptions(port=0, ssl_certfile=cert, ssl_keyfile=key)

    async def body(url, engine):
        url = url.replace("http://", "https://")
        async with open_page(f"{url}/?codec=pcm16", microphone, flags=("--ignore-certificate-errors",)) as page:
            await page.evaluate("window.s2sStart()")
            await page.wait_for("window.s2s.turns.some(t => t.latencyMs !== null)", 45)
            return await page.state()

    state = serve(parts, body, options)
    assert state["url"].startswith("wss://127.0.0.1:") and state["handshake"] and not state["problem"], state


def test_the_bench_writes_the_screenshots_idle_and_mid_turn(parts, tmp_path: Path) -> None:
    """`s2s bench web`'s conversation, against this test's server: the README's pictures come from it."""
    cfg = parts[0].config
    voice = {"ada": np.random.default_rng(0).integers(0, cfg.codebook_size, (cfg.num_codebooks, 20))}
    shots = {"idle": tmp_path / "idle.png", "talking": tmp_path / "talking.png"}
    mic = web_bench.microphone(tmp_path, web_bench.SENTENCES[:2])

    async def body(url, engine):
        return await web_bench.conversation(url, mic, "turn", "pcm16", 2, shots)

    row = serve(parts, body, voices=voice)
    assert row["answered"] == 2 and row["problem"] is None, row
    for path in shots.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
