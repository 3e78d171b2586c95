"""TurnGate: one per server, shared by its connections; whether a turn the endpointer ended costs a reply now.

Each connection's false turns are rare, but a server holds hundreds: their replies in flight add up and delay every
real turn's first audio. So when the engine is saturated (its recent ticks fill `busy_share` of their frame budget,
or `max_replies` replies are in flight), only confident turns (`VadConfig.confident`) are answered; the others are
dropped, their audio kept as context, and counted. Both signals come from the engine's `snapshot()` (a tick old),
plus the turns passed since it. A conversation alone in the engine is never gated: its replies delay nobody else's,
and on a slow machine its own listening fills the ticks. A client's own end-of-turn message is not gated: the user
said they were done.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from server.vad.config import TurnScore, VadConfig

if TYPE_CHECKING:
    from s2s import Engine, EngineSnapshot

REASONS = ("short", "unsure", "saturated")  # short, unsure: the endpointer's (`TurnScore.problem`)


class TurnGate:
    def __init__(self, engine: Engine, cfg: VadConfig, registry: CollectorRegistry | None = None):
        """`registry`: where its counters are kept (prometheus-client's multiprocess mode sums them over a
        server's front ends)."""
        self.engine, self.cfg, self.registry = engine, cfg, registry or CollectorRegistry()
        self._passed = Counter("s2s_turns_passed", "turn ends the VAD sent to the engine", registry=self.registry)
        self._dropped = Counter(
            "s2s_turns_dropped",
            "turn ends the VAD did not send: short, unsure, or saturated",
            ["reason"],
            registry=self.registry,
        )
        for reason in REASONS:
            self._dropped.labels(reason)  # each is exported from 0
        self._taken_back = Counter("s2s_turns_taken_back", "replies cancelled: speech resumed", registry=self.registry)
        self._lock = threading.Lock()  # endpointers run in worker threads
        self._ticks, self._since = -1, 0  # the last snapshot's tick count, and turns passed since that snapshot

    @property
    def passed(self) -> int:
        """Turn ends this process's gate let through."""
        return int(self.registry.get_sample_value("s2s_turns_passed_total"))

    @property
    def taken_back(self) -> int:
        return int(self.registry.get_sample_value("s2s_turns_taken_back_total"))

    @property
    def dropped(self) -> collections.Counter[str]:
        """Turn ends dropped, by reason (those with none left out)."""
        counts = {r: int(self.registry.get_sample_value("s2s_turns_dropped_total", {"reason": r})) for r in REASONS}
        return collections.Counter({r: n for r, n in counts.items() if n})

    def admit(self, turn: TurnScore) -> bool:
        """Whether `turn`'s end goes to the engine; a dropped one is counted."""
        with self._lock:
            snapshot = self.engine.snapshot()
            if snapshot.stats.ticks != self._ticks:
                self._ticks, self._since = snapshot.stats.ticks, 0
            if turn.confidence < self.cfg.confident and self.saturated(snapshot):
                self._dropped.labels("saturated").inc()
                return False
            self._passed.inc()
            self._since += 1
            return True

    def saturated(self, snapshot: EngineSnapshot) -> bool:
        """Whether another reply would cost other conversations theirs: never with one conversation (the one asking
        is among the snapshot's)."""
        if len(snapshot.sessions) <= 1:
            return False
        replies = self._since + sum(s["phase"] == "reply" for s in snapshot.sessions)
        if self.cfg.max_replies and replies >= self.cfg.max_replies:
            return True
        recent = snapshot.stats.recent_tick_seconds  # (the engine's last `RECENT_TICKS`)
        return bool(recent) and sum(recent) / len(recent) >= self.cfg.busy_share * self.engine.cfg.tick_s

    def drop(self, reason: str) -> None:
        """The endpointer ended a stretch that is no turn (`TurnScore.problem`)."""
        self._dropped.labels(reason).inc()

    def took_back(self) -> None:
        """Speech resumed right after a turn's end: its reply is cancelled unheard."""
        self._taken_back.inc()
