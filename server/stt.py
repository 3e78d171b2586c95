"""Speech-to-text for the cascade: pocketsphinx, fed while the user speaks so that only the final search is left at
the end of the turn (its streaming `process_raw`, as in pocketsphinx's live examples). 16 kHz, US English model
shipped with the wheel, free decoding with its default language model."""

from __future__ import annotations

import os

import numpy as np
import soxr
from pocketsphinx import Decoder

RATE = 16000


class Transcriber:
    """One per conversation at a time (the decoder holds the utterance); `reset` makes it ready for the next one."""

    def __init__(self):
        self.decoder = Decoder(samprate=RATE, logfn=os.devnull)
        self.resampler = soxr.ResampleStream(24000, RATE, 1, dtype="float32")
        self.decoder.start_utt()

    def push(self, pcm: np.ndarray) -> None:
        """User PCM (float32, 24 kHz) into the running search."""
        audio = self.resampler.resample_chunk(np.asarray(pcm, dtype=np.float32))
        if len(audio):
            self.decoder.process_raw((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes(), False, False)

    def final(self) -> str:
        """End the utterance: the final search over what was pushed; the next pushes start a new utterance."""
        self.decoder.end_utt()
        hyp = self.decoder.hyp()
        self.decoder.start_utt()
        return hyp.hypstr if hyp is not None else ""

    def reset(self) -> None:
        self.decoder.end_utt()
        self.resampler = soxr.ResampleStream(24000, RATE, 1, dtype="float32")
        self.decoder.start_utt()
