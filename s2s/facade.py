"""AsyncEngine: the engine for asyncio callers (the server). The engine runs in its own thread; this forwards calls
to it and turns each conversation's event queue into an async iterator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np

from s2s.engine import AudioEvent, Engine, MetaEvent


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine

    async def __aenter__(self) -> AsyncEngine:
        self.engine.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.engine.stop)

    def open(self, mode: str = "duplex", **kw) -> str:
        return self.engine.open(mode, **kw)

    def push_audio(self, cid: str, pcm: np.ndarray) -> None:
        self.engine.push_audio(cid, pcm)

    def end_turn(self, cid: str) -> None:
        self.engine.end_turn(cid)

    def interrupt(self, cid: str, played_frames: int) -> None:
        self.engine.interrupt(cid, played_frames)

    def close(self, cid: str) -> None:
        self.engine.close(cid)

    async def events(self, cid: str) -> AsyncIterator[AudioEvent | MetaEvent]:
        """The conversation's events until it is closed. Waiting happens off the event loop."""
        q = self.engine.event_queue(cid)
        while True:
            event = await asyncio.to_thread(q.get)
            if event is None:
                return
            yield event
