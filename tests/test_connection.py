"""server/connection.py, the connection core, with a stand-in session (no model): what the client has heard, the
refusal's close frame, the receive loop, and the one bridge from engine events to asyncio."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from tests_support import until
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from s2s import AudioEvent, MetaEvent, Refused
from s2s.engine.engine import EventQueue
from server.connection import Connection, Limits, PerClient, Playback, serve_connection
from server.engine_session import events
from server.moshi.endpoint import MoshiWire, protocol
from server.moshi.protocol import Control, Kind, ProtocolError

NO_CLIENT = SimpleNamespace(limits=Limits())  # what `events` reads of a connection, where no client reads


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_playback_does_not_count_a_stalled_reply_as_heard() -> None:
    clock = Clock()
    playback = Playback(clock)
    assert playback.played_samples() // 320 == 0
    playback.sent(0, 10 * 320)
    clock.now += 2.0  # the reply stalls: the client played its 10 frames, then heard nothing
    playback.sent(0, 20 * 320)
    assert playback.played_samples() // 320 == 10  # not 30: the stall was not playback
    clock.now += 0.1
    assert playback.played_samples() // 320 == 17  # 7.5 more frames of real time
    clock.now += 10
    assert playback.played_samples() // 320 == 30  # never more than was sent
    playback.sent(1, 320)  # the next reply counts from its own start
    assert playback.played_samples() // 320 == 0
    clock.now += 1
    assert playback.played_samples() // 320 == 1


class Recorder:
    """A session that keeps what the core asked of it."""

    def __init__(self):
        self.info, self.vad = {"session": "r0", "mode": "turn"}, None
        self.pcm: list[np.ndarray] = []
        self.calls: list[str] = []

    async def barge_in(self, played_samples: int) -> None:
        self.calls.append("barge_in")

    def audio(self, pcm: np.ndarray) -> None:
        self.pcm.append(pcm)

    async def end_turn(self) -> None:
        self.calls.append("end_turn")

    async def speech_ended(self) -> None:
        self.calls.append("speech_ended")

    async def close(self) -> None:
        self.calls.append("close")


class StandIn:
    """Moshi's wire; a session that records, or a refusal."""

    def __init__(self, refuse: str | None = None):
        self.refuse, self.session = refuse, Recorder()

    def error(self, text: str) -> bytes:
        return protocol.error(text)

    def accept(self, query: dict[str, str], headers):
        if "bad" in query:
            raise ProtocolError("bad is not a parameter")

        async def open_session(conn: Connection) -> Recorder:
            if self.refuse:
                raise Refused(self.refuse)
            return self.session

        return MoshiWire(query.get("codec", "pcm16")), open_session


async def with_core(endpoint: StandIn, client) -> None:
    async with serve(
        lambda ws: serve_connection(ws, endpoint, Limits(), PerClient(0), "replica-a", lambda reason: None),
        "127.0.0.1",
        0,
    ) as server:
        await client(f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}")


def test_a_refusal_closes_1013_with_its_reason_and_a_bad_request_1008() -> None:
    """A refusal the server could not foresee before the upgrade (the session's own `Refused`) is told after it."""
    reason = "no K/V memory for another conversation"

    async def client(url: str) -> None:
        async with connect(url) as ws:
            assert (await ws.recv())[0] == Kind.HANDSHAKE
            message = await ws.recv()
            assert message == protocol.error(f"refused: {reason}")
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert (ws.close_code, ws.close_reason) == (1013, reason)
        async with connect(f"{url}/?bad=1") as ws:
            assert await ws.recv() == protocol.error("bad is not a parameter")
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert ws.close_code == 1008

    asyncio.run(with_core(StandIn(refuse=reason), client))


def test_the_receive_loop_feeds_the_session_tells_bad_messages_and_closes_it_once() -> None:
    endpoint = StandIn()
    pcm = (np.linspace(-0.5, 0.5, 1920) * 32767).astype("<i2")

    async def client(url: str) -> None:
        async with connect(f"{url}/?codec=pcm16") as ws:
            assert (await ws.recv())[0] == Kind.HANDSHAKE
            opened = protocol.metadata_of(await ws.recv())
            assert opened == {"session": "r0", "mode": "turn", "codec": "pcm16", "replica": "replica-a"}
            await ws.send(protocol.audio(pcm.tobytes()))
            await ws.send(protocol.audio(b"\x00\x01\x02"))  # odd length: not PCM16
            assert await ws.recv() == protocol.error("audio payload is not valid PCM16")
            await ws.send(protocol.control(Control.END_TURN))
            await ws.send(bytes([Kind.PING]))  # ignored
            await ws.send(protocol.audio(pcm.tobytes()))
            # (taken before the client leaves: what a client sent and then left before it was read goes unread)
            await until(lambda: len(endpoint.session.pcm) == 2, 5, lambda: f"not fed: {endpoint.session.calls}")
        # the server sees the close a moment after the client
        await until(lambda: "close" in endpoint.session.calls, 5, lambda: f"no close: {endpoint.session.calls}")

    asyncio.run(with_core(endpoint, client))
    assert endpoint.session.calls == ["end_turn", "close"]
    assert [len(p) for p in endpoint.session.pcm] == [1920, 1920]
    np.testing.assert_allclose(endpoint.session.pcm[0], pcm / 32768.0)


class NoThreads(concurrent.futures.ThreadPoolExecutor):
    def submit(self, fn, /, *args, **kwargs):
        raise AssertionError("the bridge must not read in a thread")


def test_events_wake_the_reader_from_the_engine_thread_without_a_thread_per_read() -> None:
    q = EventQueue(320)
    sent = [MetaEvent("s0", 0, {"n": i}) for i in range(50)]

    def engine_thread() -> None:
        for event in sent:
            q.put(event)
        q.put(None)  # the conversation closed

    async def main() -> list:
        asyncio.get_running_loop().set_default_executor(NoThreads())
        reader = asyncio.create_task(collect())
        await asyncio.sleep(0)  # the reader waits on an empty queue before the engine thread puts anything
        thread = threading.Thread(target=engine_thread)
        thread.start()
        got = await asyncio.wait_for(reader, 10)
        thread.join()
        return got

    async def collect() -> list:
        return [event async for event in events(q, NO_CLIENT)]  # no overflow here: no client to close

    assert asyncio.run(main()) == sent


def test_a_conversation_s_unread_replies_are_bounded_by_the_connection_s_limit() -> None:
    """`Limits.max_unread_s` is the queue's bound while a client reads it: 1.5 s of replies unread (112 frames) pass
    under 2 s, and past them the client is dropped as a slow reader."""
    dropped: list[str] = []

    async def drop(reason: str, code: str) -> None:
        dropped.append(code)

    async def main() -> None:
        q = EventQueue(320)
        reader = asyncio.ensure_future(anext(events(q, SimpleNamespace(limits=Limits(max_unread_s=2.0), drop=drop))))
        await asyncio.sleep(0)  # the reader waits on the empty queue: the bound is set
        for _ in range(112):  # at once, between two runs of the loop: nothing is read meanwhile
            q.put(AudioEvent("c", 0, 0, np.zeros(320, np.float32)))
        assert not q.overflowed and q.frames == 112
        for _ in range(40):
            q.put(AudioEvent("c", 0, 0, np.zeros(320, np.float32)))
        assert q.overflowed
        reader.cancel()
        await until(lambda: dropped, 5, "the slow reader was not dropped")  # (the overflow's drop runs on the loop)

    asyncio.run(main())
    assert dropped == ["slow_reader"]


def test_a_tick_s_events_for_many_readers_wake_the_loop_once_not_once_each() -> None:
    """The engine thread fans a tick's events out to every conversation: each reader gets its own, in order, and
    the loop is woken through its self pipe once for the burst, not once per event (at hundreds of conversations,
    one write, read and loop iteration each)."""
    queues = [EventQueue(320) for _ in range(64)]
    wakes = 0

    def tick(t: int) -> None:
        for i, q in enumerate(queues):
            q.put(MetaEvent(f"s{i}", 0, {"tick": t}))

    async def main() -> list[list]:
        nonlocal wakes
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args):
            nonlocal wakes
            wakes += 1
            return call_soon_threadsafe(*args)

        loop.call_soon_threadsafe = counted
        readers = [asyncio.create_task(collect(q)) for q in queues]
        await asyncio.sleep(0)  # every reader waits on an empty queue
        for t in range(3):
            await asyncio.to_thread(tick, t)  # (the loop may run mid-burst only when the GIL changes hands)
            await until(lambda: all(q.empty() for q in queues), 5, f"tick {t}'s events were not all read")
        for q in queues:
            q.put(None)
        return await asyncio.wait_for(asyncio.gather(*readers), 10)

    async def collect(q: EventQueue) -> list:
        return [event.data["tick"] async for event in events(q, NO_CLIENT)]

    assert asyncio.run(main()) == [[0, 1, 2]] * len(queues)
    assert wakes <= 3 + len(queues)  # one per tick, and at most one each for the closing puts


def test_a_closed_loop_is_not_kept_alive_by_its_waker() -> None:
    """Every `asyncio.run` is a loop with its own self pipe: the wakers' registry must not keep a finished one."""
    import gc

    from server.engine_session import _wakers

    async def read_one() -> list:
        q = EventQueue(320)
        q.put(MetaEvent("s0", 0, {}))
        q.put(None)
        return [event async for event in events(q, NO_CLIENT)]

    gc.collect()
    before = len(_wakers)
    for _ in range(3):
        assert len(asyncio.run(read_one())) == 1
    gc.collect()
    assert len(_wakers) == before
