"""Sound that is not speech directed at the server, made at run time (never fetched): what a turn-mode endpointer
hears between its user's turns. Each `noise(kind, seconds, seed)` is float32 PCM at 24 kHz, cached as .npy under
the temp dir as 16-bit PCM (babble and the far speaker call espeak-ng and flite for every clip).

Levels are RMS dBFS over the whole track; the user's own speech (`user_speech`) is -20 dBFS while it speaks, so the
background sits 13 to 20 dB under it, as a headset or a phone in a room hears it:
- `babble`: three talkers (espeak-ng and flite voices) saying random sentences, each pausing 0.2 to 2 s, -35 dBFS;
- `street`: brown noise, cars passing (swells of filtered noise) and horns, -33 dBFS;
- `pink`: steady pink noise (sox), -38 dBFS;
- `music`: chords and a vibrato melody (additive synthesis) at changing tempo and key, -32 dBFS;
- `far_speaker`: one talker across the room: low-passed, reverberated (sox), -36 dBFS.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

from codec.pcm import SAMPLE_RATE, from_pcm16, load_wav, to_pcm16
from speech.sample import synthesize

KINDS = ("babble", "street", "pink", "music", "far_speaker")
LEVELS_DBFS = {"babble": -35.0, "street": -33.0, "pink": -38.0, "music": -32.0, "far_speaker": -36.0}
USER_DBFS = -20.0
CACHE = Path(tempfile.gettempdir()) / "s2s-noise"
VOICES = [("espeak-ng", v) for v in ("en-us", "en-gb", "en-gb-scotland", "en-029", "en-us+f3", "en-gb+f4")]
VOICES += [("flite", v) for v in ("awb", "rms", "slt", "kal")]
WORDS = (
    "the a my your this that we they you it is was will can could should would have had do did not never always "
    "really just maybe still there here today tomorrow yesterday morning evening night week year time people "
    "friend family work home city train bus car coffee dinner lunch meeting phone money weather music game story "
    "book table door street market doctor school children window garden house office store price ticket "
    "go come see know think want need like tell ask call find make take give bring leave start stop finish wait "
    "good bad big small new old long short early late next last first little great happy busy quiet cold warm"
).split()


def noise(kind: str, seconds: float, seed: int = 0) -> np.ndarray:
    """`seconds` of `kind` (one of `KINDS`), the same for the same arguments (cached)."""
    if kind not in KINDS:
        raise ValueError(f"unknown noise {kind!r}; choose from {KINDS}")
    path = CACHE / f"{kind}-{seconds:g}s-{seed}.pcm16"
    if path.exists():
        return from_pcm16(path.read_bytes())
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    n = int(seconds * SAMPLE_RATE)
    x = {"babble": _babble, "street": _street, "pink": _pink, "music": _music, "far_speaker": _far}[kind](n, rng)
    pcm16 = to_pcm16(at_level(x[:n], LEVELS_DBFS[kind]))
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pcm16)
    return from_pcm16(pcm16)


def at_level(x: np.ndarray, dbfs: float) -> np.ndarray:
    """`x` scaled to an RMS of `dbfs`, clipped to [-1, 1]."""
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) or 1.0
    return np.clip(x * (10 ** (dbfs / 20) / rms), -1, 1).astype(np.float32)


def user_speech(text: str) -> np.ndarray:
    """The user's turn: espeak-ng's default voice at `USER_DBFS`."""
    return speak("espeak-ng", "en-us", text)


def random_sentence(rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(4, 12)))) + "."


def speak(engine: str, voice: str, text: str) -> np.ndarray:
    """One clip from espeak-ng or flite, trimmed to its voiced part, at `USER_DBFS` over it."""
    if engine == "espeak-ng":
        wav = synthesize(text, voice=voice)
    else:
        if shutil.which("flite") is None:
            raise RuntimeError("flite is not installed (apt-get install flite)")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "clip.wav"
            subprocess.run(["flite", "-voice", voice, "-t", text, "-o", str(out)], check=True, capture_output=True)
            wav = load_wav(out)
    loud = np.flatnonzero(np.abs(wav) > 0.01)
    return at_level(wav[loud[0] : loud[-1] + 1], USER_DBFS) if len(loud) else wav


def talker(n: int, voice: tuple[str, str], rng: np.random.Generator, clips: int = 12) -> np.ndarray:
    """One person talking on and off for `n` samples: clips of random sentences with pauses of 0.2 to 2 s."""
    pool = [speak(*voice, random_sentence(rng)) for _ in range(clips)]
    out = np.zeros(n + SAMPLE_RATE * 10, np.float32)
    at = int(rng.integers(0, SAMPLE_RATE * 2))
    while at < n:
        clip = pool[int(rng.integers(len(pool)))]
        out[at : at + len(clip)] += clip
        at += len(clip) + int(rng.uniform(0.2, 2.0) * SAMPLE_RATE)
    return out[:n]


def _babble(n: int, rng: np.random.Generator) -> np.ndarray:
    picks = rng.choice(len(VOICES), size=3, replace=False)
    return np.sum([talker(n, VOICES[i], rng) for i in picks], axis=0)


def _far(n: int, rng: np.random.Generator) -> np.ndarray:
    near = talker(n, VOICES[int(rng.integers(len(VOICES)))], rng)
    return sox(near, ["lowpass", "2500", "reverb", "80", "50", "100", "100", "20", "0"])


def _pink(n: int, rng: np.random.Generator) -> np.ndarray:
    return sox_synth(n, "pinknoise", rng)


def _street(n: int, rng: np.random.Generator) -> np.ndarray:
    out = sox_synth(n, "brownnoise", rng) * 0.5
    rumble = sox(sox_synth(n, "pinknoise", rng), ["lowpass", "800"])
    at = rng.exponential(6.0)
    while at < n / SAMPLE_RATE:  # a car passing: filtered noise swelling over 2 to 5 s
        length = rng.uniform(2, 5)
        a, b = int(at * SAMPLE_RATE), min(n, int((at + length) * SAMPLE_RATE))
        env = (1 - np.abs(np.arange(a, b) / SAMPLE_RATE - at - length / 2) / (length / 2)) ** 2
        out[a:b] += rumble[a:b] * env * rng.uniform(1.0, 3.0)
        at += length + rng.exponential(6.0)
    at = rng.exponential(15.0)
    while at < n / SAMPLE_RATE:  # a horn: two tones with harmonics, 0.2 to 0.8 s, sometimes twice
        for _ in range(int(rng.integers(1, 3))):
            a, length = int(at * SAMPLE_RATE), rng.uniform(0.2, 0.8)
            tt = np.arange(int(length * SAMPLE_RATE)) / SAMPLE_RATE
            f = rng.uniform(350, 450)
            tone = sum(np.sign(np.sin(2 * np.pi * f * r * tt)) / k for k, r in enumerate((1, 1.26), 1))
            tone = tone * np.minimum(1, np.minimum(tt, tt[::-1]) / 0.02) * 0.3
            out[a : a + len(tone)] += tone[: max(0, n - a)]
            at += length + rng.uniform(0.1, 0.3)
        at += rng.exponential(15.0)
    return out


def _music(n: int, rng: np.random.Generator) -> np.ndarray:
    out, at = np.zeros(n + SAMPLE_RATE * 4, np.float32), 0
    while at < n:  # a piece: 8 to 30 s in one key and tempo
        key, beat = int(rng.integers(-6, 6)), 60 / rng.uniform(70, 140)
        scale = np.array([0, 2, 4, 5, 7, 9, 11, 12])
        end = at + int(rng.uniform(8, 30) * SAMPLE_RATE)
        while at < end and at < n:
            root = int(rng.choice([0, 5, 7, 9]))  # I, IV, V, vi
            chord = [root, root + (3 if root == 9 else 4), root + 7]
            length = int(2 * beat * SAMPLE_RATE)
            for semis in chord:
                out[at : at + length] += _note(220 * 2 ** ((key + semis) / 12), length, "pluck") * 0.25
            for b in range(4):  # the melody: eighth notes, a sung tone with vibrato, now and then a rest
                if rng.random() < 0.8:
                    semis = key + int(rng.choice(scale)) + 12
                    a = at + b * length // 4
                    out[a : a + length // 4] += _note(220 * 2 ** (semis / 12), length // 4, "sung") * 0.4
            at += length
    return out[:n]


def _note(freq: float, length: int, timbre: str) -> np.ndarray:
    t = np.arange(length) / SAMPLE_RATE
    if timbre == "sung":
        phase = 2 * np.pi * freq * t + 0.02 * freq / 5.5 * np.sin(2 * np.pi * 5.5 * t)  # 2 % vibrato at 5.5 Hz
        env = np.minimum(1, np.minimum(t, t[::-1]) / 0.03)
        return env * sum(np.sin(k * phase) / k**1.5 for k in range(1, 6))
    env = np.exp(-3 * t) * np.minimum(1, t / 0.005)
    return env * sum(np.sin(2 * np.pi * freq * k * t) / k**2 for k in range(1, 8))


def sox_synth(n: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """`n` samples of sox's `synth` noise, repeatable for a seed drawn from `rng` (sox -R fixes its own seed)."""
    _need_sox()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "n.wav"
        cmd = [
            "sox",
            "-R",
            "-n",
            "-r",
            str(SAMPLE_RATE),
            "-c",
            "1",
            "-b",
            "16",
            str(out),
            "synth",
            f"{n / SAMPLE_RATE + 1:.3f}",
        ]
        subprocess.run(cmd + [kind], check=True, capture_output=True)
        x = load_wav(out)
    return np.roll(x, int(rng.integers(len(x))))[:n]  # each seed starts sox's one sequence somewhere else


def sox(x: np.ndarray, effects: list[str]) -> np.ndarray:
    """`x` through sox effects, at the same length."""
    _need_sox()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.wav", Path(tmp) / "out.wav"
        peak = float(np.abs(x).max()) or 1.0
        sf.write(str(src), x / peak * 0.5, SAMPLE_RATE, subtype="FLOAT")
        subprocess.run(["sox", str(src), str(out), *effects], check=True, capture_output=True)
        y = load_wav(out) * peak * 2
    return np.pad(y, (0, max(0, len(x) - len(y))))[: len(x)]


def _need_sox() -> None:
    if shutil.which("sox") is None:
        raise RuntimeError("sox is not installed (apt-get install sox)")
