"""Silero VAD's network, loaded once per process and shared by every connection's endpointer.

Silero's TorchScript model keeps one stream's state inside itself (its LSTM's state and the last 64 samples, which
its `forward` reads and writes back), so one model object cannot serve two streams. Its 16 kHz network underneath
(`_model`) is a function of (context + window, state) -> (probability, state): `SileroStream` keeps a stream's state
and context and does what the model's own `forward` does with them. Loading the model costs about 40 ms of CPU; a
stream costs two empty tensors.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

RATE = 16000
WINDOW = 512  # samples a probability is scored on (32 ms)
CONTEXT = 64  # samples of the previous window each window is scored with

_lock = threading.Lock()
_network: torch.jit.ScriptModule | None = None


def network() -> torch.jit.ScriptModule:
    """The process's Silero 16 kHz network, loaded on the first call (endpointers run in worker threads)."""
    global _network
    with _lock:
        if _network is None:
            threads = torch.get_num_threads()
            from silero_vad import load_silero_vad  # (not at import: it ships its model; it sets torch's threads to 1)

            torch.set_num_threads(threads)  # the engine's, which silero_vad's import changed
            _network = load_silero_vad()._model
    return _network


class SileroStream:
    """One audio stream's speech probabilities, window by window, on the shared network."""

    def __init__(self) -> None:
        self.net = network()
        self.state = torch.zeros(0)  # the LSTM's (h, c); empty: zeros, as the model's `reset_states` leaves it
        self.context = torch.zeros(1, CONTEXT)

    @torch.inference_mode()
    def probability(self, window: np.ndarray) -> float:
        """The probability of speech in `window` (`WINDOW` samples at `RATE`), after every window before it."""
        x = torch.cat([self.context, torch.from_numpy(window).reshape(1, WINDOW)], dim=1)
        out, self.state = self.net(x, self.state)
        self.context = x[:, -CONTEXT:]
        return float(out)
