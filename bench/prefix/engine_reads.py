"""What the prefix bench reads of an `Engine` beyond its calls and `engine.stats`: kept here, in one place, so that a
rename inside the engine (`sessions`, `pool`) is one edit."""

from __future__ import annotations

from dataclasses import dataclass

from cache import CacheStats
from s2s.engine.engine import Engine


def session_ids(engine: Engine) -> list[str]:
    """The open conversations' ids, copied (the caller may close some while it goes through them)."""
    return list(engine.sessions)


def prefill_pending(engine: Engine, cid: str) -> bool:
    """Whether conversation `cid` has known steps its K/V does not hold yet (or is not taken in by a tick yet)."""
    s = engine.sessions.get(cid)
    return s is None or len(s.ready_steps(1)) > 0


def pages_held(engine: Engine) -> int:
    """K/V pages live conversations hold now (their own and the cached ones they lock)."""
    s = engine.cache.stats()
    return s.private + s.cached_locked


def bytes_per_page(engine: Engine) -> int:
    return engine.pool.bytes_per_page


@dataclass
class EngineCounters:
    """An engine's counters at the end of a run, kept after the engine (and its K/V pool) is let go."""

    compute_s: float
    cache: CacheStats
    deadline_misses: int
    out_of_pages: int
    prefill_steps: int
    bytes_per_page: int
    num_pages: int


def counters(engine: Engine) -> EngineCounters:
    return EngineCounters(
        engine.stats.busy_seconds,  # every tick's time
        engine.cache.stats(),
        engine.stats.deadline_misses,
        engine.stats.out_of_pages,
        engine.stats.prefill_steps,
        bytes_per_page(engine),
        engine.pool.num_usable,
    )
