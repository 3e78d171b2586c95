"""The audio every part of the server speaks: 24 kHz mono float32 PCM in [-1, 1], in frames of 320 samples (75 a
second). A module of its own so that processes which only move audio (the front ends) need not import the codec."""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 24000
FRAME_SIZE = 320


def checked_audio(pcm: np.ndarray) -> np.ndarray:
    """`pcm` as float32 samples, or a ValueError unless each is finite and in [-1, 1]."""
    pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
    if len(pcm) and not (np.isfinite(pcm).all() and np.abs(pcm).max() <= 1):
        raise ValueError("audio must be finite samples in [-1, 1]")
    return pcm
