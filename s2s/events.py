"""What the engine hands its callers: a conversation's events, in a queue an asyncio reader can wait on."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class AudioEvent:
    session: str
    turn: int
    first_frame: int
    pcm: np.ndarray  # float32, 24 kHz
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class CodesEvent:
    """Model frames `[K, n]` from `first_frame` on, as sampled ids (codec-free engines emit these instead of PCM)."""

    session: str
    turn: int
    first_frame: int
    codes: np.ndarray
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class MetaEvent:
    session: str
    turn: int
    data: dict


class EventQueue(queue.Queue):
    """A conversation's events, ended by None. An asyncio reader sets `on_put` to wake itself instead of polling."""

    on_put: Callable[[], None] | None = None

    def _put(self, item) -> None:
        super()._put(item)
        if self.on_put is not None:
            self.on_put()

    def drop_turn_audio(self, turn: int) -> None:
        """Take a cancelled turn's audio the reader has not read yet out of the queue; keep everything else."""
        with self.mutex:
            kept = [e for e in self.queue if not (isinstance(e, AudioEvent | CodesEvent) and e.turn == turn)]
            self.queue.clear()
            self.queue.extend(kept)
