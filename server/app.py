"""ChatServer: the websocket endpoint /api/chat (Moshi's protocol) and plain HTTP /healthz, /metrics on one port.

One connection is one conversation in the engine. Its receive loop turns messages into engine calls; its send loop
turns the conversation's engine events into messages. Bad input gets an error message (kind 0x05) or is dropped,
never a crash and never an effect on another connection; a connection that goes away at any moment closes its
conversation, which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import time
import urllib.parse
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

import numpy as np
import sphn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from s2s import AudioEvent, Engine, MetaEvent, Refused, SamplingParams
from server import protocol
from server.protocol import Control, Kind, ProtocolError
from server.vad import Endpointer, VadConfig

log = logging.getLogger("s2s.server")
SAMPLE_RATE = 24000
FRAME_S = 320 / SAMPLE_RATE


@dataclass
class _Playback:
    """What the client has been sent of the current reply, to tell the engine how much was heard at barge-in."""

    turn: int = -1
    frames: int = 0
    started: float = 0.0

    def sent(self, turn: int, frames: int) -> None:
        if turn != self.turn:
            self.turn, self.frames, self.started = turn, 0, time.monotonic()
        self.frames += frames

    def played_frames(self) -> int:
        """Sent frames the client can have played by now (playback runs in real time from the first one)."""
        return min(self.frames, int((time.monotonic() - self.started) / FRAME_S))


class _Pace:
    """Back-pressure on one connection: past `burst` units plus `rate` a second, reading pauses until the client
    is back within bounds (TCP then slows the client down, at no cost to the server). The first time, it is told."""

    def __init__(self, rate: float, burst: float, warning: str):
        self.rate, self.burst, self.warning = rate, burst, warning
        self.used, self.started, self.warned = 0.0, time.monotonic(), False

    async def take(self, amount: float, ws: ServerConnection) -> None:
        self.used += amount
        ahead = (self.used - self.burst) / self.rate - (time.monotonic() - self.started)
        if ahead > 0:
            if not self.warned:
                self.warned = True
                await ws.send(protocol.error(self.warning))
            await asyncio.sleep(ahead)


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8998
    token: str | None = None
    allowed_origins: list[str] = field(default_factory=list)  # empty: any origin
    max_message_bytes: int = 1 << 20
    realtime_burst_s: float = 2.0  # a client may run this far ahead of real time before it is throttled
    max_messages_per_s: float = 100.0  # beyond this (after a burst of as many), reading pauses: clients send ~12/s
    vad: VadConfig = field(default_factory=VadConfig)  # turn mode endpointing


class _EngineCollector:
    """Prometheus metrics read from the engine at scrape time."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        cache = e.cache.stats()
        yield GaugeMetricFamily("s2s_conversations", "open conversations", value=len(e.convs))
        pages = GaugeMetricFamily("s2s_kv_pages", "K/V pages by state", labels=["state"])
        for state in ("free", "cached_evictable", "cached_locked", "private"):
            pages.add_metric([state], getattr(cache, state))
        yield pages
        yield CounterMetricFamily("s2s_refused", "conversations refused at admission", value=e.stats.refused)
        yield CounterMetricFamily("s2s_deadline_misses", "duplex frames sent late", value=e.stats.deadline_misses)
        yield CounterMetricFamily("s2s_ticks", "engine ticks", value=e.stats.ticks)
        yield CounterMetricFamily("s2s_busy_seconds", "time spent in ticks", value=e.stats.busy_seconds)
        yield CounterMetricFamily("s2s_preempted", "conversations preempted for K/V pages", value=e.stats.preempted)
        yield CounterMetricFamily("s2s_prefill_steps", "steps computed as prefill", value=e.stats.prefill_steps)
        yield CounterMetricFamily(
            "s2s_copied_steps",
            "steps whose K/V were copied from a shared page, not computed",
            value=e.stats.copied_steps,
        )
        yield CounterMetricFamily("s2s_cache_hit_steps", "prefix cache hit steps", value=cache.hit_steps)
        yield CounterMetricFamily("s2s_cache_missed_steps", "prefix cache missed steps", value=cache.missed_steps)
        phases = CounterMetricFamily("s2s_tick_phase_seconds", "time spent in ticks, by phase", labels=["phase"])
        for phase, seconds in e.stats.phase_seconds.items():
            phases.add_metric([phase], seconds)
        yield phases
        ticks = list(e.stats.tick_seconds)[-1000:]
        if ticks:
            yield GaugeMetricFamily("s2s_tick_seconds_p50", "tick time p50, last 1000", value=float(np.median(ticks)))


def _sampling(query: dict[str, str]) -> SamplingParams:
    def pick(*names: str) -> str | None:
        return next((query[n] for n in names if n in query), None)

    kw = {}
    for key, names, cast in (
        ("temperature", ("temperature", "audio_temperature"), float),
        ("top_k", ("top_k", "audio_topk"), int),
        ("top_p", ("top_p",), float),
        ("seed", ("seed", "audio_seed"), int),
    ):
        raw = pick(*names)
        if raw is not None:
            try:
                kw[key] = cast(raw)
            except ValueError as e:
                raise ProtocolError(f"bad {names[0]}={raw!r}: {e}") from e
    return SamplingParams(**kw)


class ChatServer:
    def __init__(self, engine: Engine, options: ServerOptions | None = None):
        self.engine = engine
        self.options = options or ServerOptions()
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self._server: Server | None = None

    async def start(self) -> int:
        """Start the engine thread and listen; returns the port (useful with port 0)."""
        self.engine.start()
        self._server = await serve(
            self._chat,
            self.options.host,
            self.options.port,
            process_request=self._http,
            max_size=self.options.max_message_bytes,
            ping_interval=20,
        )
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await asyncio.to_thread(self.engine.stop)

    # ---- HTTP ----------------------------------------------------------------------------------------------------

    def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path, _, query = request.path.partition("?")
        if path == "/healthz":
            return connection.respond(HTTPStatus.OK, "ok\n")
        if path == "/metrics":
            body = generate_latest(self.registry)
            return Response(200, "OK", Headers([("Content-Type", "text/plain; version=0.0.4")]), body)
        if path == "/":
            page = (Path(__file__).parent / "web" / "index.html").read_bytes()
            return Response(200, "OK", Headers([("Content-Type", "text/html; charset=utf-8")]), page)
        if path != "/api/chat":
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        if self.options.token is not None:
            given = urllib.parse.parse_qs(query).get("token", [""])[0]
            if not hmac.compare_digest(given.encode(), self.options.token.encode()):
                return connection.respond(HTTPStatus.UNAUTHORIZED, "a valid token is required\n")
        origin = request.headers.get("Origin")
        if self.options.allowed_origins and origin is not None and origin not in self.options.allowed_origins:
            return connection.respond(HTTPStatus.FORBIDDEN, "origin not allowed\n")
        return None

    # ---- one conversation ----------------------------------------------------------------------------------------

    async def _chat(self, ws: ServerConnection) -> None:
        query = {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(ws.request.path).query).items()}
        try:
            mode = query.get("mode", "duplex")
            codec = query.get("codec", "opus")
            if mode not in ("duplex", "turn"):
                raise ProtocolError(f"mode must be duplex or turn, got {mode!r}")
            if codec not in ("opus", "pcm16"):
                raise ProtocolError(f"codec must be opus or pcm16, got {codec!r}")
            voice = query.get("voice")
            if voice is not None and (not voice.isidentifier() or voice not in self.engine.voices):
                raise ProtocolError(f"unknown voice {voice!r}; voices are plain names: {sorted(self.engine.voices)}")
            sampling = _sampling(query)
        except ProtocolError as e:
            await ws.send(protocol.error(str(e)))
            await ws.close(1008, "bad request")
            return
        await ws.send(protocol.handshake())
        try:
            cid = await asyncio.to_thread(self.engine.open, mode, prompt=voice, sampling=sampling)
        except Refused as e:
            await ws.send(protocol.error(f"refused: {e}"))
            await ws.close(1013, "try again later")
            return
        playback = _Playback()
        sender = asyncio.create_task(self._send_loop(ws, cid, codec, playback))
        try:
            await ws.send(protocol.metadata({"session": cid, "mode": mode, "codec": codec}))
            await self._receive_loop(ws, cid, mode, codec, playback)
        except ConnectionClosed:
            pass
        finally:  # whatever happened, the conversation goes and its pages with it
            await asyncio.to_thread(self.engine.close, cid)
            await asyncio.wait_for(sender, 5)

    async def _receive_loop(self, ws: ServerConnection, cid: str, mode: str, codec: str, playback: _Playback) -> None:
        opus = sphn.OpusStreamReader(SAMPLE_RATE) if codec == "opus" else None
        vad: Endpointer | None = None  # made on the first audio: loading the model costs CPU the engine needs
        audio_pace = _Pace(1.0, self.options.realtime_burst_s, "sending faster than real time: throttled")
        rate = self.options.max_messages_per_s
        message_pace = _Pace(rate, rate, f"sending more than {rate:g} messages a second: throttled")
        async for message in ws:
            await message_pace.take(1, ws)
            try:
                kind, payload = protocol.parse(message)
            except ProtocolError as e:
                await ws.send(protocol.error(str(e)))
                continue
            if kind is Kind.AUDIO:
                pcm = self._decode_audio(payload, opus)
                if pcm is None:
                    await ws.send(protocol.error("audio payload is not valid " + ("Ogg/Opus" if opus else "PCM16")))
                    continue
                await audio_pace.take(len(pcm) / SAMPLE_RATE, ws)
                if not len(pcm):
                    continue
                if mode == "turn" and vad is None:
                    vad = await asyncio.to_thread(Endpointer, self.options.vad)
                events = await asyncio.to_thread(vad.push, pcm) if vad is not None else []
                if "speech_start" in events:  # barge-in if a reply is playing (a no-op otherwise), before this audio
                    await asyncio.to_thread(self.engine.interrupt, cid, playback.played_frames())
                self.engine.push_audio(cid, pcm)
                if "end_of_turn" in events:
                    await asyncio.to_thread(self.engine.end_turn, cid)
            elif kind is Kind.CONTROL and payload[0] == Control.END_TURN:
                if mode == "turn":
                    await asyncio.to_thread(self.engine.end_turn, cid)
            # other kinds (text, ping, unknown) are discarded

    @staticmethod
    def _decode_audio(payload: bytes, opus: sphn.OpusStreamReader | None) -> np.ndarray | None:
        if opus is None:
            if len(payload) % 2:
                return None
            return np.frombuffer(payload, dtype="<i2").astype(np.float32) / 32768.0
        try:
            return np.asarray(opus.append_bytes(payload), dtype=np.float32).reshape(-1)
        except Exception:  # sphn raises its own errors on broken streams
            return None

    async def _send_loop(self, ws: ServerConnection, cid: str, codec: str, playback: _Playback) -> None:
        opus = sphn.OpusStreamWriter(SAMPLE_RATE) if codec == "opus" else None
        events = self.engine.event_queue(cid)
        loop, ready = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:  # called on the engine thread
            with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is waiting any more
                loop.call_soon_threadsafe(ready.set)

        events.on_put = wake
        while True:
            try:
                event = events.get_nowait()
            except queue.Empty:
                await ready.wait()
                ready.clear()
                continue
            if event is None:
                return
            try:
                if isinstance(event, AudioEvent):
                    playback.sent(event.turn, len(event.pcm) // 320)
                    pcm = np.clip(event.pcm, -1, 1)
                    data = opus.append_pcm(pcm) if opus else (pcm * 32767).astype("<i2").tobytes()
                    if len(data):
                        await ws.send(protocol.audio(bytes(data)))
                elif isinstance(event, MetaEvent):
                    await ws.send(protocol.metadata({"session": event.session, "turn": event.turn, **event.data}))
            except ConnectionClosed:
                continue  # keep draining until the conversation is closed


def metadata_of(message: bytes) -> dict:
    """Client side: the JSON of a metadata message."""
    return json.loads(message[1:].decode())
