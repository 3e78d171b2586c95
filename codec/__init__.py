"""Codec tokenizers (EnCodec, Mimi): 24 kHz PCM <-> discrete multi-codebook codes, offline and streaming.

Names are imported on first use (PEP 562): `codec.pcm` alone does not import transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "BANDWIDTHS": "codec.tokenizer",
    "EncodecTokenizer": "codec.tokenizer",
    "MimiConfig": "codec.mimi.config",
    "MimiTokenizer": "codec.mimi.tokenizer",
    "StreamingDecoder": "codec.streaming",
    "StreamingEncoder": "codec.streaming",
    "Tokenizer": "codec.load",
    "load_tokenizer": "codec.load",
}

__all__ = [
    "BANDWIDTHS",
    "EncodecTokenizer",
    "MimiConfig",
    "MimiTokenizer",
    "StreamingDecoder",
    "StreamingEncoder",
    "Tokenizer",
    "load_tokenizer",
]

if TYPE_CHECKING:
    from codec.load import Tokenizer, load_tokenizer
    from codec.mimi.config import MimiConfig
    from codec.mimi.tokenizer import MimiTokenizer
    from codec.streaming import StreamingDecoder, StreamingEncoder
    from codec.tokenizer import BANDWIDTHS, EncodecTokenizer


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 'codec' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
