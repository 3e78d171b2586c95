"""The cascade's text decoder: the speech model's size and class over one codebook of bytes, and what becomes of its
bytes (letters, then phrases to speak)."""

from __future__ import annotations

import numpy as np
import torch

from s2s import Engine, EngineConfig, ModelConfig, S2SModel

CHARS_PER_S = 15.0  # speech: a reply's bytes last this long each, in the speech engine's frames
PHRASE_CHARS = 20
LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def printable(ids: np.ndarray) -> str:
    """Bytes from the text decoder as speakable text: a space one time in six (and for non-byte ids), else a letter."""
    return "".join(" " if b >= 256 or b % 6 == 0 else LETTERS[b % 26] for b in ids.tolist())


def split_phrase(text: str, min_chars: int) -> tuple[str, str] | None:
    """(phrase, rest) at the first word boundary at or after `min_chars` characters of words, or None."""
    text = text.lstrip()
    i = text.find(" ", max(1, min_chars))
    return (text[:i], text[i + 1 :]) if i != -1 else None


def text_engine_for(
    preset: str,
    reply_s: float,
    max_conversations: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **config,
) -> Engine:
    """The cascade's text decoder: the speech model's size and class, one codebook of bytes, no codec, replies as
    long in speech as `reply_s` seconds, on the speech model's device and dtype. One step a tick (a codec-free
    engine's frame, 13.3 ms): its earliest first token."""
    cfg = ModelConfig.preset(preset, num_codebooks=1, codebook_size=256)
    model = S2SModel.from_seed(cfg, seed=0, dtype=dtype, device=device)
    reply_bytes = max(1, round(reply_s * CHARS_PER_S))
    engine_cfg = EngineConfig(
        frames_per_tick=1, max_reply_frames=reply_bytes, max_conversations=max_conversations, **config
    )
    return Engine(model, None, engine_cfg)
