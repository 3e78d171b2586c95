"""server/: Moshi's stream controls (start, pause, restart) and a client that vanishes without a close frame."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_server import metric, metrics_when, run_with_server, speech
from tests_support import engine_read_async, engine_until, snapshot_until, spy_pushes, until
from websockets.asyncio.client import connect

from codec.pcm import to_pcm16
from server.moshi import protocol
from server.moshi.protocol import Control, Kind

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)

PCM = to_pcm16(speech(1.0))


async def send_speech(ws) -> None:
    for a in range(0, len(PCM), 3840):  # 80 ms messages
        await ws.send(protocol.audio(PCM[a : a + 3840]))


async def until_event(ws, name: str) -> int:
    """Read until the metadata event `name`; returns how many audio messages came before it."""
    audio = 0
    async with asyncio.timeout(30):
        while True:
            message = await ws.recv()
            if message[0] == Kind.AUDIO:
                audio += 1
            elif message[0] == Kind.METADATA and json.loads(message[1:]).get("event") == name:
                return audio


def test_pause_start_and_restart_over_moshi_controls(parts) -> None:
    async def body(url, server):
        engine = server.engine
        pushed = spy_pushes(engine)

        def conversation() -> tuple[int, int, bool, list[int]]:  # on the engine thread: its live session
            (s,) = engine.sessions.values()
            return s.computed, s.user_frames, s.paused, [t.id for t in s.turns]

        async def all_pushed(since: int) -> None:  # the server paces what it hands the engine at real time
            await until(lambda: sum(pushed[since:]) >= len(PCM) // 2, 30, "the speech did not all reach the engine")

        # the reply audio this test never reads must not fill the client's queue: a full queue stops the client
        # reading, so the server's close frame would go unseen and the close wait out its 10 s timeout
        async with connect(f"{url}/api/chat?codec=pcm16", max_queue=None) as ws:
            await ws.recv()  # handshake
            await ws.recv()  # the conversation's metadata
            await send_speech(ws)
            await ws.send(protocol.control(Control.PAUSE))
            await until_event(ws, "paused")
            computed, user_frames, paused, _ = await engine_read_async(engine, conversation)
            assert paused
            ticks = engine.snapshot().stats.ticks
            since = len(pushed)
            await send_speech(ws)  # dropped: its stream is stopped
            await all_pushed(since)
            await snapshot_until(engine, lambda s: s.stats.ticks >= ticks + 3, what="the engine stopped ticking")
            assert await engine_read_async(engine, conversation) == (computed, user_frames, True, [0])
            await ws.send(protocol.control(Control.START))
            await until_event(ws, "started")
            await send_speech(ws)
            await engine_until(
                engine,
                lambda: (c := conversation())[0] > computed and c[1] > user_frames,
                what="a started stream took no more input, or computed none",
            )
            await ws.send(protocol.control(Control.RESTART))
            await until_event(ws, "restarted")
            _, restarted_frames, _, turns = await engine_read_async(engine, conversation)
            assert turns == [0] and restarted_frames < user_frames
            await send_speech(ws)  # it goes on from the prompt
            await engine_until(engine, lambda: conversation()[1] >= 60, what="the restarted stream took no input")
        await engine_read_async(engine, engine.cache.check)

    run_with_server(parts, body)


def test_a_client_that_vanishes_without_a_close_frame_frees_everything(parts) -> None:
    async def body(url, server):
        for mode in ("duplex", "turn"):
            ws = await connect(f"{url}/api/chat?codec=pcm16&mode={mode}")
            await ws.recv()
            await send_speech(ws)
            if mode == "turn":
                await ws.send(protocol.control(Control.END_TURN))
            while (await ws.recv())[0] != Kind.AUDIO:  # it is speaking
                pass
            ws.transport.abort()  # no close frame: the TCP connection just ends
        text = await until(
            lambda: metrics_when(url, lambda text: metric(text, "s2s_conversations") == 0),
            what="the server did not close the vanished clients' conversations",
        )
        assert metric(text, "s2s_kv_pages", 'state="private"') == 0
        assert metric(text, "s2s_kv_pages", 'state="cached_locked"') == 0
        engine = server.engine
        assert await engine_read_async(engine, lambda: list(engine.sessions)) == []
        await engine_read_async(engine, engine.cache.check)

    run_with_server(parts, body)
