"""server/vad/endpointer.py on real speech made with espeak-ng."""

from __future__ import annotations

import numpy as np
import pytest

from server.vad.endpointer import Endpointer, VadConfig
from speech.sample import synthesize


def test_endpointer_finds_the_turn_in_real_speech() -> None:
    wav = synthesize("Hello, I would like to book a table for two, please.")
    audio = np.concatenate([np.zeros(12000, np.float32), wav, np.zeros(24000, np.float32)])
    ep = Endpointer(VadConfig(silence_s=0.4))
    events = []
    for a in range(0, len(audio), 1920):
        events += [(e, a) for e in ep.push(audio[a : a + 1920])]
    kinds = [e for e, _ in events]
    assert kinds[0] == "speech_start" and "end_of_turn" in kinds
    start = next(a for e, a in events if e == "speech_start")
    end = next(a for e, a in events if e == "end_of_turn")
    assert 9000 <= start <= 12000 + 24000 * 0.3  # speech begins after the 0.5 s of silence
    assert 12000 + len(wav) - 24000 * 0.6 <= end <= 12000 + len(wav) + 24000 * 0.8
    # silence alone never starts a turn
    quiet = Endpointer()
    assert quiet.push(np.zeros(24000 * 2, np.float32)) == []


def test_bad_vad_settings() -> None:
    with pytest.raises(ValueError, match="VAD"):
        Endpointer(VadConfig(start_threshold=0.2, stop_threshold=0.5))
