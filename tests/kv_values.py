"""Test helper shared by the cache tests: K/V stand-ins that depend on the whole prefix, as in a causal model."""

import hashlib

import numpy as np


def step_values(key: np.ndarray) -> np.ndarray:
    """A distinct value per step that depends on the whole prefix up to it, as K/V do in a causal model."""
    out, h = np.empty(len(key)), b""
    for t, row in enumerate(key):
        h = hashlib.blake2b(h + row.tobytes(), digest_size=8).digest()
        out[t] = int.from_bytes(h[:3]) / 8.0  # exact in float32
    return out
