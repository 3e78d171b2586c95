"""A training corpus: random sentences in random training voices, augmented with sox, cached as one array.

Half the clips are augmented, each with its own draw: tempo 0.85-1.2, pitch -300..+300 cents, a room (sox reverb)
a third of the time, gain -12..0 dB, and white or brown noise at 15-40 dB SNR a quarter of the time.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import soundfile
from tqdm import tqdm

from codec.pcm import SAMPLE_RATE
from speech.sentences import training_sentences
from speech.voices import TRAIN_VOICES, Voice, say

AUGMENTED = 0.5  # the share of clips augmented


def augment(pcm: np.ndarray, rng: random.Random) -> np.ndarray:
    """One random sox chain (tempo, pitch, maybe a room) then gain and maybe noise, in numpy."""
    effects = ["tempo", f"{rng.uniform(0.85, 1.2):.3f}", "pitch", str(rng.randint(-300, 300))]
    if rng.random() < 1 / 3:
        effects += ["reverb", str(rng.randint(10, 60)), "50", str(rng.randint(20, 100))]
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.wav", Path(tmp) / "out.wav"
        soundfile.write(src, pcm, SAMPLE_RATE, subtype="FLOAT")
        subprocess.run(["sox", str(src), str(dst), *effects], check=True, capture_output=True)
        out, _ = soundfile.read(dst, dtype="float32")
    out = out if out.ndim == 1 else out[:, 0]
    out = out * (0.9 / max(float(np.abs(out).max()), 1e-6)) * 10 ** (rng.uniform(-12, 0) / 20)
    if rng.random() < 1 / 4:
        nrng = np.random.default_rng(rng.getrandbits(32))
        noise = nrng.standard_normal(len(out)).astype(np.float32)
        if rng.random() < 0.5:  # brown: integrated white noise, high-passed by its own mean
            noise = np.cumsum(noise) / 30
            noise -= np.convolve(noise, np.ones(2400) / 2400, mode="same")
        snr_db = rng.uniform(15, 40)
        noise *= np.sqrt(np.mean(out**2) / max(np.mean(noise**2), 1e-12)) * 10 ** (-snr_db / 20)
        out = out + noise
    return np.clip(out, -1, 1).astype(np.float32)


def _clip(args: tuple[str, Voice, int, bool]) -> np.ndarray:
    text, voice, seed, augmented = args
    pcm = say(text, voice)
    return augment(pcm, random.Random(seed)) if augmented else pcm


def build_corpus(folder: Path, minutes: float, seed: int, workers: int = 2) -> tuple[np.ndarray, list[int]]:
    """Speech for about `minutes` in `folder` (audio.npy float16, index.json), made once and then read back.

    Every clip is a training sentence in a training voice (words per minute 120-200); half are augmented.
    Returns the audio and the clips' start offsets.
    """
    folder = Path(folder)
    index_path = folder / "index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        if index["minutes"] >= minutes and index["seed"] == seed and index.get("augmented") == AUGMENTED:
            return np.load(folder / "audio.npy").astype(np.float32), index["starts"]
    rng = random.Random(seed)
    count = int(minutes * 60 / 4) + 1  # a random sentence lasts about 4 s on average
    jobs = []
    for i, text in enumerate(training_sentences(count, seed)):
        base = rng.choice(TRAIN_VOICES)
        voice = Voice(base.engine, base.name, rng.randint(120, 200))
        jobs.append((text, voice, seed * 1_000_003 + i, rng.random() < AUGMENTED))
    with ThreadPoolExecutor(workers) as pool:
        clips = list(tqdm(pool.map(_clip, jobs), total=len(jobs), desc="speech corpus", unit="clip"))
    starts = np.cumsum([0] + [len(c) for c in clips[:-1]]).tolist()
    audio = np.concatenate(clips)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "audio.npy", audio.astype(np.float16))
    minutes_made = len(audio) / SAMPLE_RATE / 60
    index_path.write_text(
        json.dumps(
            {"minutes": minutes_made, "seed": seed, "augmented": AUGMENTED, "starts": starts, "clips": len(clips)}
        )
    )
    return audio, starts
