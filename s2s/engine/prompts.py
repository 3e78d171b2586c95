"""Prompt: a prefix of both streams that a conversation starts from (a voice prompt; Moshi's persona prompts).

A voice prompt of this project's models is the model stream's frames with the user silent. A Moshi-family prompt
(PersonaPlex's) gives both: the model's text and audio, and what the user stream holds meanwhile. Conversations that
open with the same prompt share its steps through the prefix cache: it is computed once.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from s2s.models.config import ModelConfig


class Prompt(NamedTuple):
    model: np.ndarray  # the model stream's frames [K, P]
    user: np.ndarray | None = None  # the user stream's [K, P]; None: silent

    @property
    def frames(self) -> int:
        return self.model.shape[1]


def checked_prompt(cfg: ModelConfig, prompt: Prompt | np.ndarray | torch.Tensor, what: str) -> Prompt:
    """A `Prompt`, or the codec's codes `[audio_codebooks, P]` of a voice (`ModelConfig.checked_codes`), checked: a
    ValueError says what is wrong."""
    if not isinstance(prompt, Prompt):
        return Prompt(cfg.checked_codes(prompt, what))
    frames = []
    for name, stream in (("model", prompt.model), ("user", prompt.user)):
        if stream is None and name == "user":
            frames.append(None)
            continue
        stream = np.asarray(torch.as_tensor(stream).cpu(), dtype=np.int64)
        if stream.ndim != 2 or stream.shape[0] != cfg.num_codebooks or stream.shape[1] == 0:
            raise ValueError(f"{what}: {name} frames must be [K={cfg.num_codebooks}, P >= 1], got {stream.shape}")
        audio = stream[int(cfg.text_stream) :]
        if audio.min() < 0 or audio.max() >= cfg.codebook_size:
            raise ValueError(f"{what}: {name} audio codes must lie in [0, {cfg.codebook_size})")
        if cfg.text_stream and name == "model" and (stream[0].min() < 0 or stream[0].max() >= cfg.text_vocab):
            raise ValueError(f"{what}: text ids must lie in [0, {cfg.text_vocab})")
        if cfg.text_stream and name == "user" and (stream[0] != cfg.pad_id).any():
            raise ValueError(f"{what}: the user stream has no text: its codebook 0 must be pad_id {cfg.pad_id}")
        frames.append(stream)
    if frames[1] is not None and frames[1].shape != frames[0].shape:
        raise ValueError(f"{what}: model frames {frames[0].shape} and user frames {frames[1].shape} differ")
    return Prompt(frames[0], frames[1])
