"""Mimi's learnt resampling between the transformers' rate (25 Hz) and the codes' (12.5 Hz): a causal strided
convolution down, its left edge replicating the first latent (Kyutai's `ConvDownsample1d`, pad_mode "replicate"),
and a channel-wise transposed convolution up (`ConvTrUpsample1d`), both of kernel twice the stride, no bias."""

from __future__ import annotations

from torch import nn

from codec.mimi.config import MimiConfig
from codec.mimi.seanet import CausalConv1d, CausalConvTranspose1d
from codec.stream_layers import Step


class Downsample(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        s, d = cfg.downsample_stride, cfg.dimension
        self.conv = CausalConv1d(d, d, 2 * s, stride=s, bias=False, pad_mode="replicate")

    def step(self) -> Step:
        return self.conv.step(frame_steps=self.conv.conv.conv.stride[0])


class Upsample(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        s, d = cfg.downsample_stride, cfg.dimension
        self.convtr = CausalConvTranspose1d(d, d, 2 * s, s, groups=cfg.upsample_groups or d, bias=False)

    def step(self) -> Step:
        return self.convtr.step(frame_steps=1)
