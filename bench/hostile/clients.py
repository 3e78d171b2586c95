"""A hostile client's view of a server: a connection read in the background, and what an attempt to open a
conversation got."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.common import scrape
from server.moshi.client import refusal_of
from server.moshi.protocol import Kind


class Listener:
    """Reads a connection in the background: whether it opened (the metadata message), its error messages, how many
    audio messages came, and how it closed."""

    def __init__(self, ws: ClientConnection):
        self.ws, self.opened, self.errors, self.audio = ws, False, [], 0
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in self.ws:
                if message[0] == Kind.METADATA:
                    self.opened = True
                elif message[0] == Kind.ERROR:
                    self.errors.append(message[1:].decode(errors="replace"))
                elif message[0] == Kind.AUDIO:
                    self.audio += 1

    async def until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> bool:
        """Wait until `done()`, the connection ends or `timeout_s` passes; `done()` then."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not done() and not self.task.done():
                    await asyncio.sleep(0.05)
        return done()

    def told(self, text: str) -> bool:
        return any(text in e for e in self.errors)

    def closed(self) -> str | None:
        """How the connection ended ("closed CODE 'reason'"), or None while it is open."""
        return f"closed {self.ws.close_code} {self.ws.close_reason!r}" if self.task.done() else None

    def said(self) -> str:
        """What the server told this client: its first error message (and how many) and its close, if any."""
        told = f"{len(self.errors)} error(s), first {self.errors[0]!r}" if self.errors else "no error message"
        return "; ".join(filter(None, [told, self.closed()]))


async def attempt(url: str, query: str, origin: str | None = None) -> str:
    """What a request for a conversation got: "HTTP STATUS" (refused at the upgrade; with the body for a full or
    draining server, 503, or a client at its limit, 429: "refused: REASON"), "opened", or how it closed."""
    try:
        async with connect(f"{url}/api/chat?{query}", origin=origin) as ws:
            heard = Listener(ws)
            if await heard.until(lambda: heard.opened):
                return "opened" + (f"; {heard.said()}" if heard.errors else "")
            await heard.task
            return heard.said()
    except InvalidStatus as e:
        status = e.response.status_code
        return f"HTTP {status}" + (f" {refusal_of(e)!r}" if status in (429, 503) else "")


def yes_no(outcome: str) -> str:
    return f"{'yes' if outcome.startswith('opened') else 'no'} ({outcome})"


async def settle(url: str, timeout_s: float) -> float:
    """Seconds until `s2s_conversations` reads 0 (a connection's conversation closes a moment after its socket, or
    later if the server is not reading it), at most `timeout_s`."""
    started = time.monotonic()
    while scrape(url)["s2s_conversations"] and time.monotonic() < started + timeout_s:
        await asyncio.sleep(0.1)
    return time.monotonic() - started
