"""Endpointing with Silero VAD: when the user starts speaking and when their turn is over.

The user's 24 kHz audio is resampled to 16 kHz (soxr) and scored in 512-sample windows (32 ms). Speech starts when a
window's probability reaches `start_threshold`; the turn ends after `silence_s` of windows under `stop_threshold`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import soxr
import torch

WINDOW = 512
RATE = 16000


@dataclass
class VadConfig:
    start_threshold: float = 0.5
    stop_threshold: float = 0.35
    silence_s: float = 0.5


class Endpointer:
    """One per connection (the model keeps state). `push(pcm24k)` returns the events it saw: "speech_start",
    "end_of_turn"."""

    def __init__(self, config: VadConfig | None = None):
        from silero_vad import load_silero_vad  # ships its model: works offline

        self.cfg = config or VadConfig()
        if not 0 <= self.cfg.stop_threshold <= self.cfg.start_threshold <= 1 or self.cfg.silence_s <= 0:
            raise ValueError(f"bad VAD settings {self.cfg}: need 0 <= stop <= start <= 1 and silence_s > 0")
        self.model = load_silero_vad()
        self.buffer = np.zeros(0, dtype=np.float32)
        self.speaking = False
        self.silent_windows = 0

    @torch.inference_mode()
    def push(self, pcm: np.ndarray) -> list[str]:
        audio = soxr.resample(np.asarray(pcm, dtype=np.float32), 24000, RATE).astype(np.float32)
        self.buffer = np.concatenate([self.buffer, audio])
        events = []
        needed = int(self.cfg.silence_s * RATE / WINDOW)
        while len(self.buffer) >= WINDOW:
            window, self.buffer = self.buffer[:WINDOW], self.buffer[WINDOW:]
            p = float(self.model(torch.from_numpy(window), RATE))
            if not self.speaking and p >= self.cfg.start_threshold:
                self.speaking, self.silent_windows = True, 0
                events.append("speech_start")
            elif self.speaking:
                self.silent_windows = self.silent_windows + 1 if p < self.cfg.stop_threshold else 0
                if self.silent_windows >= needed:
                    self.speaking = False
                    events.append("end_of_turn")
        return events
