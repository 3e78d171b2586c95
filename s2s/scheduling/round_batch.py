"""RoundBatch: the one thing the scheduling side hands the runner for a round, the scheduler's work and the duplex
lane's rows together (`LaneRound`); the runner computes its forward and draws its sampling from it whole."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from s2s.engine.session import Session
from s2s.runner.sampling import RandomStream, SamplingParams
from s2s.scheduling.scheduler import Work

Wanted = list[tuple[int, int]]  # (frame, codebook) pairs that sampling a step's logits fills


@dataclass
class LaneRound:
    """What one round's forward computes for the lane: one step of each row in `rows`."""

    index: int  # the round's index in its tick: each row steps from its start step + index
    rows: np.ndarray  # lane rows stepping this round
    tokens: np.ndarray  # [n, 2K] their steps' codes
    cached: np.ndarray  # [n] steps before each in its page table
    table: np.ndarray  # [n, P] int32 page tables (what each attends to)
    lengths: np.ndarray  # [n] pages in each table
    shifts: np.ndarray  # [n] added to positions for RoPE (steps its window left out)
    params: list[SamplingParams]  # each row's sampling settings
    streams: list[RandomStream]  # and random stream
    fill: tuple[np.ndarray, torch.Tensor, np.ndarray | None] | None = None  # wanted [n, K], the last round's codes,
    # and each row's place among that round's rows (None: the same rows)

    def __len__(self) -> int:
        return len(self.rows)

    def fill_into(self, tokens: torch.Tensor, to_device: Callable[[str, np.ndarray], torch.Tensor]) -> None:
        """The last round's sampled codes, still on the device, into these steps' tokens `[n, 2K]` (on the device)
        where they want them (`tokens` holds 0 there); `to_device(name, array)` moves what it needs from the host."""
        if self.fill is not None:
            wanted, codes, places = self.fill
            if places is not None:
                codes = codes[to_device("fill_rows", places)]
            k = codes.shape[1]
            tokens[:, k:] = torch.where(to_device("fill", wanted), codes, tokens[:, k:])


def to_sample(sessions: list[Session], known: list[Wanted | None] | None = None) -> list[tuple[Session, Wanted]]:
    """The sessions whose stored last logits fill something when sampled, with what each fills (`known[i]`: what
    the scheduler found session i's fill, or None: `Session.wanted()`)."""
    return [
        (s, filled)
        for s, found in zip(sessions, known or [None] * len(sessions), strict=True)
        if s.last_logits is not None and (filled := found or s.wanted())
    ]


@dataclass
class RoundBatch:
    """One round: its forward's rows (the scheduler's work, a chunk of steps per session, then the lane's rows, a
    step each) and, once the forward is in (`Rounds.computed`), what its sampling draws: which sessions' logits are
    sampled depends on where their chunks ended."""

    work: list[Work]
    lane: LaneRound | None = None
    sampled: list[tuple[Session, Wanted]] = field(default_factory=list)  # sessions whose last logits are sampled
    lane_logits: torch.Tensor | None = None  # [len(lane), K, V] the lane rows' logits
    computed_at: float = 0.0  # when the forward was in
    keys: int = 0  # the steps of context its forward's decode steps attend to, all together (set by the forward)

    def __len__(self) -> int:
        """Rows of the forward."""
        return len(self.work) + (len(self.lane) if self.lane is not None else 0)

    @property
    def decode_steps(self) -> int:
        """Steps whose logits are sampled by a frame's deadline (the cost model's steps)."""
        return sum(w.decode for w in self.work) + (len(self.lane) if self.lane is not None else 0)

    @property
    def prefill_steps(self) -> int:
        return sum(len(w.tokens) for w in self.work if not w.decode)

    def sampling(self) -> tuple[torch.Tensor | None, list[SamplingParams], list[RandomStream]]:
        """The logits sampling draws from `[S, K, V]` (each sampled session's, then the lane rows'; None: nothing to
        draw), and each row's settings and random stream."""
        logits = [torch.stack([s.last_logits for s, _ in self.sampled])] if self.sampled else []
        params, streams = [s.sampling for s, _ in self.sampled], [s.generator for s, _ in self.sampled]
        if self.lane is not None:
            logits.append(self.lane_logits)
            params, streams = params + self.lane.params, streams + self.lane.streams
        if not logits:
            return None, [], []
        return torch.cat(logits) if len(logits) > 1 else logits[0], params, streams
