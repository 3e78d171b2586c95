"""The load: the capacity admission reports (a probe), and waves of clients kept at a share of it. Within a wave,
a client that leaves is replaced at once; at its end every live client leaves (each its own way: a close frame or
an abort, mid-turn or mid-reply), and the server is left to settle before the pages are checked."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.common import scrape
from bench.soak.client import REFUSED, Events, Microphone, SoakClient
from bench.soak.plans import Mix, make_plan
from server.moshi.client import refusal_of
from server.moshi.protocol import Kind


async def _drain(ws: ClientConnection) -> None:
    """Read (and drop) what the server sends: a client that reads nothing stops reading its socket once its queue
    is full, and then never sees the close frame that answers its own (its close waits for the close timeout)."""
    with contextlib.suppress(ConnectionClosed):
        async for _ in ws:
            pass


async def _open_streaming(url: str) -> tuple[ClientConnection | None, list[asyncio.Task], str]:
    """A duplex conversation (pcm16) whose microphone streams silence in real time, and its tasks (the microphone,
    the reader); or None and why it was refused (before the upgrade, or after it in a race)."""
    try:
        ws = await connect(f"{url}/api/chat?mode=duplex&codec=pcm16", open_timeout=20)
    except InvalidStatus as e:
        if e.response.status_code not in REFUSED:
            raise
        return None, [], refusal_of(e)
    async with asyncio.timeout(20):
        async for message in ws:
            if message[0] == Kind.METADATA:
                return ws, [asyncio.create_task(Microphone(ws.send).run()), asyncio.create_task(_drain(ws))], ""
            if message[0] == Kind.ERROR:
                await ws.close()
                return None, [], message[1:].decode(errors="replace")
    return None, [], f"closed {ws.close_code} {ws.close_reason}"


async def probe(url: str, limit: int = 512, settle_s: float = 0.5) -> tuple[int, str]:
    """How many conversations admission takes: streaming ones (admission charges a conversation whose audio comes
    in, or that replies, as a real-time stream; a silent one it may not charge at all) are opened one at a time,
    `settle_s` apart (the first audio reaches the engine), until one is refused (503 before the upgrade, or 1013
    after it); then all are closed.
    Returns the count and the refusal's reason."""
    held: list[tuple[ClientConnection, list[asyncio.Task]]] = []
    reason = f"none refused in {limit}"
    try:
        while len(held) < limit:
            ws, tasks, refused = await _open_streaming(url)
            if ws is None:
                reason = refused
                break
            held.append((ws, tasks))
            await asyncio.sleep(settle_s)
    finally:
        for _, (mic, _) in held:
            mic.cancel()
        await asyncio.gather(*(ws.close() for ws, _ in held), return_exceptions=True)
        await asyncio.gather(*(t for _, tasks in held for t in tasks), return_exceptions=True)
    return len(held), reason


def pages(m: dict[str, float]) -> dict[str, int]:
    """K/V pages by state from a /metrics scrape."""
    states = ("free", "cached_evictable", "cached_locked", "private")
    return {s: int(m.get(f's2s_kv_pages{{state="{s}"}}', -1)) for s in states}


def at_baseline(m: dict[str, float], usable: int) -> bool:
    """No page held for a conversation: free + cached_evictable == every usable page, none private or locked."""
    p = pages(m)
    return p["free"] + p["cached_evictable"] == usable and p["private"] == 0 and p["cached_locked"] == 0


async def settle(url: str, usable: int, timeout_s: float) -> tuple[float, dict[str, float]]:
    """Seconds until no conversation is open and the pages are back at baseline (at most `timeout_s`), and the
    scrape that said so (or the last one)."""
    started = time.monotonic()
    while True:
        m = await asyncio.to_thread(scrape, url)
        if (m["s2s_conversations"] == 0 and at_baseline(m, usable)) or time.monotonic() > started + timeout_s:
            return time.monotonic() - started, m
        await asyncio.sleep(0.1)


class Load:
    """Clients from seeded plans, `target` of them live at a time within a wave."""

    def __init__(
        self,
        url: str,
        clips: list[np.ndarray],
        mix: Mix,
        seed: int,
        events: Events,
        reply_timeout_s: float = 15.0,
        stagger_s: float = 0.2,
        client: Callable[..., SoakClient] = SoakClient,
    ):
        self.url, self.clips, self.mix, self.events = url, clips, mix, events
        self.rng = np.random.default_rng(seed)
        self.reply_timeout_s, self.stagger_s, self.client = reply_timeout_s, stagger_s, client
        self.live: set[asyncio.Task] = set()
        self.outcomes: dict[str, int] = {}
        self.started = 0
        self._leave = asyncio.Event()
        self._not_before = 0.0  # after a refusal, the next client waits a second

    def _start(self) -> None:
        plan = make_plan(self.rng, self.mix, len(self.clips), self.started)
        client = self.client(self.url, plan, self.clips, self.events, self.reply_timeout_s)
        task = asyncio.create_task(client.run(self._leave))
        self.live.add(task)
        self.started += 1
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.live.discard(task)
        outcome = "client_bug" if task.cancelled() or task.exception() else task.result()
        if outcome == "client_bug" and not task.cancelled():
            self.events.add("client_bug", repr(task.exception()))
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome == "refused":
            self._not_before = time.monotonic() + 1.0

    async def wave(self, target: int, until: float) -> None:
        """Keep `target` clients live until time.monotonic() reaches `until`; then every client leaves."""
        self._leave = asyncio.Event()
        next_start = time.monotonic()
        while (now := time.monotonic()) < until:
            if len(self.live) < target and now >= max(next_start, self._not_before):
                self._start()
                next_start = now + self.stagger_s
            else:
                await asyncio.sleep(0.05)
        self._leave.set()
        if self.live:
            await asyncio.wait(set(self.live), timeout=30)
