"""Endpointing with Silero VAD: when the user starts speaking, and when a turn worth a reply is over.

The user's 24 kHz audio is resampled to 16 kHz (soxr) and scored in 512-sample windows (32 ms). Speech starts when a
window's probability reaches `start_threshold`; it stops after `silence_s` of windows under `stop_threshold`.

Flood control (docs/DESIGN.md, "Flood control"): every turn costs a prefill and a reply, so a stretch of sound is a
turn only if it has `min_speech_s` of confident speech and a `confidence` of at least `min_confidence`; a shorter or
fainter one ends with no end of turn (its audio still reached the engine as context). Speech that resumes within
`resume_s` of an end of turn, about as loud as the turn (`RESUME_DB`), continues it: the user only paused, so its
reply is taken back, and the turn ends again later. A `TurnGate` (`server/turn_gate.py`), shared by a server's
connections, then decides whether an ended turn costs a reply now: when the engine is saturated, only turns at or
over `confident` go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import soxr
import torch

if TYPE_CHECKING:
    from server.turn_gate import TurnGate

WINDOW = 512
RATE = 16000
WINDOW_S = WINDOW / RATE
RESUME_WINDOWS = 3  # speech that resumes a turn is the same talker if its first windows with speech ...
RESUME_DB = 10.0  # ... are no more than this under the turn's level


@dataclass
class VadConfig:
    start_threshold: float = 0.5
    stop_threshold: float = 0.35
    silence_s: float = 0.5
    min_speech_s: float = 0.25  # a turn needs this much speech at or over start_threshold
    min_confidence: float = 0.3  # ... and this confidence (`TurnScore.confidence`); less is noise
    confident: float = 0.8  # a turn at or over this passes a saturated engine (`TurnGate`)
    quiet_dbfs: float = -50.0  # confidence's loudness factor is 0 at this speech level ...
    loud_dbfs: float = -28.0  # ... and 1 from this one up (near-field speech: a headset, a browser's gain control)
    resume_s: float = 0.5  # speech again within this of an end of turn continues the turn; its reply is taken back
    max_replies: int = 0  # the engine is saturated with this many replies in flight (0: only its tick time says)
    busy_share: float = 0.75  # ... or when its recent ticks take this share of their frame budget
    gate: TurnGate | None = field(default=None, compare=False, repr=False)  # the server's, set by `ChatServer`

    def check(self) -> None:
        """Raises `ValueError` on settings that cannot work."""
        if not 0 <= self.stop_threshold <= self.start_threshold <= 1 or self.silence_s <= 0:
            raise ValueError(f"bad VAD settings {self}: need 0 <= stop <= start <= 1 and silence_s > 0")
        if min(self.min_speech_s, self.min_confidence, self.confident, self.resume_s, self.max_replies) < 0:
            raise ValueError(f"bad VAD settings {self}: flood control settings must not be negative")
        if self.quiet_dbfs >= self.loud_dbfs or not 0 < self.busy_share:
            raise ValueError(f"bad VAD settings {self}: need quiet_dbfs < loud_dbfs and busy_share > 0")


@dataclass(frozen=True)
class TurnScore:
    """How much a stretch of sound sounds like the user speaking to the server."""

    speech_s: float  # windows at or over start_threshold
    mean_p: float  # mean probability, from its first window to its last speech window
    level_dbfs: float  # RMS level of its speech windows (at or over stop_threshold)
    confidence: float  # mean_p times a loudness factor: babble or a talker across the room is speech, but faint

    def problem(self, cfg: VadConfig) -> str | None:
        """Why it is not a turn ("short", "unsure"), or None."""
        if self.speech_s < cfg.min_speech_s:
            return "short"
        return "unsure" if self.confidence < cfg.min_confidence else None


def _dbfs(mean_square: float) -> float:
    return 10 * math.log10(mean_square + 1e-12)


class _Tally:
    """A turn's sums so far: windows, probabilities, speech energy."""

    def __init__(self) -> None:
        self.windows, self.sure, self.p_sum, self.speech, self.energy = 0, 0, 0.0, 0, 0.0

    def add(self, other: _Tally) -> None:
        for name in ("windows", "sure", "p_sum", "speech", "energy"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def level(self) -> float:
        """dBFS of its speech windows."""
        return _dbfs(self.energy / max(self.speech, 1))

    def score(self, cfg: VadConfig) -> TurnScore:
        loudness = min(1.0, max(0.0, (self.level - cfg.quiet_dbfs) / (cfg.loud_dbfs - cfg.quiet_dbfs)))
        mean_p = self.p_sum / max(self.windows, 1)
        return TurnScore(self.sure * WINDOW_S, mean_p, self.level, mean_p * loudness)


class Endpointer:
    """One per connection (the model keeps state). `push(pcm24k)` returns the events it saw, in order:
    "speech_start" (a barge-in), "take_back" (speech resumed right after an end of turn: that reply is to be
    cancelled unheard), "end_of_turn" (a turn worth a reply now) and "speech_end" (a stretch that is no turn, or
    one the gate dropped). `turn` scores the last stretch that ended."""

    def __init__(self, config: VadConfig | None = None):
        from silero_vad import load_silero_vad  # ships its model: works offline

        self.cfg = config or VadConfig()
        self.cfg.check()
        self.model = load_silero_vad()
        self.buffer = np.zeros(0, dtype=np.float32)
        self.speaking = False
        self.silent_windows = 0
        self.tally, self.tail = _Tally(), _Tally()  # the turn up to its last speech window; the windows after it
        self.since_end: int | None = None  # windows since the last end of turn, while it may still resume
        self.sent = False  # whether that end of turn went to the engine (the gate may have dropped it)
        self.resuming: _Tally | None = None  # that turn, while speech that started soon after it is weighed
        self.turn: TurnScore | None = None

    @torch.inference_mode()
    def push(self, pcm: np.ndarray) -> list[str]:
        audio = soxr.resample(np.asarray(pcm, dtype=np.float32), 24000, RATE).astype(np.float32)
        self.buffer = np.concatenate([self.buffer, audio])
        events = []
        while len(self.buffer) >= WINDOW:
            window, self.buffer = self.buffer[:WINDOW], self.buffer[WINDOW:]
            p = float(self.model(torch.from_numpy(window), RATE))
            events += self._window(p, float(np.mean(np.square(window))))
        return events

    def _window(self, p: float, energy: float) -> list[str]:
        cfg = self.cfg
        if not self.speaking:
            if self.since_end is not None:
                self.since_end += 1
                if self.since_end * WINDOW_S > cfg.resume_s:
                    self.since_end = None
            if p < cfg.start_threshold:
                return []
            self.speaking, self.silent_windows, self.tail = True, 0, _Tally()
            self.resuming = self.tally if self.since_end is not None else None
            self.since_end, self.tally = None, _Tally()
            self._count(p, energy)
            return [] if self.resuming is not None else ["speech_start"]  # a resumption is told once weighed
        self._count(p, energy)
        events = []
        if self.resuming is not None and self.tally.speech >= RESUME_WINDOWS:
            events = self._resume()
        self.silent_windows = self.silent_windows + 1 if p < cfg.stop_threshold else 0
        if self.silent_windows < int(cfg.silence_s / WINDOW_S):
            return events
        if self.resuming is not None:  # it ended before it could be weighed: too late for a barge-in
            events = [e for e in self._resume() if e != "speech_start"]
        return events + self._end()

    def _end(self) -> list[str]:
        """The stretch is over: an end of turn if it is a turn and the gate lets it cost a reply now."""
        self.speaking = False
        self.turn = self.tally.score(self.cfg)
        if (problem := self.turn.problem(self.cfg)) is not None:
            if self.gate is not None:
                self.gate.drop(problem)
            return ["speech_end"]
        self.since_end = 0
        self.sent = self.gate is None or self.gate.admit(self.turn)
        return ["end_of_turn"] if self.sent else ["speech_end"]

    def _resume(self) -> list[str]:
        """Speech started soon after a turn ended: as loud as that turn, it is its talker going on (the turn
        continues, and its reply, if it has one, is taken back); fainter, someone or something else."""
        turn, self.resuming = self.resuming, None
        if self.tally.level < turn.level - RESUME_DB:
            return ["speech_start"]
        turn.add(self.tally)
        self.tally = turn
        if not self.sent:
            return ["speech_start"]
        if self.gate is not None:
            self.gate.took_back()
        return ["take_back"]

    def _count(self, p: float, energy: float) -> None:
        t = self.tail
        t.windows, t.p_sum = t.windows + 1, t.p_sum + p
        if p >= self.cfg.stop_threshold:
            t.speech, t.energy, t.sure = t.speech + 1, t.energy + energy, t.sure + (p >= self.cfg.start_threshold)
            self.tally.add(t)
            self.tail = _Tally()

    @property
    def gate(self) -> TurnGate | None:
        return self.cfg.gate
