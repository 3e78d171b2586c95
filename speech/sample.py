"""Real speech without a microphone: espeak-ng when it is installed, else a short espeak-ng sample kept in the repo."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from codec.pcm import load_wav

SAMPLE_PATH = Path(__file__).parent / "data" / "speech.wav"
SAMPLE_TEXT = "Hello there. This is a test of the speech codec."


def have_espeak() -> bool:
    return shutil.which("espeak-ng") is not None


def synthesize(text: str, voice: str = "en-us", words_per_minute: int = 150) -> np.ndarray:
    """Speak `text` with espeak-ng; return mono float32 PCM at 24 kHz."""
    if not have_espeak():
        raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run(
            ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(wav), text],
            check=True,
            capture_output=True,
        )
        return load_wav(wav)


def speech(text: str = SAMPLE_TEXT) -> tuple[np.ndarray, str]:
    """Speech for `text` and where it came from; falls back to the kept sample when espeak-ng is absent."""
    if have_espeak():
        return synthesize(text), "espeak-ng"
    return load_wav(SAMPLE_PATH), f"{SAMPLE_PATH.name} (espeak-ng not installed; text: {SAMPLE_TEXT!r})"
