"""The oracle: pocketsphinx restricted by a JSGF grammar to a closed set of sentences.

Free decoding cannot hear synthetic speech; choosing among known sentences can, and that is what the tests ask:
which sentence does this reply say? Audio is 24 kHz float32; pocketsphinx takes 16 kHz int16.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import soxr

from codec.pcm import SAMPLE_RATE, to_pcm16

RATE = 16000


class Recognizer:
    """`identify(pcm)` -> the index of the sentence heard in `pcm`, or None when nothing in the set matches."""

    def __init__(self, sentences: Sequence[str]):
        from pocketsphinx import Decoder

        if not sentences or len(set(sentences)) != len(sentences):
            raise ValueError("the closed set needs at least one sentence, each once")
        self.sentences = list(sentences)
        self.decoder = Decoder(samprate=RATE, logfn=os.devnull)
        unknown = sorted({w for s in self.sentences for w in s.split() if self.decoder.lookup_word(w) is None})
        if unknown:
            raise ValueError(f"words the recogniser's dictionary lacks: {unknown}")
        rules = " | ".join(f"( {s} )" for s in self.sentences)
        self.decoder.add_jsgf_string("closed", f"#JSGF V1.0;\ngrammar closed;\npublic <s> = {rules} ;\n")
        self.decoder.activate_search("closed")

    def transcribe(self, pcm: np.ndarray, rate: int = SAMPLE_RATE) -> str:
        """The sentence of the set that best fits `pcm` (float32), or "" when the search ends nowhere."""
        if len(pcm) == 0:
            return ""  # pocketsphinx fails on an empty buffer, and stays failed
        audio = soxr.resample(np.asarray(pcm, dtype=np.float32), rate, RATE) if rate != RATE else pcm
        self.decoder.start_utt()
        self.decoder.process_raw(to_pcm16(audio), False, True)
        self.decoder.end_utt()
        hyp = self.decoder.hyp()
        return " ".join(hyp.hypstr.split()) if hyp is not None else ""

    def identify(self, pcm: np.ndarray, rate: int = SAMPLE_RATE) -> int | None:
        text = self.transcribe(pcm, rate)
        return self.sentences.index(text) if text in self.sentences else None
