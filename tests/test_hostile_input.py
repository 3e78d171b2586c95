"""A hostile client's input (issue 25): invalid Opus never grows memory and never breaks the stream for good, bytes
are paced whether or not they decode, and one large message reaches the engine in real-time slices."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import struct
import urllib.parse

import numpy as np
import pytest
import sphn
from test_server import run_with_server
from tests_support import FRONTENDS, snapshot_until, spy_pushes, until
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

import server.moshi.endpoint
from server.app import ServerOptions
from server.connection import Limits
from server.moshi.endpoint import MoshiWire, protocol
from server.moshi.ogg_opus import ogg_crc
from server.moshi.protocol import BLOCK, Kind, ProtocolError, StreamError

pytestmark = pytest.mark.paced  # servers at real time: alone and last (tests/conftest.py)


class KeptWire(MoshiWire):
    """Moshi's wire, each one kept, so a test can see what its connection's Opus reader holds."""

    made: list[MoshiWire] = []

    def __init__(self, codec: str):
        super().__init__(codec)
        self.made.append(self)


def opus_messages(seconds: float) -> list[bytes]:
    """A valid Ogg/Opus stream of a tone, in 80 ms messages as a client sends it."""
    writer = sphn.OpusStreamWriter(24000)
    pcm = (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(seconds * 24000)) / 24000)).astype(np.float32)
    pages = [bytes(writer.append_pcm(pcm[a : a + BLOCK])) for a in range(0, len(pcm), BLOCK)]
    return [protocol.audio(page) for page in pages if page]


async def next_error(ws) -> str:
    while (message := await asyncio.wait_for(ws.recv(), 10))[0] != Kind.ERROR:
        pass
    return message[1:].decode()


def test_invalid_opus_resets_the_reader_and_a_flood_of_it_closes_the_connection(parts, monkeypatch) -> None:
    """Messages that are not Ogg: each is told and the reader holds none of it, and a valid stream on the same
    connection then reaches the engine (sphn's reader kept every byte after an error, and failed for good). Past
    `MAX_UNDECODED` bytes with no audio, the connection is closed with the reason (it was read for ever). Through
    front ends the wires are in their processes: what the client and the engine see is checked, not the reader."""
    monkeypatch.setattr(server.moshi.endpoint, "MoshiWire", KeptWire)
    KeptWire.made.clear()
    garbage = protocol.audio(bytes(range(1, 256)) * 257)  # 65,535 bytes, no "OggS" in them

    async def body(url, srv):
        pushed = spy_pushes(srv.engine)
        async with connect(f"{url}/api/chat?mode=turn&codec=opus") as ws:
            await ws.recv()  # handshake
            await ws.recv()  # metadata
            wire = None if FRONTENDS else KeptWire.made[-1]  # (through front ends, in their processes)
            for _ in range(3):
                reader = None if FRONTENDS else wire.opus_in
                await ws.send(garbage)
                assert "not valid Ogg/Opus" in await next_error(ws)
                if not FRONTENDS:
                    assert wire.opus_in is not reader and wire.opus_pending == 0, "the reader kept the garbage"
            for message in opus_messages(2.0):
                await ws.send(message)
            await until(  # the server takes the messages a moment after they are sent
                lambda: sum(pushed) >= 24000, 10, "valid Opus after invalid Opus did not reach the engine"
            )
            with pytest.raises(ConnectionClosed) as closed:
                for _ in range(200):
                    await ws.send(garbage)
                    await next_error(ws)
            assert closed.value.rcvd.code == 1008 and "no audio" in closed.value.rcvd.reason

    limits = Limits(realtime_burst_s=3600, max_messages_per_s=1e4)  # this is about memory, not pace
    run_with_server(parts, body, ServerOptions(port=0, limits=limits))


def websocket_that_never_reads(url: str, path: str) -> socket.socket:
    """A websocket's client side by hand, after its handshake: a socket a test writes frames to and never reads,
    so it never answers the server's close."""
    address = urllib.parse.urlsplit(url)
    sock = socket.create_connection((address.hostname, address.port))
    key = base64.b64encode(os.urandom(16)).decode()
    upgrade = f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13"
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {address.netloc}\r\n{upgrade}\r\n\r\n".encode())
    response = b""
    while b"\r\n\r\n" not in response:
        response += sock.recv(4096)
    assert response.startswith(b"HTTP/1.1 101"), response
    return sock


def binary_frame(payload: bytes) -> bytes:
    """One masked binary websocket frame (a zero mask: the payload as it is)."""
    return struct.pack("!BBQ", 0x82, 0x80 | 127, len(payload)) + bytes(4) + payload


def test_a_stream_error_closes_the_conversation_before_the_socket(parts) -> None:
    """A message the connection cannot go on from (Ogg/Opus with no audio in it past the cap) ends the conversation
    at once, even for a client that never reads and never answers the close: it held its slot until the close
    timeout (10 s) gave up on its socket."""
    garbage = protocol.audio(bytes(range(1, 256)) * 1100)  # 280,500 bytes, no "OggS" in them: past the cap

    async def body(url, srv):
        sock = await asyncio.to_thread(websocket_that_never_reads, url, "/api/chat?mode=turn&codec=opus")
        try:
            await snapshot_until(srv.engine, lambda s: s.conversations == 1, 30, "the conversation did not open")
            sock.sendall(binary_frame(garbage))
            await snapshot_until(srv.engine, lambda s: s.conversations == 0, 30, "the conversation did not close")
            sock.setblocking(False)
            told = b""
            with contextlib.suppress(BlockingIOError):
                while chunk := sock.recv(1 << 16):
                    told += chunk
            assert b"no audio in over" in told, told[:200]
            assert chunk != b"", "the server gave up on the socket before it closed the conversation"
        finally:
            sock.close()

    run_with_server(parts, body)


def never_ending_packet_page(continued: bool) -> bytes:
    """A valid Ogg page (65,307 bytes, the largest) holding one packet that goes on into the next page: sphn raises
    nothing and gives nothing, and keeps all of it."""
    header = b"OggS" + bytes([0, int(continued)]) + struct.pack("<qII", -1, 1, 0) + bytes(4) + bytes([255] * 256)
    page = header + bytes(255 * 255)
    return page[:22] + struct.pack("<I", ogg_crc(page)) + page[26:]


def test_an_ogg_packet_that_never_ends_is_cut_at_the_cap() -> None:
    """sphn keeps a packet that never ends, raising nothing: past `MAX_OPUS_PENDING` the reader starts again (a valid
    stream then decodes); past `MAX_UNDECODED` with no audio, the stream is over."""
    first, more = never_ending_packet_page(False), never_ending_packet_page(True)
    wire = MoshiWire("opus")
    assert not len(wire.parse(protocol.audio(first)).pcm)
    with pytest.raises(ProtocolError, match="no audio .* starts again"):
        wire.parse(protocol.audio(more))
    assert wire.opus_pending <= MoshiWire.MAX_OPUS_PENDING
    pcm = [wire.parse(message).pcm for message in opus_messages(1.0)]
    assert sum(map(len, pcm)) >= 12000  # the stream starts again
    wire = MoshiWire("opus")
    with pytest.raises(StreamError, match="closed"):
        for i in range(10):
            try:
                wire.parse(protocol.audio(more if i else first))
            except StreamError:
                raise
            except ProtocolError:
                pass
            assert wire.opus_pending <= MoshiWire.MAX_OPUS_PENDING


def test_bytes_that_do_not_decode_are_paced_like_audio(parts) -> None:
    async def body(url, srv):
        async with connect(f"{url}/api/chat?mode=turn&codec=opus") as ws:
            await ws.recv()
            await ws.send(protocol.audio(b"\xff" * 48000))  # a second of pcm16's bytes, past a 0.1 s burst
            assert "not valid Ogg/Opus" in await next_error(ws)
            assert "bytes a second: throttled" in await next_error(ws)

    run_with_server(parts, body, ServerOptions(port=0, limits=Limits(realtime_burst_s=0.1)))


def test_a_large_message_reaches_the_engine_in_real_time_slices(parts) -> None:
    """One 1 MiB pcm16 message (21.8 s) is throttled and told, and handed to the engine in slices of at most 80 ms,
    not in one piece: one tick's worth of work for every conversation."""

    async def body(url, srv):
        pushed = spy_pushes(srv.engine)
        async with connect(f"{url}/api/chat?mode=turn&codec=pcm16") as ws:
            await ws.recv()
            await ws.send(protocol.audio(bytes((1 << 20) - 2)))
            assert "faster than real time" in await next_error(ws)
            # past the 2 s burst, slices come in real time
            await until(lambda: sum(pushed) >= 40 * BLOCK, 20, lambda: f"too little reached the engine: {pushed[:5]}")
        assert max(pushed) <= BLOCK, pushed[:5]

    run_with_server(parts, body)


def test_full_scale_opus_decodes_within_range_and_out_of_range_pcm_never_reaches_the_engine_thread(parts) -> None:
    """A decoder overshoots full-scale input (a browser's Opus of a loud voice): the wire clips it. PCM out of range
    handed to the engine raises in the caller's thread; the engine thread, which serves every conversation, goes on."""
    writer, square = sphn.OpusStreamWriter(24000), np.sign(np.sin(np.arange(24000) / 24000 * 2 * np.pi * 200))
    ogg = b"".join(bytes(writer.append_pcm(square[a : a + BLOCK].astype(np.float32))) for a in range(0, 24000, BLOCK))
    pcm = MoshiWire("opus").parse(protocol.audio(ogg)).pcm
    assert len(pcm) and np.abs(pcm).max() <= 1

    async def body(url, server):
        engine = server.engine
        cid = engine.open("turn")
        for bad in (np.full(BLOCK, 1.01, np.float32), np.full(BLOCK, np.nan, np.float32)):
            with pytest.raises(ValueError, match=r"\[-1, 1\]"):
                engine.push_audio(cid, bad)
        engine.push_audio(cid, np.zeros(BLOCK, np.float32))
        ticks = engine.snapshot().stats.ticks
        await snapshot_until(engine, lambda s: s.stats.ticks > ticks + 2, 10, "the engine thread stopped ticking")
        assert engine._thread.is_alive()

    run_with_server(parts, body)
