"""The connection core: one websocket from request to close, whatever its protocol and whatever answers it.

`serve_connection(ws, endpoint, limits, clients, replica, dropped)`, top to bottom (a server refuses what it can
before the upgrade: `ChatServer`'s `busy`):

1. `endpoint.accept(query, headers)` reads the request: the connection's `Wire` (the protocol's framing) and how to
   open its `Session`. A bad request is told (`endpoint.error`) and closed with 1008.
2. `wire.handshake()` goes out (Moshi's handshake; a JSON-event protocol has none), then the session opens. A
   refusal that the server could not foresee before the upgrade (the cascade's speech-to-text, or a race with
   another connection) is told "refused: REASON" and closed with 1013 and the reason.
3. `wire.opened(session.info)` goes out, with the id of the replica that serves it if it has one (`s2s cluster`);
   the receive loop reads messages until the client goes: the wire parses each into `Audio`, `EndTurn`, `Stream` or
   `Request` (`server/protocols.py`; a bad one is told and dropped). Audio goes on in slices of 80 ms, each paced in
   real time: past the burst, a long message is fed over as long as it lasts, not in one tick, and no more of it
   once the client is gone. Each slice runs through the session's VAD, if it has one (its settings may change
   between messages), where speech over a reply is a barge-in with what the client has heard (`Playback`) and
   silence after speech ends the turn (if the session's gate lets it cost a reply now). A protocol's own requests
   (`Request`: the Realtime API's events) go to the session. Messages and their bytes are paced too, whether or not
   they parse: a message costs one of `Limits.max_messages_per_s`, a `Request` its `cost` (what it makes the server
   do). A client that sends no audio for `Limits.idle_timeout_s` (counted from open; a reply still playing to it is
   not idle) is told "idle: ..." and closed with 1008.
4. However the socket ended, the session closes. A client that leaves (`Connection.gone`: its close, or its socket
   hung up, seen before the messages it sent and the pace held back) ends the loop at the next message or slice:
   what it had queued is dropped, not worked through.

A session sends from tasks of its own through `Connection`: `send_audio` (which `Playback` counts), `send_text` (a
model's text stream), `send_event`, `send_error`. `server/engine_session.py` has the engine's side (the one bridge
from engine events to asyncio).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
import urllib.parse
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from codec.pcm import SAMPLE_RATE
from s2s import Refused
from server.moshi.protocol import BLOCK, ProtocolError, StreamError
from server.protocols import Audio, EndTurn, Message, Request, Session, Stream, Wire
from server.vad.endpointer import Endpointer

Opener = Callable[["Connection"], Awaitable[Session]]
HANGUP = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR  # a peer that shut its side or reset
HANGUP_POLL_S = 0.1  # how often a read the pace holds back looks for a client that left


class Endpoint(Protocol):
    """A protocol on the core, at one path: Moshi's on the engine, Moshi's on the cascade, a JSON-event protocol."""

    def error(self, text: str) -> Message: ...

    def accept(self, query: dict[str, str], headers: Headers) -> tuple[Wire, Opener]:
        """The request's wire and session, from its query parameters and headers. Raises `ProtocolError`."""


@dataclass
class Limits:
    """Back-pressure on one connection, and what one client may hold."""

    realtime_burst_s: float = 2.0  # a client may run this far ahead of real time (audio and bytes) before throttling
    max_messages_per_s: float = 100.0  # beyond this (after a burst of as many), reading pauses: clients send ~12/s
    idle_timeout_s: float = 60.0  # a connection whose client sends no audio this long is closed (a reply plays on)
    max_unread_s: float = 20.0  # reply audio a client may leave unread before it is told and closed (its memory)
    max_conversations_per_client: int = 8  # open at once from one IP address; 0: no limit

    def __post_init__(self) -> None:
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle timeout must be over 0 s, got {self.idle_timeout_s}")
        if not self.max_unread_s > 0:  # (at least a frame of the engine's codec: `engine_session.events`)
            raise ValueError(f"unread audio must be allowed over 0 s, got {self.max_unread_s}")
        if (n := self.max_conversations_per_client) < 0:
            raise ValueError(f"conversations per client must be 0 (no limit) or more, got {n}")


class Playback:
    """What the client has heard of the current reply, in samples, to tell the engine at barge-in (the session counts
    them in its codec's frames). The client plays audio in real time from when it arrives; a gap in the stream (a
    reply that stalls) pauses its playback, and is not heard."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.turn, self.samples, self.until = -1, 0, 0.0  # `until`: when what was sent will have played

    def sent(self, turn: int, samples: int) -> None:
        now = self.clock()
        if turn != self.turn:
            self.turn, self.samples, self.until = turn, 0, now
        self.samples += samples
        self.until = max(self.until, now) + samples / SAMPLE_RATE

    def played_samples(self) -> int:
        """Samples of the current reply the client can have played by now."""
        queued = max(0.0, self.until - self.clock()) * SAMPLE_RATE
        return int(max(0.0, self.samples - queued))


class Connection:
    """One client's socket as a session sees it: messages out in the wire's framing, and what the client has heard."""

    def __init__(self, ws: ServerConnection, wire: Wire, limits: Limits, dropped: Callable[[str], None]):
        """`dropped(code)`: the server closed it (`drop`), and why (`idle`, `slow_reader`, a stream error's code)."""
        self.ws, self.wire, self.limits, self.dropped, self.playback = ws, wire, limits, dropped, Playback()
        self.heard_until = time.monotonic()  # when the audio the client sent will have played (from open: none yet)

    def heard(self, pcm: np.ndarray) -> None:
        """The client sent audio: it is not idle while that plays (pacing keeps it within a burst of real time)."""
        if len(pcm):
            self.heard_until = max(self.heard_until, time.monotonic()) + len(pcm) / SAMPLE_RATE

    def idle_since(self) -> float:
        """When the client's audio, or the reply sent to it, last played: a conversation answering is not idle."""
        return max(self.heard_until, self.playback.until)

    def gone(self) -> bool:
        """Whether the client has left: its close came in, or its socket hung up. The socket shows it at once, even
        behind messages not read yet (a backlog the pace holds back, in the kernel's buffer or websockets' queue),
        where the close frame would wait behind them."""
        if self.ws.state is not State.OPEN:
            return True
        sock = self.ws.transport.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:
            return True
        poller = select.poll()
        poller.register(sock.fileno(), HANGUP)
        return bool(poller.poll(0))

    async def send_audio(self, pcm: np.ndarray, turn: int) -> bool:
        """Reply audio of `turn`; True once any of it went out (an Opus stream holds its first samples back)."""
        pcm = np.clip(pcm, -1, 1)
        self.playback.sent(turn, len(pcm))
        messages = self.wire.audio(pcm)
        for message in messages:
            await self.ws.send(message)
        return bool(messages)

    async def send_text(self, piece: str) -> None:
        """Text of the model's text stream (`Wire.text`)."""
        await self.ws.send(self.wire.text(piece))

    async def send_event(self, data: dict) -> None:
        await self.ws.send(self.wire.event(data))

    async def send_error(self, text: str, code: str = "invalid_request") -> None:
        await self.ws.send(self.wire.error(text, code))

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code, reason.encode()[:123].decode(errors="ignore"))  # a close frame holds 123 bytes

    async def drop(self, reason: str, code: str) -> None:
        """Tell the client why, and close with 1008. A client that reads nothing takes neither the error nor the
        close frame (each waits for room on its socket): after the close timeout, its connection is cut."""
        self.dropped(code)
        with contextlib.suppress(TimeoutError, ConnectionClosed):
            async with asyncio.timeout(self.ws.close_timeout):
                await self.send_error(reason, code)
                await self.close(1008, reason)
        self.ws.transport.abort()


class PerClient:
    """Open conversations by client, at most `limit` each (0: no limit): one machine's connections that do nothing
    cannot take every slot. A client is its IP address: the peer's, or, where the peer is a proxy, the address that
    proxy names last in `X-Forwarded-For`. A proxy is a peer on a Unix socket (a server listens on one only for the
    proxy in front of it, `ServerOptions.proxy_listener`: `s2s cluster`'s HAProxy), or one of `proxies` (addresses:
    any local process has 127.0.0.1, and could name whom it liked)."""

    def __init__(self, limit: int, proxies: Iterable[str] = ()):
        self.limit, self.proxies, self.open = limit, frozenset(proxies), Counter()

    def address(self, peer: tuple | str | None, headers: Headers) -> str:
        """The client's address, from the socket's peer (an IP address and port; a Unix socket's name, usually "";
        None if it went before asyncio asked) and the request."""
        unix = isinstance(peer, str)
        address = "" if unix else (peer or ("",))[0]
        if (unix or address in self.proxies) and (forwarded := headers.get_all("X-Forwarded-For")):
            return forwarded[-1].rpartition(",")[2].strip()
        return address

    def problem(self, client: str) -> str | None:
        """Why `client` may not open another conversation now, or None."""
        if self.limit and self.open[client] >= self.limit:
            return f"this client has {self.limit} conversations open, the most one client may"
        return None

    def take(self, client: str) -> None:
        """One more of the client's conversations; `Refused` past the limit."""
        if reason := self.problem(client):
            raise Refused(reason)
        self.open[client] += 1

    def give_back(self, client: str) -> None:
        self.open[client] -= 1
        if not self.open[client]:
            del self.open[client]

    @contextlib.contextmanager
    def conversation(self, client: str) -> Iterator[None]:
        """Hold one of the client's conversations while in the block; `Refused` past the limit."""
        self.take(client)
        try:
            yield
        finally:
            self.give_back(client)


class Pace:
    """Back-pressure: past `burst` units plus `rate` a second, reading pauses until the client is back within
    bounds (TCP then slows the client down, at no cost to the server). The first time, it is told."""

    def __init__(self, rate: float, burst: float, warning: str):
        self.rate, self.burst, self.warning = rate, burst, warning
        self.used, self.started, self.warned = 0.0, time.monotonic(), False

    async def take(self, amount: float, conn: Connection) -> None:
        self.used += amount
        ahead = (self.used - self.burst) / self.rate - (time.monotonic() - self.started)
        if ahead > 0:
            if not self.warned:
                self.warned = True
                await conn.send_error(self.warning, "throttled")
            end = time.monotonic() + ahead
            while not conn.gone() and (left := end - time.monotonic()) > 0:  # a client that goes ends its wait
                await asyncio.sleep(min(left, HANGUP_POLL_S))


async def serve_connection(
    ws: ServerConnection,
    endpoint: Endpoint,
    limits: Limits,
    clients: PerClient,
    replica: str | None,
    dropped: Callable[[str], None],
) -> None:
    query = {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(ws.request.path).query).items()}
    try:
        wire, open_session = endpoint.accept(query, ws.request.headers)
    except ProtocolError as e:
        await ws.send(endpoint.error(str(e)))
        await ws.close(1008, "bad request")
        return
    conn = Connection(ws, wire, limits, dropped)
    if (hello := wire.handshake()) is not None:
        await ws.send(hello)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(clients.conversation(clients.address(ws.remote_address, ws.request.headers)))
            session = await open_session(conn)
        except Refused as e:
            await conn.send_error(f"refused: {e}", "refused")
            await conn.close(1013, str(e))  # try again later, and why
            return
        idle = asyncio.create_task(_close_when_idle(conn, limits.idle_timeout_s))
        bad: StreamError | None = None
        try:
            await ws.send(wire.opened(session.info | ({"replica": replica} if replica else {})))
            bad = await _receive(conn, session, limits)
        except ConnectionClosed:
            pass
        finally:  # whatever happened, the session goes (a conversation's pages with it)
            idle.cancel()
            await session.close()
    if bad is not None:  # after the session: a client that does not read holds its socket, not its slot
        await conn.drop(str(bad), bad.code)


async def _close_when_idle(conn: Connection, timeout_s: float) -> None:
    """Once the client has sent no audio for `timeout_s` (and no reply is playing to it), tell it and close: a
    conversation nobody uses holds a slot another client could have."""
    while (left := conn.idle_since() + timeout_s - time.monotonic()) > 0:
        await asyncio.sleep(left)
    await conn.drop(f"idle: no audio for {timeout_s:g} s", "idle")


async def _receive(conn: Connection, session: Session, limits: Limits) -> StreamError | None:
    """The client's messages into `session` until the socket ends (None) or a message the connection cannot go on
    from (returned: the caller closes the session, then the socket)."""
    audio_pace = Pace(1.0, limits.realtime_burst_s, "sending faster than real time: throttled")
    rate = limits.max_messages_per_s
    message_warning = f"sending more than {rate:g} messages a second (a costlier event counts as several): throttled"
    message_pace = Pace(rate, rate, message_warning)
    byte_rate = conn.wire.audio_bytes_per_s + rate * conn.wire.framing_bytes  # the most an honest client sends
    byte_warning = f"sending more than {byte_rate:g} bytes a second: throttled"
    byte_pace = Pace(byte_rate, byte_rate * limits.realtime_burst_s, byte_warning)
    vad: Endpointer | None = None  # made on the first audio to endpoint
    async for message in conn.ws:
        try:
            item = conn.wire.parse(message)
        except StreamError as e:
            return e
        except ProtocolError as e:
            await conn.send_error(str(e), e.code)
            item = None
        await message_pace.take(item.cost if isinstance(item, Request) else 1, conn)  # what it makes the server do
        if conn.gone():  # the client left, maybe while its messages waited: the rest of them go unread
            return None
        if isinstance(item, Audio):  # only audio keeps a connection from being idle
            conn.heard(item.pcm)
        if isinstance(item, EndTurn):
            await session.end_turn()
        elif isinstance(item, Stream | Request):
            try:
                await (session.stream(item.action) if isinstance(item, Stream) else session.request(item))
            except ProtocolError as e:
                await conn.send_error(str(e), e.code)
        elif isinstance(item, Audio):
            for a in range(0, len(item.pcm), BLOCK):
                pcm = item.pcm[a : a + BLOCK]
                await audio_pace.take(len(pcm) / SAMPLE_RATE, conn)
                if conn.gone():  # the client went while its message waited: the rest goes
                    return None
                if session.vad is None:
                    vad = None
                elif vad is None:  # (a process's first endpointer loads Silero: in a thread, as the scoring runs)
                    vad = await asyncio.to_thread(Endpointer, session.vad, session.gate)
                elif vad.cfg is not session.vad:  # new settings: thresholds, for the same stream and state
                    vad.configure(session.vad)
                heard = await asyncio.to_thread(vad.push, pcm) if vad is not None else []
                if "speech_start" in heard:  # a barge-in if a reply is playing (a no-op otherwise), before this audio
                    await session.barge_in(conn.playback.played_samples())
                elif "take_back" in heard:  # the user only paused: the reply to that turn is cancelled unheard
                    await session.barge_in(0)
                session.audio(pcm)
                if "end_of_turn" in heard:  # a turn worth a reply now (`Endpointer`, the server's `TurnGate`)
                    await session.end_turn()
                elif "speech_end" in heard:
                    await session.speech_ended()
        # Taken last, so the slices' real-time pace comes first: audio then finds its bytes within bounds.
        await byte_pace.take(len(message), conn)
    return None
