"""server/vad/silero.py (issue 45): a process loads Silero once, its endpointers share the network, each with its
own state, and score exactly as Silero's own model does; new settings keep an endpointer's stream."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import silero_vad
import soxr
import torch

from server.vad.endpointer import Endpointer, VadConfig
from speech.sample import synthesize

SLICE = 1920  # 80 ms: what the connection core hands an endpointer


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(24000 * seconds), np.float32)


@pytest.fixture(scope="module")
def streams() -> tuple[np.ndarray, np.ndarray]:
    """Two users: different speech, at different times, in as long a stream."""
    a = np.concatenate([silence(0.3), synthesize("Book a table for two, please."), silence(0.8)])
    b = np.concatenate([silence(0.9), synthesize("What time does the museum open?"), silence(0.6)])
    n = max(len(a), len(b))
    return np.pad(a, (0, n - len(a))), np.pad(b, (0, n - len(b)))


def slices(audio: np.ndarray) -> list[np.ndarray]:
    return [audio[a : a + SLICE] for a in range(0, len(audio), SLICE)]


def scored(ep: Endpointer) -> list[float]:
    """The probabilities `ep` scores from now on, window by window."""
    seen, window = [], ep._window

    def spy(p: float, energy: float) -> list[str]:
        seen.append(p)
        return window(p, energy)

    ep._window = spy
    return seen


def alone(audio: np.ndarray, cfg: VadConfig) -> tuple[list[str], list[float]]:
    ep = Endpointer(cfg)
    ps = scored(ep)
    return [e for pcm in slices(audio) for e in ep.push(pcm)], ps


def silero_own(audio: np.ndarray) -> list[float]:
    """Silero's own model, which keeps the stream's state inside itself, on the same 16 kHz windows."""
    resampler = soxr.ResampleStream(24000, 16000, 1, dtype="float32")
    pcm = np.concatenate([resampler.resample_chunk(s) for s in slices(audio)])
    model = silero_vad.load_silero_vad()
    with torch.inference_mode():
        return [float(model(torch.from_numpy(pcm[a : a + 512]), 16000)) for a in range(0, len(pcm) - 511, 512)]


def test_interleaved_endpointers_share_one_network_and_score_as_separate_ones(streams, monkeypatch) -> None:
    """Two conversations' endpointers, fed in turn, see what each would alone, to the bit, and what Silero's own
    stateful model sees; neither loads the model again."""
    cfg = VadConfig(silence_s=0.4)
    expected = [alone(audio, cfg) for audio in streams]
    reference = [silero_own(audio) for audio in streams]
    loads = []
    load = silero_vad.load_silero_vad
    monkeypatch.setattr(silero_vad, "load_silero_vad", lambda *a, **kw: loads.append(1) or load(*a, **kw))

    endpointers = [Endpointer(cfg), Endpointer(cfg)]
    probabilities = [scored(ep) for ep in endpointers]
    events: list[list[str]] = [[], []]
    for pair in zip(*map(slices, streams), strict=True):
        for i, pcm in enumerate(pair):
            events[i] += endpointers[i].push(pcm)

    assert not loads, "an endpointer loaded Silero again"
    for i in range(2):
        assert (events[i], probabilities[i]) == expected[i]
        assert probabilities[i] == reference[i]
        assert "end_of_turn" in events[i]


def test_new_settings_keep_the_stream(streams) -> None:
    """Settings changed mid-stream are thresholds: the stream's state goes on, scoring as if nothing changed."""
    audio = streams[0]
    _, expected = alone(audio, VadConfig())
    ep = Endpointer(VadConfig())
    ps = scored(ep)
    for i, pcm in enumerate(slices(audio)):
        if i % 5 == 0:
            ep.configure(VadConfig(start_threshold=0.5 + (i % 10) / 100))
        ep.push(pcm)
    assert ps == expected
    with pytest.raises(ValueError, match="VAD"):
        ep.configure(VadConfig(start_threshold=0.2, stop_threshold=0.5))


def test_endpointers_in_threads_at_once(streams) -> None:
    """The server runs each connection's endpointer in a worker thread: two at once on the shared network still
    score as each would alone."""
    cfg = VadConfig(silence_s=0.4)
    expected = [alone(audio, cfg) for audio in streams]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            assert list(pool.map(alone, streams, [cfg, cfg])) == expected
