"""Endpointing's settings (`VadConfig`), what it makes of a stretch of sound (`TurnScore`), and what it asks of the
server's turn gate (`Gate`): plain data, read by the endpointer, the gate, the protocols and the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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


class Gate(Protocol):
    """Where an endpointer's turn ends go (`server/vad/turn_gate.py`'s `TurnGate`, one per server)."""

    def admit(self, turn: TurnScore) -> bool:
        """Whether `turn`'s end costs a reply now."""

    def drop(self, reason: str) -> None:
        """A stretch that is no turn (`TurnScore.problem`)."""

    def took_back(self) -> None:
        """Speech resumed right after a turn's end: its reply is cancelled unheard."""
