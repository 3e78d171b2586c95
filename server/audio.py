"""PCM helpers at the server's edge: read, resample (soxr) and write mono audio."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

SAMPLE_RATE = 24000


def to_mono_24k(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """Any-rate PCM, mono `[T]` or multichannel `[T, C]` -> mono float32 at 24 kHz, clipped to [-1, 1]."""
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim == 2:
        x = x.mean(axis=1)
    if x.ndim != 1:
        raise ValueError(f"audio must be [T] or [T, channels], got shape {x.shape}")
    if sample_rate != SAMPLE_RATE:
        x = soxr.resample(x, sample_rate, SAMPLE_RATE).astype(np.float32)
    return np.clip(x, -1.0, 1.0)


def load_wav(path: str | Path) -> np.ndarray:
    """Read an audio file soundfile understands and return mono float32 PCM at 24 kHz."""
    data, rate = sf.read(str(path), dtype="float32", always_2d=False)
    return to_mono_24k(data, rate)


def save_wav(path: str | Path, pcm: np.ndarray) -> None:
    sf.write(str(path), np.asarray(pcm, dtype=np.float32), SAMPLE_RATE, subtype="PCM_16")
