"""Text-to-speech voices on this machine (Debian packages), each rendered as mono float32 PCM at 24 kHz.

The training voices and the held-out voices never overlap: the oracle speaks only voices no codec or model saw.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile
import soxr

from codec.pcm import SAMPLE_RATE as RATE  # (under the name s2s/training/train_echo.py imports)


@dataclass(frozen=True)
class Voice:
    engine: str  # "espeak", "flite" or "festival"
    name: str  # espeak-ng's voice+variant, flite's voice, festival's voice function
    words_per_minute: int = 150

    def __str__(self) -> str:
        return f"{self.engine}:{self.name}@{self.words_per_minute}"

    def command(self, text: str, out: Path) -> list[str]:
        if self.engine == "espeak":
            return ["espeak-ng", "-v", self.name, "-s", str(self.words_per_minute), "-w", str(out), text]
        if self.engine == "flite":
            return [
                "flite",
                "-voice",
                self.name,
                "--setf",
                f"duration_stretch={150 / self.words_per_minute:.3f}",
                "-t",
                text,
                "-o",
                str(out),
            ]
        if self.engine == "festival":
            stretch = f"(Parameter.set 'Duration_Stretch {150 / self.words_per_minute:.3f})"
            return ["text2wave", "-eval", f"({self.name})", "-eval", stretch, "-o", str(out)]
        raise ValueError(f"unknown speech engine {self.engine!r}")

    @property
    def program(self) -> str:
        return {"espeak": "espeak-ng", "flite": "flite", "festival": "text2wave"}[self.engine]


def say(text: str, voice: Voice) -> np.ndarray:
    """`text` spoken by `voice`: mono float32 PCM at 24 kHz, peak-normalised to 0.9 (engines differ by 20 dB)."""
    if shutil.which(voice.program) is None:
        raise RuntimeError(f"{voice.program} is not installed: scripts/setup.sh installs the speech engines")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "say.wav"
        stdin = text if voice.engine == "festival" else None
        subprocess.run(voice.command(text, out), input=stdin, text=True, check=True, capture_output=True)
        pcm, rate = soundfile.read(out, dtype="float32", always_2d=True)
    pcm = soxr.resample(pcm[:, 0], rate, RATE) if rate != RATE else pcm[:, 0]
    peak = float(np.abs(pcm).max()) if len(pcm) else 0.0
    return (pcm * (0.9 / peak) if peak > 0 else pcm).astype(np.float32)


_ESPEAK_TRAIN_VARIANTS = [
    "m1",
    "m2",
    "m3",
    "m4",
    "m5",
    "m6",
    "m7",
    "f1",
    "f2",
    "f4",
    "klatt",
    "klatt2",
    "klatt4",
    "Alex",
    "Andy",
    "Annie",
    "Denis",
    "Linda",
    "Steph",
    "Mike",
    "Robert",
    "Zac",
    "croak",
]
_ESPEAK_TRAIN_ACCENTS = ["en-us", "en", "en-gb-x-rp", "en-gb-scotland", "en-029", "en-gb-x-gbclan"]

TRAIN_VOICES: list[Voice] = (
    [Voice("espeak", f"{accent}+{variant}") for accent in _ESPEAK_TRAIN_ACCENTS for variant in _ESPEAK_TRAIN_VARIANTS]
    + [Voice("flite", name) for name in ("awb", "rms", "slt", "kal")]
    + [Voice("festival", "voice_cmu_us_slt_arctic_hts")]
)
"""Voices the codec and the echo model learn from (augmented with sox: speed, pitch, gain, noise, room)."""

HELDOUT_VOICES: list[Voice] = [Voice("espeak", "en-us+f3", 130), Voice("espeak", "en-us+f5", 130)]
"""The oracle's voices: female espeak-ng variants at 130 words a minute (pocketsphinx hears those best), never
used in training."""
