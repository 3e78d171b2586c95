"""The audio every part of the server speaks: 24 kHz mono float32 PCM in [-1, 1], its 16-bit form (pcm16, on the
wire), and audio files read (any rate, resampled with soxr) and written. A module of its own so that processes which
only move audio (the front ends) need not import the codec.

How many samples make a frame is the codec's (`frame_size`: EnCodec's 320, Mimi's 1920), which an engine takes from
its tokenizer (`EngineConfig.frame_size`), not from here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

SAMPLE_RATE = 24000


def checked_audio(pcm: np.ndarray) -> np.ndarray:
    """`pcm` as float32 samples, or a ValueError unless each is finite and in [-1, 1]."""
    pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
    if len(pcm) and not (np.isfinite(pcm).all() and np.abs(pcm).max() <= 1):
        raise ValueError("audio must be finite samples in [-1, 1]")
    return pcm


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


def to_pcm16(pcm: np.ndarray) -> bytes:
    """Float PCM -> little-endian 16-bit samples: clipped to [-1, 1], scaled by 32767, truncated toward zero."""
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


def from_pcm16(data: bytes) -> np.ndarray:
    """Little-endian 16-bit samples -> float32 PCM in [-1, 1), scaled by 1/32768."""
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768


def save_wav(path: str | Path, pcm: np.ndarray) -> None:
    sf.write(str(path), np.asarray(pcm, dtype=np.float32), SAMPLE_RATE, subtype="PCM_16")
