"""Rounds: each round's `RoundBatch` (the scheduler's pick, the lane's rows, and pages for both), and what its
forward and its sampling leave in the sessions and the lane."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from s2s.engine.config import EngineConfig
from s2s.engine.session import Session
from s2s.engine.turns import Phase
from s2s.scheduling.duplex_lane import DuplexLane
from s2s.scheduling.kv_manager import KVManager
from s2s.scheduling.round_batch import RoundBatch, to_sample
from s2s.scheduling.scheduler import Scheduler


class Rounds:
    def __init__(self, scheduler: Scheduler, lane: DuplexLane, kv: KVManager, cfg: EngineConfig):
        """`cfg`: the engine's, read where used (its `max_reply_frames` may be changed on a live engine)."""
        self.scheduler, self.lane, self.kv, self.cfg = scheduler, lane, kv, cfg

    def schedule(self, index: int, sessions: Sequence[Session], now: float) -> RoundBatch:
        """Round `index`'s batch (empty when nobody steps): the scheduler's pick among the sessions the lane leaves
        it, and the lane's rows, with pages reserved for both; `sessions`: every live one, in the order they
        opened."""
        lane, scheduler = self.lane, self.scheduler
        schedulable = lane.schedulable(index, lambda rows: self.kv.grow_steps(rows, len(lane.others)))
        work = scheduler.pick(schedulable, now, prefill=index == 0)

        def victim(s: Session, busy: set[str]) -> Session | None:
            """`Scheduler.victim`; one the lane steps gets its steps back first, and steps no more this tick."""
            if (v := scheduler.victim(s, sessions, busy)) is not None:
                lane.give_back(v)
            return v

        work = lane.keep_reserved(self.kv.reserve(work, victim))
        return RoundBatch(work, lane.round(index))

    def computed(self, batch: RoundBatch, logits: torch.Tensor, now: float) -> None:
        """The forward's logits `[len(batch), K, V]` are in: each session's last logits and steps; a prefill chunk's
        pages go into the cache (sessions behind it can share them next tick); and the batch learns what its
        sampling draws."""
        work = batch.work
        for w, row in zip(work, logits[: len(work)].unbind(), strict=True):  # (one call for every row's view)
            s = w.session
            s.last_active, s.last_logits = now, row
            s.advance(len(w.tokens))
            turn = s.turns[-1] if s.turns else None
            if turn is not None and turn.reply_start is not None and s.computed >= turn.reply_start:
                turn.times.setdefault("prefill_done", now)
            if not w.decode:
                self.kv.insert(s, lock=True)
        batch.sampled = to_sample([w.session for w in work], [w.wanted for w in work])
        batch.lane_logits, batch.computed_at = logits[len(work) :], now

    def accept(self, batch: RoundBatch, codes: torch.Tensor | None, now: float) -> None:
        """The sampled codes `[S, K]` (`RoundBatch.sampling`'s rows; None: it drew none) fill what each row wanted:
        the lane's, left on the device, and each sampled session's; a reply ends where its frames run out."""
        if codes is None:
            return
        n = len(batch.sampled)
        if batch.lane is not None:
            self.lane.accept(batch.lane, codes[n:], batch.lane_logits, batch.computed_at)
        if n:
            codes = codes[:n].cpu().numpy()
        for (s, filled), c in zip(batch.sampled, codes[:n], strict=True):
            s.accept(c, filled)
            if s.phase is Phase.REPLY:
                s.turns[-1].times.setdefault("first_step", now)
                s.end_reply_at(filled, self.cfg.max_reply_frames)

    def end_tick(self) -> None:
        """The lane's rows give their steps back to their sessions; the scheduler forgets the ones that met a step
        not known (as `Scheduler.pick` forgets one with nothing to compute)."""
        self.lane.give_back_all()
        for s in self.lane.stalled:
            self.scheduler.forget(s.id)
