"""EnCodec tokenizer: 24 kHz PCM <-> discrete multi-codebook codes, offline and streaming."""

from codec.streaming import StreamingDecoder, StreamingEncoder
from codec.tokenizer import BANDWIDTHS, EncodecTokenizer

__all__ = ["BANDWIDTHS", "EncodecTokenizer", "StreamingDecoder", "StreamingEncoder"]
