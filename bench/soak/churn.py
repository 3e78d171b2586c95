"""Churn beside the soak's conversations: connections that open a conversation and close it at once, at a steady
rate, as a crowd of clients that come and go would."""

from __future__ import annotations

import asyncio
import time

from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus, WebSocketException

from bench.soak.client import Events

MAX_IN_FLIGHT = 64  # connections under way at once; past it the rate drops (the server is slower than asked)


async def open_and_close(url: str, events: Events) -> None:
    """One conversation: the upgrade, its first message (it is open), a close. An event "churned" or
    "churn_refused" (the server said no before the upgrade) or "churn_failed"."""
    try:
        async with connect(f"{url}/api/chat?codec=pcm16", open_timeout=30) as ws:
            await asyncio.wait_for(ws.recv(), 30)
        events.add("churned")
    except InvalidStatus:
        events.add("churn_refused")
    except (OSError, TimeoutError, WebSocketException) as e:
        events.add("churn_failed", type(e).__name__)


async def churn(url: str, per_s: float, until: float, events: Events) -> None:
    """`per_s` connections a second (`open_and_close`) until time.monotonic() reaches `until`; then those under way
    finish."""
    running: set[asyncio.Task] = set()
    started, sent = time.monotonic(), 0
    while per_s > 0 and (now := time.monotonic()) < until:
        if len(running) < MAX_IN_FLIGHT:
            task = asyncio.create_task(open_and_close(url, events))
            running.add(task)
            task.add_done_callback(running.discard)
        sent += 1
        await asyncio.sleep(max(0.0, started + sent / per_s - now))
    await asyncio.gather(*running)
