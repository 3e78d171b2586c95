"""The endpointer offline, faster than real time: its turn ends over noise with the user's sentences in it.

A `Track` is `seconds` of one noise kind (`bench/noise.py`) with one of the bench's sentences (espeak-ng, at the
user's level) every `every_s` seconds or so. `endpoint(track, cfg)` runs `server/vad/endpointer.py`'s `Endpointer`
over it in 80 ms blocks, as the server does, and returns its `Timeline`: every event, each end of turn labelled real
(its turn overlaps a sentence) or spurious, and what flood control dropped. `spurious_row` makes one row of the
"turns per session-hour" table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bench.common import SENTENCES, percentiles
from bench.noise import noise, user_speech
from codec.pcm import SAMPLE_RATE
from server.moshi.protocol import BLOCK
from server.vad.config import TurnScore, VadConfig
from server.vad.endpointer import Endpointer

BLOCK_S = BLOCK / SAMPLE_RATE
PLAIN = VadConfig(min_speech_s=0, min_confidence=0, resume_s=0)  # the endpointer before flood control


@dataclass
class Track:
    kind: str
    pcm: np.ndarray
    sentences: list[tuple[float, float]]  # when the user speaks: (start, end) in seconds

    @property
    def seconds(self) -> float:
        return len(self.pcm) / SAMPLE_RATE

    def noise_hours(self) -> float:
        return (self.seconds - sum(b - a for a, b in self.sentences)) / 3600


def track(kind: str, seconds: float, every_s: float, seed: int = 0) -> Track:
    """`kind` noise with a user sentence every `every_s` +- 25 % seconds (none in the first and last 5 s)."""
    rng = np.random.default_rng(seed)
    pcm = noise(kind, seconds, seed).copy()
    clips = [user_speech(text) for text in SENTENCES]
    sentences, at = [], rng.uniform(5, 5 + every_s)
    while at + 10 < seconds:
        clip = clips[int(rng.integers(len(clips)))]
        a = int(at * SAMPLE_RATE)
        pcm[a : a + len(clip)] += clip
        sentences.append((at, at + len(clip) / SAMPLE_RATE))
        at += len(clip) / SAMPLE_RATE + every_s * rng.uniform(0.75, 1.25)
    return Track(kind, np.clip(pcm, -1, 1), sentences)


@dataclass(frozen=True)
class VadEvent:
    t: float  # seconds into the track: the end of the block in which the endpointer said it
    kind: str  # "speech_start", "take_back", "end_of_turn", "speech_end"
    turn: TurnScore | None = None  # an end of turn's
    real: bool = False  # an end of turn whose turn overlaps a user sentence
    speech_end: float = 0.0  # a real one's: when the sentence ended

    @property
    def confidence(self) -> float:
        return self.turn.confidence if self.turn else 0.0


@dataclass
class Timeline:
    events: list[VadEvent]
    dropped: dict[str, int] = field(default_factory=dict)  # stretches that were no turn, by reason
    speaking_s: float = 0.0  # time the endpointer held speech outside the user's sentences


class _Recorder:
    """Stands in for a server's `TurnGate` offline: every turn passes; what the endpointer drops is counted."""

    def __init__(self) -> None:
        self.dropped: dict[str, int] = {}

    def admit(self, turn: TurnScore) -> bool:
        return True

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def took_back(self) -> None:
        pass


def endpoint(tr: Track, cfg: VadConfig) -> Timeline:
    recorder = _Recorder()
    vad = Endpointer(cfg, recorder)
    spans = np.array(tr.sentences).reshape(-1, 2)
    events, started, speaking = [], 0.0, 0
    for a in range(0, len(tr.pcm) - BLOCK + 1, BLOCK):
        t = (a + BLOCK) / SAMPLE_RATE
        for kind in vad.push(tr.pcm[a : a + BLOCK]):
            if kind == "speech_start":
                started = t - BLOCK_S
            if kind != "end_of_turn":
                events.append(VadEvent(t, kind))
                continue
            hit = np.flatnonzero((spans[:, 0] < t) & (spans[:, 1] > started))
            end = float(spans[hit[-1], 1]) if len(hit) else 0.0
            events.append(VadEvent(t, kind, vad.turn, bool(len(hit)), end))
        inside = ((spans[:, 0] <= t) & (spans[:, 1] + cfg.silence_s >= t)).any()
        speaking += vad.speaking and not inside
    return Timeline(events, recorder.dropped, speaking * BLOCK_S)


def spurious_row(tr: Track, plain: Timeline, control: Timeline, cfg: VadConfig) -> dict:
    """Turns a session-hour of noise, before and with flood control, and what becomes of the user's sentences."""
    hours = tr.noise_hours()

    def per_hour(timeline: Timeline, keep=lambda e: True) -> float:
        ends = [e for e in timeline.events if e.kind == "end_of_turn" and not e.real and keep(e)]
        return len(ends) / hours

    def real(timeline: Timeline) -> tuple[float, dict]:
        """Share of sentences that got an end of turn, and the delay of each one's last (after any take-back)."""
        last: dict[float, float] = {}
        for e in timeline.events:
            if e.kind == "end_of_turn" and e.real:
                last[e.speech_end] = e.t
        delays = [t - end for end, t in last.items()]
        pct = percentiles(delays, 1000) if delays else {"p50": float("nan"), "p95": float("nan")}
        return len(last) / max(len(tr.sentences), 1), pct

    found_plain, delay_plain = real(plain)
    found_control, delay_control = real(control)
    confident = [e for e in control.events if e.kind == "end_of_turn" and e.real and e.confidence >= cfg.confident]
    take_backs = sum(e.kind == "take_back" for e in control.events)
    return {
        "noise": tr.kind,
        "noise_s": round(hours * 3600, 1),
        "speech_time_pct": 100 * plain.speaking_s / (hours * 3600),
        "turns_per_h_plain": per_hour(plain),
        "turns_per_h_control": per_hour(control),
        "confident_per_h_control": per_hour(control, lambda e: e.confidence >= cfg.confident),
        "short_per_h": control.dropped.get("short", 0) / hours,
        "unsure_per_h": control.dropped.get("unsure", 0) / hours,
        "take_backs_per_h": take_backs / hours,
        "sentences": len(tr.sentences),
        "real_found_pct_plain": 100 * found_plain,
        "real_found_pct_control": 100 * found_control,
        "real_confident_pct": 100 * len({e.speech_end for e in confident}) / max(len(tr.sentences), 1),
        "end_delay_ms_p50_plain": delay_plain["p50"],
        "end_delay_ms_p50_control": delay_control["p50"],
        "end_delay_ms_p95_plain": delay_plain["p95"],
        "end_delay_ms_p95_control": delay_control["p95"],
    }
