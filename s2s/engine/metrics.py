"""Engine statistics and the tick cost model that admission control calibrates as the engine runs."""

from __future__ import annotations

import bisect
import copy
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from cache import CacheStats
from s2s.engine.session import Session

# Upper bounds (seconds) of the tick time histogram's buckets, as /metrics' `s2s_tick_seconds` shows them; a last
# bucket takes the rest (+Inf). About 1.5x apart from 1 ms to 5 s: p50 and p95 read within a bucket.
TICK_BUCKETS = (0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2)
TICK_BUCKETS += (0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)
SERVICE_TICKS = 64  # service ticks whose ratio to the fit scales admission's prediction (~3.4 s at 4 frames)
RECENT_TICKS = 16  # the ticks whose mean time says how busy the engine is now (the turn gate's): ~0.85 s at 4 frames


class CostModel:
    """tick seconds ~ a + r * rounds + b * decode steps + c * prefill steps + k * keys, least squares over the
    recent ticks but for `key_seconds` (k), which calibration measures.

    A tick runs up to `frames_per_tick` rounds, each one batched forward and sampling over every due conversation.
    On a GPU a small model's round costs its kernel launches whatever the batch, so cost follows rounds, not steps;
    on a CPU it follows steps. Modelling only steps (as this did) read a GPU's per-round cost as a per-step one and
    refused a second conversation that fitted.

    `pin()` keeps the samples so far (the engine's calibration over several batch sizes) in every later fit: a
    window of service ticks often holds one batch size, whose rounds and steps move together, and could not tell a
    round's cost from a step's on its own. What the recent service ticks cost beyond the fit scales the prediction:
    the median of their ratio to it (a server's threads taking the cores and the GIL for its sockets and each
    stream's audio, which calibration cannot see, and which the pinned samples would otherwise dilute), never
    below 1. So admission holds from the first tick on what calibration measured, and from the next ticks on what
    serving costs. (Charged per step instead, a server's per-tick overhead at one stream read as a large cost per
    step, and a second stream was refused at 30 ms ticks of 53.)

    Keys are the steps of context a tick's decode steps attend to, all together (a prefill's attention runs as
    matrix products, a cost of its steps). Reading them grows with a conversation's
    length (on a CPU, memory-bound: 4 conversations of the shipped echo at ~1,100 steps read 10.6 ms of a 53 ms tick),
    so a fit over ticks of short conversations, calibration's, cannot foresee it; and a fit over service ticks sees
    it only once it is there, after admission. So `key_seconds` is measured apart (`calibrate`), taken off each
    sample's time before the fit, and admission charges every stream the keys of a full window: a conversation it
    admits may run that long.

    The engine thread observes; admission predicts from callers' threads: a lock keeps the two apart.
    """

    def __init__(self, window: int = 400):
        self.samples: deque[tuple[int, int, int, int, float]] = deque(maxlen=window)
        self.pinned: list[tuple[int, int, int, int, float]] = []
        self.key_seconds = 0.0  # a step's attention to one key of context, every layer (`set_key_seconds`)
        self._coef: np.ndarray | None = None
        self._service_ratio = 1.0
        self._dirty = False
        self._lock = threading.Lock()

    def set_key_seconds(self, seconds: float) -> None:
        """What a decode step's attention to one key costs (`calibrate` measures it); the fit is made again."""
        with self._lock:
            self.key_seconds = seconds
            self._dirty = True

    def pin(self) -> None:
        with self._lock:
            self.pinned += self.samples
            self.samples.clear()

    def forget_after(self, count: int) -> None:
        """Drop the samples observed since there were `count` (warm-up ticks: first calls at a new shape)."""
        with self._lock:
            while len(self.samples) > count:
                self.samples.pop()
            self._dirty = True

    def observe(self, rounds: int, decode_steps: int, prefill_steps: int, seconds: float, keys: int = 0) -> None:
        if decode_steps or prefill_steps:
            with self._lock:
                self.samples.append((rounds, decode_steps, prefill_steps, keys, seconds))
                self._dirty = True

    def predict(self, rounds: int, decode_steps: int, prefill_steps: int = 0, keys: int = 0) -> float | None:
        """Predicted seconds of a tick, or None before there is data to say."""
        with self._lock:
            if self._dirty:
                self._fit()
            coef, ratio, per_key = self._coef, self._service_ratio, self.key_seconds
        if coef is None:
            return None
        return (float(coef @ np.array([1.0, rounds, decode_steps, prefill_steps])) + per_key * keys) * ratio

    def _fit(self) -> None:
        self._dirty = False
        if not self.samples and not self.pinned:
            return
        s = np.asarray(self.pinned + list(self.samples), dtype=np.float64)
        rest = np.maximum(s[:, 4] - self.key_seconds * s[:, 3], 0.0)  # a tick's time but for reading its keys
        if len(s) < 16 or len(np.unique(s[:, 1])) < 2:
            # little data, or one batch size so far: assume cost proportional to the steps (cautious)
            steps = np.maximum(s[:, 1] + 0.05 * s[:, 2], 1)
            self._coef = np.array([0.0, 0.0, float(np.percentile(rest / steps, 90)), 0.0])
        else:
            x = np.column_stack([np.ones(len(s)), s[:, :3]])
            coef, *_ = np.linalg.lstsq(x, rest, rcond=None)
            self._coef = np.maximum(coef, 0.0)
        self._service_ratio = self._service_ratio_now() if self.pinned else 1.0

    def _service_ratio_now(self) -> float:
        """The recent service ticks' time over the fit's: their median, or, when higher, the median of the ticks
        at the current load (the trailing ticks of the last one's steps, two or more), at least 1. In a burst of
        arrivals the ticks at lighter loads outnumber those at the newest, and a cost that grows faster than the
        fit's (threads contending as streams are added) would be seen only after the next were admitted."""
        recent = np.asarray(list(self.samples)[-SERVICE_TICKS:], dtype=np.float64).reshape(-1, 5)
        recent = recent[recent[:, 1] > 0]
        if not len(recent):
            return 1.0
        fitted = np.column_stack([np.ones(len(recent)), recent[:, :3]]) @ self._coef + self.key_seconds * recent[:, 3]
        ratios = recent[:, 4] / np.maximum(fitted, 1e-9)
        other = np.flatnonzero(recent[:, 1] != recent[-1, 1])
        current = ratios[other[-1] + 1 :] if len(other) else ratios
        now = float(np.median(current)) if len(current) >= 2 else 0.0
        return max(1.0, float(np.median(ratios)), now)


@dataclass
class EngineStats:
    ticks: int = 0
    refused: int = 0
    out_of_pages: int = 0
    preempted: int = 0  # conversations that gave their pages up to another's step (their K/V is recomputed)
    deadline_misses: int = 0
    busy_seconds: float = 0.0  # all ticks' time: its rate over a window is the engine's real-time factor
    prefill_steps: int = 0  # steps computed other than as a sampled decode step (what a prefix cache saves)
    copied_steps: int = 0  # steps whose K/V were copied from a page others hold instead of computed (copy-on-write)
    kv_checks: int = 0  # page integrity checks, run when no conversation is open (`Engine._check_when_idle`)
    kv_check_failures: int = 0
    # ticks by time, in `TICK_BUCKETS` (each bucket's own count, the last one's over them all): its sum is busy_seconds
    tick_buckets: list[int] = field(default_factory=lambda: [0] * (len(TICK_BUCKETS) + 1))
    recent_tick_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_TICKS))  # their times
    # where tick time goes: the codec's encoder and decoder, scheduling, the model (forward and sampling); the
    # rest of busy_seconds is bookkeeping (replies starting and ending, prefix re-matching)
    phase_seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("encode", "schedule", "model", "decode"), 0.0)
    )

    def clear(self) -> None:
        """Back to zero, in place (the engine's parts share this object)."""
        self.__dict__.update(EngineStats().__dict__)

    def copy(self) -> EngineStats:
        """A copy another thread can read while this one goes on counting."""
        out = copy.copy(self)
        out.tick_buckets, out.phase_seconds = list(self.tick_buckets), dict(self.phase_seconds)
        out.recent_tick_seconds = deque(self.recent_tick_seconds, maxlen=RECENT_TICKS)
        return out

    def record_tick(self, seconds: float, prefill_steps: int) -> None:
        self.ticks += 1
        self.busy_seconds += seconds
        self.prefill_steps += prefill_steps
        self.tick_buckets[bisect.bisect_left(TICK_BUCKETS, seconds)] += 1  # (a bucket holds times up to its bound)
        self.recent_tick_seconds.append(seconds)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine as the last tick left it: what readers on other threads (/metrics) see."""

    conversations: int
    cache: CacheStats
    stats: EngineStats
    session_rows: list[tuple]  # each session's `Session.STATS` values: a tuple a tick, dicts only for a reader

    @property
    def sessions(self) -> list[dict]:
        return [dict(zip(Session.STATS, row, strict=True)) for row in self.session_rows]
