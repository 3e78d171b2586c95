"""server/: Moshi's stream controls (start, pause, restart) and a client that vanishes without a close frame."""

from __future__ import annotations

import asyncio
import json

from test_server import http_get, metric, run_with_server, speech
from websockets.asyncio.client import connect

from server import protocol
from server.protocol import Control, Kind

PCM = (speech(1.0) * 32767).astype("<i2").tobytes()


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
        # the reply audio this test never reads must not fill the client's queue: a full queue stops the client
        # reading, so the server's close frame would go unseen and the close wait out its 10 s timeout
        async with connect(f"{url}/api/chat?codec=pcm16", max_queue=None) as ws:
            await ws.recv()  # handshake
            await ws.recv()  # the conversation's metadata
            await send_speech(ws)
            await ws.send(protocol.control(Control.PAUSE))
            await until_event(ws, "paused")
            (s,) = engine.sessions.values()
            await asyncio.sleep(0.3)  # the engine's ticks go on without it
            paused_at = (s.computed, s.user_frames)
            await send_speech(ws)  # dropped: its stream is stopped
            await asyncio.sleep(0.3)
            assert (s.computed, s.user_frames) == paused_at and s.paused
            await ws.send(protocol.control(Control.START))
            await until_event(ws, "started")
            await send_speech(ws)
            await asyncio.sleep(0.5)
            assert s.user_frames > paused_at[1] and s.computed > paused_at[0]
            await ws.send(protocol.control(Control.RESTART))
            await until_event(ws, "restarted")
            assert s.turns[0].id == 0 and len(s.turns) == 1 and s.user_frames < paused_at[1]
            await send_speech(ws)  # it goes on from the prompt
            async with asyncio.timeout(30):
                while s.user_frames < 60:
                    await asyncio.sleep(0.05)
        engine.cache.check()

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
        async with asyncio.timeout(30):
            while metric(text := await http_get(f"{url}/metrics"), "s2s_conversations") != 0:
                await asyncio.sleep(0.05)
        assert metric(text, "s2s_kv_pages", 'state="private"') == 0
        assert metric(text, "s2s_kv_pages", 'state="cached_locked"') == 0
        assert not server.engine.sessions
        server.engine.cache.check()

    run_with_server(parts, body)
