"""Every few seconds, one row for the interval since the last: the server's RSS (VmRSS of its process), K/V pages by
state, conversations, tick time (mean and p95) and deadline misses (from /metrics), and what the clients saw
(first-audio latency of turns, refusals, errors)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np

from bench.common import scrape
from bench.concurrency_bench import rss_bytes
from bench.soak.client import Event, Events
from bench.soak.load import pages
from server.scrape import quantile

# client event kinds counted in each row, as columns
COUNTED = ("opened", "refused", "error", "dropped", "failed", "no_reply", "barge_in", "barge_in_missed", "silent")
COUNTED += ("client_bug", "churned", "churn_refused", "churn_failed")


def _delta(m: dict[str, float], prev: dict[str, float], key: str) -> float:
    return m.get(key, 0.0) - prev.get(key, 0.0)


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


def interval_row(
    t_s: float, seconds: float, m: dict[str, float], prev: dict[str, float], rss: int, events: list[Event], live: int
) -> dict:
    """The row of an interval of `seconds` ending `t_s` into the run: scrapes `prev` (its start) and `m` (its end),
    the server's RSS at its end, the clients' `events` within it and the clients live at its end."""
    ticks = _delta(m, prev, "s2s_ticks_total")
    latency = [float(e.value) for e in events if e.kind == "latency"]
    ttfa = [float(e.value) for e in events if e.kind == "server_ttfa"]
    row = {
        "t_s": round(t_s, 3),
        "interval_s": round(seconds, 3),
        "rss_mb": rss / 1e6,
        **{f"pages_{state}": n for state, n in pages(m).items()},
        "conversations": int(m.get("s2s_conversations", 0)),
        "clients_live": live,
        "ticks": int(ticks),
        "tick_ms_mean": 1000 * _delta(m, prev, "s2s_busy_seconds_total") / ticks if ticks else float("nan"),
        "tick_ms_p95": 1000 * quantile(m, prev, "s2s_tick_seconds", 0.95),
        "deadline_misses": int(_delta(m, prev, "s2s_deadline_misses_total")),
        "refused_by_server": int(_delta(m, prev, "s2s_refused_total")),
        "preempted": int(_delta(m, prev, "s2s_preempted_total")),
        "turns": len(latency),
        "first_audio_ms_p50": _ms(latency, 50),
        "first_audio_ms_p95": _ms(latency, 95),
        "server_ttfa_ms_p95": _ms(ttfa, 95),
        "left_close": sum(e.kind == "left" and e.value == "close" for e in events),
        "left_abort": sum(e.kind == "left" and e.value == "abort" for e in events),
    }
    row.update({kind: sum(e.kind == kind for e in events) for kind in COUNTED})
    return row


class Sampler:
    """Rows every `every_s` from `t0` (time.monotonic()) until stopped; `on_row(row)` is called with each."""

    def __init__(self, url: str, pid: int, events: Events, live: Callable[[], int], t0: float, every_s: float):
        self.url, self.pid, self.events, self.live, self.t0, self.every_s = url, pid, events, live, t0, every_s
        self.rows: list[dict] = []
        self.prev: dict[str, float] | None = None
        self.prev_t = t0

    async def sample(self) -> dict | None:
        """One row for the interval since the last call (None on the first, which only sets the start)."""
        m = await asyncio.to_thread(scrape, self.url)
        now, rss = time.monotonic(), rss_bytes(self.pid)
        row = None
        if self.prev is not None:
            events = self.events.between(self.prev_t, now)
            row = interval_row(now - self.t0, now - self.prev_t, m, self.prev, rss, events, self.live())
            self.rows.append(row)
        self.prev, self.prev_t = m, now
        return row

    async def run(self, stop: asyncio.Event, on_row: Callable[[dict], None] = lambda row: None) -> None:
        await self.sample()
        while not stop.is_set():
            next_t = self.prev_t + self.every_s
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, next_t - time.monotonic()))
            except TimeoutError:
                pass
            if stop.is_set() and time.monotonic() - self.prev_t < self.every_s / 4:
                break  # too short an interval to say anything
            if (row := await self.sample()) is not None:
                on_row(row)
