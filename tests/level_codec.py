"""LevelCodec: a codec for the tests whose frame is as many samples as asked (1920: Mimi's 80 ms), with what an engine
takes of a tokenizer: `encode`, `decode`, and streaming rows (`streaming_encoder`, `streaming_decoder`).

Codebook k of a frame is the mean level of the frame's k-th part, quantized to `codebook_size` steps; decoding holds
each part at its level. Deterministic, and its streams hold nothing but the samples a row has not yet made a frame of,
so streaming equals `encode` and `decode` whatever the chunks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from codec.pcm import SAMPLE_RATE


class LevelCodec:
    sample_rate = SAMPLE_RATE
    device = torch.device("cpu")

    def __init__(self, frame_size: int, num_codebooks: int, codebook_size: int = 1024):
        if frame_size % num_codebooks:
            raise ValueError(f"a frame of {frame_size} samples does not split into {num_codebooks} parts")
        self.frame_size, self.num_codebooks, self.codebook_size = frame_size, num_codebooks, codebook_size
        self.frame_rate = SAMPLE_RATE / frame_size

    def encode(self, pcm: np.ndarray) -> torch.Tensor:
        """PCM `[T]` or `[B, T]` -> codes `[B, K, ceil(T / frame_size)]` (the last frame filled out with silence)."""
        pcm = np.atleast_2d(np.asarray(pcm, dtype=np.float32))
        frames = -(-pcm.shape[1] // self.frame_size)
        whole = np.zeros((len(pcm), frames * self.frame_size), dtype=np.float32)
        whole[:, : pcm.shape[1]] = pcm
        levels = whole.reshape(len(pcm), frames, self.num_codebooks, self.frame_size // self.num_codebooks).mean(-1)
        codes = np.rint((np.clip(levels, -1, 1) + 1) / 2 * (self.codebook_size - 1)).astype(np.int64)
        return torch.from_numpy(codes.transpose(0, 2, 1).copy())

    def decode(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Codes `[B, K, F]` -> PCM `[B, F * frame_size]`."""
        codes = torch.as_tensor(codes)
        levels = codes.float() / (self.codebook_size - 1) * 2 - 1  # [B, K, F]
        parts = levels.permute(0, 2, 1).repeat_interleave(self.frame_size // self.num_codebooks, dim=-1)
        return parts.reshape(len(codes), -1)

    def streaming_encoder(self, rows: int, batch_invariant: bool = False) -> LevelEncoder:
        return LevelEncoder(self, rows)

    def streaming_decoder(self, rows: int, batch_invariant: bool = False) -> LevelDecoder:
        return LevelDecoder(self)


class LevelEncoder:
    """PCM in, codes out, for `rows` rows: each push returns, for each listed row, the codes `[K, f]` of the frames
    its samples completed."""

    def __init__(self, codec: LevelCodec, rows: int):
        self.codec = codec
        self.pending = [np.zeros(0, dtype=np.float32) for _ in range(rows)]

    def reset(self, row: int) -> None:
        self.pending[row] = self.pending[row][:0]

    def push(self, pcm: Sequence[np.ndarray], rows: Sequence[int]) -> list[torch.Tensor]:
        out = []
        for row, chunk in zip(rows, pcm, strict=True):
            samples = np.concatenate([self.pending[row], chunk])
            whole = len(samples) // self.codec.frame_size * self.codec.frame_size
            out.append(self.codec.encode(samples[:whole])[0])
            self.pending[row] = samples[whole:]
        return out


class LevelDecoder:
    """Codes `[R, K, n]` in, PCM `[R, n * frame_size]` out: a frame's audio in the push that brings its codes."""

    def __init__(self, codec: LevelCodec):
        self.codec = codec

    def reset(self, row: int) -> None:
        """Nothing to forget: a frame decodes alone."""

    def push(self, codes: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        return self.codec.decode(codes)
