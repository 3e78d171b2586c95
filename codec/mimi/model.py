"""Mimi's modules in one `nn.Module` whose state dict has the names of Kyutai's `MimiModel` (less the codebooks'
`_initialized` flags), and its encoder and decoder as streaming steps: SEANet, transformer, resampling."""

from __future__ import annotations

import torch
from torch import nn

from codec.mimi.config import MimiConfig
from codec.mimi.quantizer import SplitRVQ
from codec.mimi.resample import Downsample, Upsample
from codec.mimi.seanet import SEANetDecoder, SEANetEncoder
from codec.mimi.transformer import ProjectedTransformer
from codec.stream_layers import SequenceStep


class MimiModel(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = SEANetEncoder(cfg)
        self.decoder = SEANetDecoder(cfg)
        self.encoder_transformer = ProjectedTransformer(cfg)
        self.decoder_transformer = ProjectedTransformer(cfg)
        self.quantizer = SplitRVQ(cfg)
        resampled = cfg.downsample_stride > 1
        self.downsample = Downsample(cfg) if resampled else None
        self.upsample = Upsample(cfg) if resampled else None

    def encoder_step(self) -> SequenceStep:
        """PCM `[B, 1, n * frame_size]` -> unquantized latents `[B, dimension, n]`, as a streaming step."""
        parts = [self.encoder.step(self.cfg.frame_size), self.encoder_transformer.step()]
        return SequenceStep(parts + ([self.downsample.step()] if self.downsample is not None else []))

    def decoder_step(self) -> SequenceStep:
        """Dequantized latents `[B, dimension, n]` -> PCM `[B, 1, n * frame_size]`, as a streaming step."""
        parts = [self.decoder_transformer.step(), self.decoder.step(self.cfg.downsample_stride)]
        return SequenceStep(([self.upsample.step()] if self.upsample is not None else []) + parts)

    @torch.no_grad()
    def seed_codebooks(self, generator: torch.Generator) -> None:
        """Give freshly initialised weights codebooks that cover their own latent space (all-zero ones would give
        one code): each codebook is drawn from a diagonal Gaussian fitted to the residual it will quantize,
        measured on seeded noise."""
        noise = 0.3 * torch.randn(1, 1, 32 * self.cfg.frame_size, generator=generator)  # 32 frames
        latent, _ = self.encoder_step()(noise.to(self.quantizer.rvq_first.input_proj.weight.device), None)
        for rvq in (self.quantizer.rvq_first, self.quantizer.rvq_rest):
            residual = torch.nn.functional.conv1d(latent, rvq.input_proj.weight)[0].T  # [frames, dim]
            for layer in rvq.vq.layers:
                book = layer._codebook
                mean, std = residual.mean(0), residual.std(0)
                noise = torch.randn(book.embedding_sum.shape, generator=generator).to(mean.device)
                book.embedding_sum.copy_(mean + std * noise)
                book.cluster_usage.fill_(1.0)
                residual = residual - book.embedding()[torch.cdist(residual, book.embedding()).argmin(-1)]
        self.quantizer.prepare()
