"""Issue 25 as a hostile client sees it: who may connect (token and origin, the cascade too), settings out of the
model's range, what errors and headers give away, and a client that never reads its replies."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from test_server import http_get, metric, run_with_server
from tests_support import FRONTENDS, engine_read_async, snapshot_until, until
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.cascade import serve
from bench.cascade.server import CascadeServer
from bench.cascade.text import text_engine_for
from codec import EncodecTokenizer
from codec.pcm import to_pcm16
from s2s import AudioEvent, Engine, EngineConfig, ModelConfig, S2SModel
from s2s.engine.events import EventQueue
from server.app import ServerOptions
from server.connection import Limits
from server.moshi import protocol
from server.moshi.client import talk
from server.moshi.protocol import Kind
from server.process import ServerProcess
from speech.sample import speech as spoken

EVIL = "http://evil.example"


def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * 24000)) / 24000
    return (0.2 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)


async def status_of(url: str, origin: str | None = None) -> int:
    """The HTTP status a websocket request gets: 101 when it is let in."""
    try:
        async with connect(url, origin=origin) as ws:
            return ws.response.status_code
    except InvalidStatus as e:
        return e.response.status_code


async def told_and_closed(ws) -> tuple[list[str], int | None]:
    """Read until the server closes: the errors it sent, and its close code. A connection left open fails the test
    (TimeoutError) rather than hanging it."""
    errors = []
    try:
        while True:
            message = await asyncio.wait_for(ws.recv(), 30)
            if message[0] == Kind.ERROR:
                errors.append(message[1:].decode())
    except ConnectionClosed as e:
        return errors, e.rcvd.code if e.rcvd else None


@pytest.mark.paced  # at real time: alone and last (tests/conftest.py)
def test_the_cascade_server_takes_a_token_and_refuses_a_foreign_origin() -> None:
    """`python -m bench.cascade.serve --token T`, as the bench starts it (the cascade once skipped both)."""

    async def probe(url: str) -> list[int]:
        chat = f"{url}/api/chat"
        return [
            await status_of(chat, EVIL),
            await status_of(f"{chat}?token=T", EVIL),
            await status_of(f"{chat}?token=T"),
        ]

    args = ("--preset", "tiny", "--threads", "1", "--max-conversations", "2", "--token", "T")
    with ServerProcess(*args, module=serve.MODULE) as url:
        assert asyncio.run(probe(url)) == [401, 403, 101]


def test_browsers_are_same_origin_unless_allowed(parts) -> None:
    async def default(url, server):
        chat, own = f"{url}/api/chat", url.replace("ws://", "http://")
        return [await status_of(chat, EVIL), await status_of(chat, own), await status_of(chat)]

    assert run_with_server(parts, default) == [403, 101, 101]

    async def allowed(url, server):
        chat = f"{url}/api/chat"
        return [await status_of(chat, "https://app.example"), await status_of(chat, EVIL)]

    assert run_with_server(parts, allowed, ServerOptions(port=0, allowed_origins=["https://app.example"])) == [101, 403]


@pytest.mark.parametrize("module", ["server.cli", serve.MODULE])
def test_an_empty_token_is_an_error_at_start(module: str) -> None:
    with pytest.raises(ValueError, match="token"):
        ServerOptions(token="")
    command = [sys.executable, "-m", module, *(["serve"] if module == "server.cli" else []), "--token", ""]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "token must not be empty" in done.stderr, done.stderr


@pytest.mark.parametrize("query", ["top_k=1025", "audio_topk=100000", "top_k=1000000000"])
def test_top_k_beyond_the_vocabulary_is_told_and_closed_with_1008(parts, query: str) -> None:
    async def body(url, server):
        async with connect(f"{url}/api/chat?mode=turn&{query}") as ws:
            errors, code = await told_and_closed(ws)
        assert code == 1008 and len(errors) == 1 and "top_k" in errors[0], (code, errors)
        async with connect(f"{url}/api/chat?mode=turn&audio_topk=250") as ws:  # what Moshi's client sends
            assert (await ws.recv())[0] == Kind.HANDSHAKE
            assert (await ws.recv())[0] == Kind.METADATA
        await engine_read_async(server.engine, server.engine.cache.check)

    run_with_server(parts, body)


@pytest.mark.paced  # at real time: alone and last (tests/conftest.py)
def test_cascade_errors_name_the_setting_and_never_an_exception() -> None:
    """A bad setting is told by name; a failure (the speech-to-text worker killed mid-turn) is told without the
    exception's class or message, which can hold paths."""
    tok = EncodecTokenizer.from_pretrained(seed=0)
    cfg = EngineConfig(calibration_ticks=0, max_conversations=2, max_reply_frames=75, frames_per_tick=4)
    speech_engine = Engine(S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0), tok, cfg)
    text_engine = text_engine_for("tiny", 1.0, 2, calibration_ticks=0)
    wav, _ = spoken("What is the weather like tomorrow?")

    async def run():
        server = CascadeServer(text_engine, speech_engine, ServerOptions(port=0), stt_workers=1)
        url = f"ws://127.0.0.1:{await server.start()}"
        try:
            settings = []
            for query in ("seed=abc", "silence_ms=abc"):
                async with connect(f"{url}/api/chat?codec=pcm16&{query}") as ws:
                    settings.append((query.split("=")[0], *await told_and_closed(ws)))
            doomed = asyncio.create_task(talk(url, wav, "turn", "pcm16", listen_s=30, seed="1"))
            # streaming into its worker
            await until(lambda: sum(server.stt.load), 30, "the conversation opened no speech-to-text stream")
            loop = asyncio.get_running_loop()
            os.kill(await loop.run_in_executor(server.stt.pools[0], os.getpid), signal.SIGKILL)
            return settings, (await doomed).errors
        finally:
            await server.stop()

    settings, errors = asyncio.run(run())
    assert any(e.startswith("speech-to-text failed") for e in errors), errors
    for e in errors:
        assert not any(leak in e for leak in ("BrokenProcessPool", "Error", "Exception", "/")), e
    for name, told, code in settings:
        assert code == 1008 and len(told) == 1 and name in told[0], (name, told, code)


def test_the_server_header_carries_no_versions(parts) -> None:
    async def body(url, server):
        def get() -> str:
            with urllib.request.urlopen(f"{url.replace('ws://', 'http://')}/healthz", timeout=5) as r:
                return r.headers["Server"]

        async with connect(f"{url}/api/chat?mode=turn") as ws:
            upgrade = ws.response.headers["Server"]
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"{url}/no/such/path"):
                pass
        return [await asyncio.to_thread(get), upgrade, refused.value.response.headers["Server"]]

    for header in run_with_server(parts, body):
        assert not re.search(r"/|\d\.\d|python|websockets", header, re.IGNORECASE), header  # product/version


def test_the_event_queue_drops_past_its_bound_and_never_blocks() -> None:
    q, overflows = EventQueue(320), []
    q.on_overflow = lambda: overflows.append(True)
    second = AudioEvent("c", 0, 0, np.zeros(320 * 75, np.float32))  # a second of audio
    for _ in range(EventQueue.max_frames // 75 + 5):
        q.put(second)
    q.put(None)
    assert q.overflowed and overflows == [True]
    assert q.get_nowait() is None and q.empty() and q.frames == 0


@pytest.mark.paced  # at real time: alone and last (tests/conftest.py)
def test_a_client_that_never_reads_is_told_and_closed_beside_a_healthy_one(parts) -> None:
    """A duplex client sends in real time and reads nothing: once more than `Limits.max_unread_s` of its replies
    wait unread it is told and closed (and /metrics counts it), a healthy conversation beside it keeps its replies,
    and every page comes back.

    Through front ends the test cannot shrink the server's socket buffer (in one process it does), and on loopback
    that buffer holds more PCM16 than the server's keepalive lets a client that answers no ping last (40 s): there
    the keepalive closes it, and the rest is the same."""

    async def body(url, server):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow link: little is buffered on the way
        sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        sock.setblocking(False)
        # (no keepalive of its own: one that reads nothing answers no ping, and its side would close first)
        slow_client = connect(f"{url}/api/chat?mode=duplex&codec=pcm16", sock=sock, max_queue=1, ping_interval=None)
        async with slow_client as slow:
            assert (await slow.recv())[0] == Kind.HANDSHAKE
            await slow.recv()  # metadata
            if not FRONTENDS:
                (conn,) = server._server.connections
                conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            healthy = asyncio.create_task(talk(url, tone(3.0), mode="duplex", codec="pcm16", listen_s=0.5))
            block = protocol.audio(to_pcm16(tone(0.08)))
            if FRONTENDS:
                with pytest.raises(ConnectionClosed):
                    for _ in range(750):  # up to a minute of audio in real time, reading nothing
                        await slow.send(block)
                        await asyncio.sleep(0.08)
            else:
                for _ in range(750):
                    if await slow_readers_closed(url):
                        break
                    await slow.send(block)
                    await asyncio.sleep(0.08)
                assert await slow_readers_closed(url) == 1
                errors, code = await told_and_closed(slow)  # now reading: what the server told it
                assert errors == ["not reading fast enough: closed"] and code == 1008, (errors, code)
        result = await healthy
        assert not result.errors and len(result.reply) > 40 * 320
        snapshot = await snapshot_until(server.engine, lambda s: s.conversations == 0, what="conversations left open")
        assert snapshot.cache.private == 0 and snapshot.cache.cached_locked == 0
        await engine_read_async(server.engine, server.engine.cache.check)

    run_with_server(parts, body, ServerOptions(port=0, limits=Limits(max_unread_s=1.0)))


async def slow_readers_closed(url: str) -> float:
    """How many connections the server has closed as slow readers, by its /metrics (none yet: no line)."""
    text, name, label = await http_get(f"{url}/metrics"), "s2s_connections_closed_total", 'reason="slow_reader"'
    return metric(text, name, label) if f"{name}{{{label}}}" in text else 0.0
