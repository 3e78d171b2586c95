"""Voice prompts: a folder of audio files, encoded once at start, each chosen by its file name."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from codec import EncodecTokenizer
from server.audio import load_wav

AUDIO_SUFFIXES = {".wav", ".flac", ".ogg"}


def load_prompts(folder: str | Path, tok: EncodecTokenizer) -> dict[str, np.ndarray]:
    """name -> codes [K, P] for each audio file whose stem is a plain name (letters, digits, underscore)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"prompt folder {folder} does not exist")
    voices = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() not in AUDIO_SUFFIXES:
            continue
        if not path.stem.isidentifier():
            raise ValueError(f"voice prompt {path.name}: names must be plain (letters, digits, underscore)")
        voices[path.stem] = tok.encode(load_wav(path))[0].cpu().numpy()
    return voices
