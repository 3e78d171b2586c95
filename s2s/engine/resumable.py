"""Resumable: the contexts of closed conversations that a caller asked to keep (`close(cid, keep=True)`), so that
`open(session_id=cid, resume=True)` can reopen them. Memory that depends on what can still be resumed, not on how
many conversations have closed: at most `max_count` of them and `max_bytes` of their arrays, the oldest going first,
each for `ttl_s` after its close (dropped on the clock, by the engine's tick, whether or not anything opens).

Any thread, under one lock. The caller's close holds the place at once (`put(cid)`, no context yet), so an
`open(resume=True)` right after it is admitted; the engine thread, applying the close in its turn, puts the context
there (`put(cid, context, nbytes)`), and applying that open's `Open`, takes it (`take`). Commands are applied in the
order of the calls, so the open finds what its close put."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Kept:
    at: float  # when it was put
    context: dict | None
    nbytes: int


class Resumable:
    def __init__(self, max_count: int, max_bytes: int, ttl_s: float, clock: Callable[[], float]):
        self.max_count, self.max_bytes, self.ttl_s, self.clock = max_count, max_bytes, ttl_s, clock
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # oldest first
        self.nbytes = 0  # of the contexts kept

    def __contains__(self, cid: str) -> bool:
        with self._lock:
            self._expire()
            return cid in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, cid: str, context: dict | None = None, nbytes: int = 0) -> None:
        """Keep `context` (`nbytes`: its arrays) for a resume of `cid`, in place of what was kept for it; None holds
        the place for the context the engine thread has yet to put. Past the bounds, the oldest go (this one too,
        alone over `max_bytes`)."""
        with self._lock:
            self._drop(cid)
            self._kept[cid] = _Kept(self.clock(), context, nbytes)
            self.nbytes += nbytes
            while self._kept and (len(self._kept) > self.max_count or self.nbytes > self.max_bytes):
                self._drop(next(iter(self._kept)))

    def take(self, cid: str) -> dict | None:
        """What was kept for `cid`, no longer kept (None: nothing, or only its place)."""
        with self._lock:
            kept = self._drop(cid)
            return kept.context if kept is not None else None

    def expire(self) -> None:
        """Drop what was kept longer than `ttl_s` (the engine's tick: a look at the oldest when nothing is due)."""
        if self._kept:
            with self._lock:
                self._expire()

    def _expire(self) -> None:
        too_old = self.clock() - self.ttl_s
        while self._kept and (oldest := next(iter(self._kept.items())))[1].at < too_old:
            self._drop(oldest[0])

    def _drop(self, cid: str) -> _Kept | None:
        kept = self._kept.pop(cid, None)
        if kept is not None:
            self.nbytes -= kept.nbytes
        return kept
