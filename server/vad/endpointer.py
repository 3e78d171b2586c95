"""Endpointing with Silero VAD: when the user starts speaking, and when a turn worth a reply is over.

The user's 24 kHz audio is resampled to 16 kHz (soxr, as one stream) and scored in 512-sample windows (32 ms) on the
process's one Silero network (`server/vad/silero.py`), with this endpointer's own state. Speech starts when a
window's probability reaches `start_threshold`; it stops after `silence_s` of windows under `stop_threshold`. New
settings (`configure`) are thresholds and times: they apply from the next window, to the stretch under way too.

Flood control (docs/DESIGN.md, "Flood control"): every turn costs a prefill and a reply, so a stretch of sound is a
turn only if it has `min_speech_s` of confident speech and a `confidence` of at least `min_confidence`; a shorter or
fainter one ends with no end of turn (its audio still reached the engine as context). Speech that resumes within
`resume_s` of an end of turn, about as loud as the turn (`RESUME_DB`), continues it: the user only paused, so its
reply is taken back, and the turn ends again later. A `TurnGate` (`server/vad/turn_gate.py`), shared by a server's
connections, then decides whether an ended turn costs a reply now: when the engine is saturated, only turns at or
over `confident` go.
"""

from __future__ import annotations

import math

import numpy as np
import soxr

from codec.pcm import SAMPLE_RATE
from server.vad.config import Gate, TurnScore, VadConfig
from server.vad.silero import RATE, WINDOW, SileroStream

WINDOW_S = WINDOW / RATE
RESUME_WINDOWS = 3  # speech that resumes a turn is the same talker if its first windows with speech ...
RESUME_DB = 10.0  # ... are no more than this under the turn's level


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
    """One per connection (it keeps its stream's state). `push(pcm24k)` returns the events it saw, in order:
    "speech_start" (a barge-in), "take_back" (speech resumed right after an end of turn: that reply is to be
    cancelled unheard), "end_of_turn" (a turn worth a reply now) and "speech_end" (a stretch that is no turn, or
    one the gate dropped). `turn` scores the last stretch that ended."""

    def __init__(self, config: VadConfig | None = None, gate: Gate | None = None):
        """`gate`: the server's `TurnGate`, which each turn end passes (None: every turn end is sent). The first
        endpointer of a process loads Silero (`server/vad/silero.py`); the others cost two empty tensors."""
        self.gate = gate
        self.configure(config or VadConfig())
        self.silero = SileroStream()
        self.resampler = soxr.ResampleStream(SAMPLE_RATE, RATE, 1, dtype="float32")
        self.buffer = np.zeros(0, dtype=np.float32)
        self.speaking = False
        self.silent_windows = 0
        self.tally, self.tail = _Tally(), _Tally()  # the turn up to its last speech window; the windows after it
        self.since_end: int | None = None  # windows since the last end of turn, while it may still resume
        self.sent = False  # whether that end of turn went to the engine (the gate may have dropped it)
        self.resuming: _Tally | None = None  # that turn, while speech that started soon after it is weighed
        self.turn: TurnScore | None = None

    def configure(self, config: VadConfig) -> None:
        """Settings from the next window on; the stream's state, and the stretch under way, go on."""
        config.check()
        self.cfg = config

    def push(self, pcm: np.ndarray) -> list[str]:
        audio = self.resampler.resample_chunk(np.asarray(pcm, dtype=np.float32))
        self.buffer = np.concatenate([self.buffer, audio])
        events = []
        while len(self.buffer) >= WINDOW:
            window, self.buffer = self.buffer[:WINDOW], self.buffer[WINDOW:]
            events += self._window(self.silero.probability(window), float(np.mean(np.square(window))))
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
