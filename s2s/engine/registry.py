"""Registry: the callers' side of the engine. Which sessions are open, their codec rows, and admission. Any thread:
the maps change under one lock that no tick holds (a session's `input_kind` is set once, by its first push, before
the engine sees any of its input). What closed ones keep for a resume is `Resumable`'s."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from s2s.engine.commands import not_open
from s2s.engine.metrics import EngineStats
from s2s.engine.session import Session
from s2s.models.config import ModelConfig
from s2s.runner.sampling import SamplingParams
from s2s.scheduling.context import ContextBound
from s2s.scheduling.scheduler import Admission


class Refused(RuntimeError):
    """The engine cannot take this conversation now (full, or it would make admitted ones miss deadlines)."""


class Registry:
    def __init__(
        self,
        model_config: ModelConfig,
        admission: Admission,
        bound: ContextBound,
        rows: int,
        frame_size: int,
        stats: EngineStats,
        clock: Callable[[], float],
    ):
        """`frame_size`: samples a frame of the sessions' audio events."""
        self.model_config, self.admission, self.stats, self.clock = model_config, admission, stats, clock
        self.bound, self.frame_size = bound, frame_size
        self._lock = threading.Lock()
        self._open: dict[str, Session] = {}
        self._free_rows = list(range(rows - 1, -1, -1))
        self._ids = itertools.count()

    def admit(self, mode: str, sampling: SamplingParams, session_id: str | None, admit: bool) -> Session:
        """A new session with a codec row, or `Refused` with the reason (`admit=False`: no cost check)."""
        if mode not in ("duplex", "turn"):
            raise ValueError(f"mode must be duplex or turn, got {mode!r}")
        with self._lock:
            if session_id in self._open:
                raise ValueError(f"session {session_id!r} is already open")
            if reason := self._problem(admit):
                self.stats.refused += 1
                raise Refused(reason)
            cid = session_id or f"s{next(self._ids)}"
            row, now = self._free_rows[-1], self.clock()
            s = Session(cid, mode, self.model_config, sampling, row, now, self.frame_size, self.bound)
            self._free_rows.pop()  # taken only once nothing more can fail
            self._open[cid] = s
            return s

    def problem(self, count: bool) -> str | None:
        """Why `admit` would refuse a session now, or None. `count`: a refusal made on this answer (a server's,
        before it accepts a connection) counts in `stats.refused`, as `admit`'s own do."""
        with self._lock:
            reason = self._problem(admit=True)
            if reason and count:
                self.stats.refused += 1
            return reason

    def _problem(self, admit: bool) -> str | None:
        now = self.clock()
        streams = [s for s in self._open.values() if s.streaming(now)]
        keys = sum(self.bound.most_seen(s.sink) for s in streams)  # (a voice prompt's sink is seen too)
        reason = self.admission.problem(len(self._open), len(streams), keys) if admit else None
        if reason is None and not self._free_rows:
            reason = f"the engine holds its maximum of {len(self._open)} conversations (one a codec row)"
        return reason

    def get(self, cid: str) -> Session:
        s = self._open.get(cid)
        if s is None:
            raise not_open(cid)
        return s

    def fed(self, cid: str, kind: str) -> Session:
        """The session, which is fed `kind` (audio or codes, fixed by its first push)."""
        s = self.get(cid)
        if s.input_kind is None:
            s.input_kind = kind
        if s.input_kind != kind:
            raise ValueError(f"session {cid!r} is fed {s.input_kind}, not {kind}")
        return s

    def close(self, cid: str, then: Callable[[Session], None] | None = None) -> Session:
        """The session leaves; its row is free for the next. `then(session)` runs before the row is free, under the
        lock (the engine queues its close there: an open on another thread that takes the row queues its own after
        it, so the engine never opens a session on a row still held)."""
        with self._lock:
            s = self.get(cid)
            del self._open[cid]
            if then is not None:
                then(s)
            self._free_rows.append(s.row)
            return s
