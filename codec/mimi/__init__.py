"""Kyutai's Mimi codec (SEANet, transformers, learnt resampling to 12.5 Hz, split RVQ), batched and streaming, equal
to Kyutai's `moshi` package on its weights."""

from codec.mimi.config import MimiConfig
from codec.mimi.tokenizer import MimiTokenizer

__all__ = ["MimiConfig", "MimiTokenizer"]
