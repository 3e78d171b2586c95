"""The engine's side of a connection: `events`, the one bridge from a conversation's engine events to asyncio, and
`EngineSession`, a conversation in the engine behind a connection of any protocol."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import numpy as np
from websockets.exceptions import ConnectionClosed

from codec.pcm import SAMPLE_RATE
from s2s import AudioEvent, MetaEvent, SamplingParams
from server.connection import Connection
from server.turn_metrics import TurnMetrics
from server.vad.config import Gate, VadConfig

if TYPE_CHECKING:
    from s2s import Engine
    from s2s.engine.events import CodesEvent, EventQueue
    from s2s.models.moshi.text import TextPieces


SLOW = "not reading fast enough: closed"
_dropping: set[asyncio.Task] = set()  # `Connection.drop`s under way (the loop keeps only weak references to tasks)


class LoopWaker:
    """Sets asyncio events of one loop from other threads, one `call_soon_threadsafe` for a burst of sets: the
    engine thread fans a tick's events out to every conversation at once, and each wake-up through the loop's self
    pipe is a write, a read and a loop iteration."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # (`_wakers` holds its key weakly only if its value does too)
        self._lock = threading.Lock()
        self._due: dict[asyncio.Event, None] = {}  # (in the order set: the readers run in the order of the puts)

    def set(self, ready: asyncio.Event) -> None:
        """From any thread: `ready.set()` on the loop, soon."""
        with self._lock:
            scheduled = bool(self._due)
            self._due[ready] = None
        if not scheduled and (loop := self._loop()) is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is waiting any more
                loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            due, self._due = self._due, {}
        for ready in due:
            ready.set()


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = weakref.WeakKeyDictionary()


async def events(q: EventQueue, conn: Connection) -> AsyncIterator[AudioEvent | CodesEvent | MetaEvent]:
    """A conversation's events until it is closed, read for `conn`'s client. The engine thread wakes the reader
    through `on_put` (`LoopWaker`): no polling, and no thread per read. One reader at a time.

    When the queue overflows (more than `Limits.max_unread_s` of replies wait, and at least a frame: the client
    reads slower than the conversation speaks), the client is told and closed at once, even while the reader waits on
    a send to it; the connection's end then closes the conversation."""
    loop, ready = asyncio.get_running_loop(), asyncio.Event()
    waker = _wakers.setdefault(loop, LoopWaker(loop))

    def drop() -> None:
        task = asyncio.create_task(conn.drop(SLOW, "slow_reader"))
        _dropping.add(task)
        task.add_done_callback(_dropping.discard)

    def overflowed() -> None:  # from the engine thread
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(drop)

    q.max_frames = max(1, round(conn.limits.max_unread_s * SAMPLE_RATE / q.frame_size))
    q.on_put, q.on_overflow = functools.partial(waker.set, ready), overflowed
    while True:
        try:
            event = q.get_nowait()
        except queue.Empty:
            await ready.wait()
            ready.clear()
            continue
        if event is None:
            return
        yield event


def frame_texts(pieces: TextPieces, ids: np.ndarray) -> list[str]:
    """Each frame's text from its text id: "" for padding, and for an id outside the tokenizer's vocabulary (no text
    the model sampled: a frame it has not written)."""
    vocab = pieces.vocab_size
    return [pieces.text((i,)) if 0 <= i < vocab else "" for i in ids.tolist()]


class EngineSession:
    """A conversation in the engine: the client's audio and turn ends in, its events out to the client."""

    def __init__(
        self, engine: Engine, cid: str, mode: str, vad: VadConfig, gate: Gate, conn: Connection, metrics: TurnMetrics
    ):
        self.engine, self.cid, self.mode, self.metrics = engine, cid, mode, metrics
        self.text_pieces: TextPieces | None = getattr(engine.model, "text_pieces", None)  # with a text stream
        self.info = {"session": cid, "mode": mode}
        self.vad, self.gate = vad if mode == "turn" else None, gate
        self._sender = asyncio.create_task(self._send(conn))

    @classmethod
    async def open(
        cls,
        engine: Engine,
        conn: Connection,
        mode: str,
        voice: str | None,
        sampling: SamplingParams,
        vad: VadConfig,
        gate: Gate,
        metrics: TurnMetrics,
    ) -> EngineSession:
        """Open the conversation (or raise `Refused`) and start sending its events. Engine calls never wait for a
        tick: they are made on the event loop."""
        cid = engine.open(mode, prompt=voice, sampling=sampling)
        return cls(engine, cid, mode, vad, gate, conn, metrics)

    async def barge_in(self, played_samples: int) -> None:
        self.engine.interrupt(self.cid, played_samples // self.engine.cfg.frame_size)

    def audio(self, pcm: np.ndarray) -> None:
        self.engine.push_audio(self.cid, pcm)

    async def end_turn(self) -> None:
        if self.mode == "turn":  # a duplex stream has no turns to end
            self.engine.end_turn(self.cid)

    async def speech_ended(self) -> None:
        pass  # its audio is context: nothing to answer

    async def stream(self, action: str) -> None:
        {"start": self.engine.unpause, "pause": self.engine.pause, "restart": self.engine.restart}[action](self.cid)

    async def close(self) -> None:
        self.engine.close(self.cid)
        await asyncio.wait_for(self._sender, 5)

    async def _send(self, conn: Connection) -> None:
        async for event in events(self.engine.event_queue(self.cid), conn):
            try:
                if isinstance(event, AudioEvent):
                    if event.text is not None and self.text_pieces is not None:
                        await self._send_with_text(conn, event)
                    else:
                        await conn.send_audio(event.pcm, event.turn)
                elif isinstance(event, MetaEvent):
                    if event.data.get("event") == "reply_done":
                        self.metrics.observe("moshi", event.data["times"])
                    await conn.send_event({"session": event.session, "turn": event.turn, **event.data})
            except ConnectionClosed:
                continue  # keep draining until the conversation is closed

    async def _send_with_text(self, conn: Connection, event: AudioEvent) -> None:
        """Frame by frame, as Kyutai's `moshi.server` sends a step: its audio, then its text piece (a `0x02` message),
        if it is not padding."""
        frame = len(event.pcm) // max(1, len(event.text))
        for i, piece in enumerate(frame_texts(self.text_pieces, event.text)):
            await conn.send_audio(event.pcm[i * frame : (i + 1) * frame], event.turn)
            if piece:
                await conn.send_text(piece)
