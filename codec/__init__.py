"""EnCodec tokenizer: 24 kHz PCM <-> discrete multi-codebook codes, offline and streaming.

Names are imported on first use (PEP 562): `codec.pcm` alone does not import transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "BANDWIDTHS": "codec.tokenizer",
    "EncodecTokenizer": "codec.tokenizer",
    "StreamingDecoder": "codec.streaming",
    "StreamingEncoder": "codec.streaming",
}

__all__ = [
    "BANDWIDTHS",
    "EncodecTokenizer",
    "StreamingDecoder",
    "StreamingEncoder",
]

if TYPE_CHECKING:
    from codec.streaming import StreamingDecoder, StreamingEncoder
    from codec.tokenizer import BANDWIDTHS, EncodecTokenizer


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 'codec' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
