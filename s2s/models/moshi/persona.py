"""A PersonaPlex persona prompt as a `Prompt` of both streams, stepped ahead of a conversation as NVIDIA's
`LMGen.step_system_prompts` steps it:

1. the voice: its audio as the model's frames, the model's text padding, the user stream a 440 Hz sine;
2. `silence_frames` of the codec's silence as the model's audio, text padding, the user's sine;
3. the text prompt, `<system> TEXT <system>` in the model's tokenizer, a token a frame over the model's silence;
4. `silence_frames` again.

The sine and silence frames are what the codec makes of them (the steady frame of 16: PersonaPlex's are Mimi's
codes of the same sounds). Conversations that open on the same persona compute it once (the prefix cache).
"""

from __future__ import annotations

import numpy as np

from codec import Tokenizer
from s2s.engine.prompts import Prompt
from s2s.models.config import ModelConfig
from s2s.models.moshi.text import TextPieces

SINE_HZ = 440.0


def steady_codes(tok: Tokenizer, pcm: np.ndarray) -> np.ndarray:
    """The codec's codes `[K']` of a steady sound: the last frame of 16 frames of it."""
    return tok.encode(pcm[: 16 * tok.frame_size].astype(np.float32))[0, :, -1].cpu().numpy()


def persona_prompt(
    cfg: ModelConfig,
    tok: Tokenizer,
    pieces: TextPieces,
    voice: np.ndarray | None,
    text: str | None,
    silence_frames: int = 1,
) -> Prompt:
    """The prompt of a voice (24 kHz audio) and a role text, either of which may be None."""
    if not cfg.text_stream:
        raise ValueError("a persona prompt needs a model with a text stream (Moshi's family)")
    t = np.arange(16 * tok.frame_size) / tok.sample_rate
    sine = steady_codes(tok, 0.5 * np.sin(2 * np.pi * SINE_HZ * t))
    silence = steady_codes(tok, np.zeros_like(t))
    pad = pieces.padding_id
    frames: list[tuple[int, np.ndarray]] = []  # (text id, the model's audio codes)
    if voice is not None:
        codes = tok.encode(voice.astype(np.float32))[0].cpu().numpy()
        frames += [(pad, codes[:, f]) for f in range(codes.shape[1])]
    frames += [(pad, silence)] * silence_frames
    if text:
        frames += [(int(i), silence) for i in pieces.processor.encode(f"<system> {text.strip()} <system>")]
        frames += [(pad, silence)] * silence_frames
    model = np.array([[text_id, *audio] for text_id, audio in frames], dtype=np.int64).T
    user = cfg.as_frames(np.repeat(sine.astype(np.int64)[:, None], len(frames), axis=1))
    return Prompt(model, user)
