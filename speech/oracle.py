"""The oracle's measurements, shared by the tests, `s2s bench oracle` and the demo: held-out takes (a held-out
sentence in a held-out voice), whether the recogniser hears each one's own sentence in some audio, and the codec's
round trips. Through the server: `bench/oracle_bench.py` (`serve`, `replies`).

A rate is always read against the originals': a take the recogniser misses when spoken clean does not count
against the system.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from speech.recognizer import Recognizer
from speech.sentences import HELDOUT_SENTENCES
from speech.voices import HELDOUT_VOICES, Voice, say


@dataclass(frozen=True)
class Take:
    index: int  # into HELDOUT_SENTENCES
    voice: Voice
    pcm: np.ndarray  # float32, 24 kHz

    @property
    def sentence(self) -> str:
        return HELDOUT_SENTENCES[self.index]


@cache
def recognizer() -> Recognizer:
    return Recognizer(HELDOUT_SENTENCES)


def takes(count: int | None = None) -> list[Take]:
    """The first `count` (default all) of every held-out sentence in every held-out voice, sentences first."""
    pairs = [(i, v) for i in range(len(HELDOUT_SENTENCES)) for v in HELDOUT_VOICES][:count]
    return [Take(i, v, say(HELDOUT_SENTENCES[i], v)) for i, v in pairs]


def heard(audio: np.ndarray) -> int | None:
    """The index of the sentence the recogniser hears in `audio` (None: none of the set)."""
    return recognizer().identify(audio)


def rate(takes: list[Take], audios: list[np.ndarray]) -> float:
    """The share of `takes` whose audio is recognised as the take's own sentence."""
    return float(np.mean([heard(a) == t.index for t, a in zip(takes, audios, strict=True)]))


def offline_round_trip(tok, pcm: np.ndarray) -> np.ndarray:
    return tok.decode(tok.encode(pcm))[0].numpy()


def streaming_round_trip(tok, pcm: np.ndarray, block: int = 1920) -> np.ndarray:
    """Through the streaming encoder in 80 ms blocks (as a client sends) and the decoder frame by frame."""
    enc, dec = tok.streaming_encoder(1), tok.streaming_decoder(1)
    audio = []
    for a in range(0, len(pcm), block):
        codes = enc.push(pcm[None, a : a + block])[0]
        for f in range(codes.shape[-1]):
            audio.append(dec.push(codes[None, :, f : f + 1])[0])
    return torch.cat(audio).numpy() if audio else np.zeros(0, np.float32)
