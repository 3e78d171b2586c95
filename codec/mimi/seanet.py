"""Mimi's SEANet encoder and decoder: causal convolutions padded on the left (zeros, or the first sample), ELUs and
residual blocks. Parameter names follow Kyutai's `moshi.modules.seanet` (`encoder.model.0.conv.conv.weight`, ...), so
Kyutai's state dict loads as it is; `step()` gives the net as a streaming step (`codec/stream_layers.py`).

Layers that see few steps a frame (the wide ones, near the latent rate) run as matrix products, the rest as torch's
convolutions (see `Conv1dStep`); the choice is the layer's, the same offline and streaming."""

from __future__ import annotations

from torch import nn

from codec.mimi.config import MimiConfig
from codec.stream_layers import (
    Conv1dStep,
    ConvTranspose1dStep,
    EluStep,
    ResidualStep,
    SequenceStep,
    Step,
)

MATMUL_STEPS = 16  # a convolution with at most this many output (transposed: input) steps a frame: a matrix product


class _Holder(nn.Module):
    """One level of Kyutai's module nesting, for its parameter names (`conv.conv.weight`)."""

    def __init__(self, name: str, module: nn.Module):
        super().__init__()
        self.add_module(name, module)


class CausalConv1d(nn.Module):
    """`conv.conv` is the torch convolution; it pads nothing itself: the left padding is the step's."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        groups: int = 1,
        bias: bool = True,
        pad_mode: str = "constant",
    ):
        super().__init__()
        self.conv = _Holder(
            "conv", nn.Conv1d(c_in, c_out, kernel_size, stride, dilation=dilation, groups=groups, bias=bias)
        )
        self.pad_mode = pad_mode

    def step(self, frame_steps: int) -> Step:
        """The layer as a step, given its input's steps a frame."""
        conv = self.conv.conv
        return Conv1dStep(
            conv, self.pad_mode, matmul=conv.groups == 1 and frame_steps // conv.stride[0] <= MATMUL_STEPS
        )


class CausalConvTranspose1d(nn.Module):
    """`convtr.convtr` is the torch transposed convolution, trimmed on the right by the step."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int, groups: int = 1, bias: bool = True):
        super().__init__()
        self.convtr = _Holder("convtr", nn.ConvTranspose1d(c_in, c_out, kernel_size, stride, groups=groups, bias=bias))

    def step(self, frame_steps: int) -> Step:
        """The layer as a step, given its input's steps a frame."""
        conv = self.convtr.convtr
        return ConvTranspose1dStep(conv, matmul=conv.groups == 1 and frame_steps <= MATMUL_STEPS)


class _ResnetBlock(nn.Module):
    def __init__(self, cfg: MimiConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.Sequential(
            nn.ELU(cfg.elu_alpha),
            CausalConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, pad_mode=cfg.pad_mode),
            nn.ELU(cfg.elu_alpha),
            CausalConv1d(hidden, dim, 1, pad_mode=cfg.pad_mode),
        )
        self.shortcut = nn.Identity() if cfg.true_skip else CausalConv1d(dim, dim, 1, pad_mode=cfg.pad_mode)

    def step(self, frame_steps: int) -> Step:
        shortcut = None if isinstance(self.shortcut, nn.Identity) else self.shortcut.step(frame_steps)
        return ResidualStep(SequenceStep([_step(m, frame_steps)[0] for m in self.block]), shortcut)


def _step(m: nn.Module, frame_steps: int) -> tuple[Step, int]:
    """Layer `m` as a step, given its input's steps a frame, and its output's."""
    if isinstance(m, nn.ELU):
        return EluStep(m.alpha), frame_steps
    if isinstance(m, CausalConv1d):
        return m.step(frame_steps), frame_steps // m.conv.conv.stride[0]
    if isinstance(m, CausalConvTranspose1d):
        return m.step(frame_steps), frame_steps * m.convtr.convtr.stride[0]
    return m.step(frame_steps), frame_steps


class _SEANet(nn.Module):
    model: nn.Sequential

    def step(self, frame_steps: int) -> SequenceStep:
        """The net as a step, given its input's steps a frame."""
        steps = []
        for m in self.model:
            step, frame_steps = _step(m, frame_steps)
            steps.append(step)
        return SequenceStep(steps)


class SEANetEncoder(_SEANet):
    """PCM `[B, 1, T]` -> latents `[B, dimension, T / hop_length]`."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        pad, act, nf = cfg.pad_mode, cfg.elu_alpha, cfg.n_filters
        layers: list[nn.Module] = [CausalConv1d(cfg.channels, nf, cfg.kernel_size, pad_mode=pad)]
        mult = 1
        for ratio in reversed(cfg.ratios):
            layers += [_ResnetBlock(cfg, mult * nf, cfg.dilation_base**j) for j in range(cfg.n_residual_layers)]
            layers += [nn.ELU(act), CausalConv1d(mult * nf, 2 * mult * nf, 2 * ratio, stride=ratio, pad_mode=pad)]
            mult *= 2
        layers += [nn.ELU(act), CausalConv1d(mult * nf, cfg.dimension, cfg.last_kernel_size, pad_mode=pad)]
        self.model = nn.Sequential(*layers)


class SEANetDecoder(_SEANet):
    """Latents `[B, dimension, F]` -> PCM `[B, 1, F * hop_length]`."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        pad, act, nf = cfg.pad_mode, cfg.elu_alpha, cfg.n_filters
        mult = 2 ** len(cfg.ratios)
        layers: list[nn.Module] = [CausalConv1d(cfg.dimension, mult * nf, cfg.kernel_size, pad_mode=pad)]
        for ratio in cfg.ratios:
            layers += [nn.ELU(act), CausalConvTranspose1d(mult * nf, mult * nf // 2, 2 * ratio, ratio)]
            layers += [_ResnetBlock(cfg, mult * nf // 2, cfg.dilation_base**j) for j in range(cfg.n_residual_layers)]
            mult //= 2
        layers += [nn.ELU(act), CausalConv1d(nf, cfg.channels, cfg.last_kernel_size, pad_mode=pad)]
        self.model = nn.Sequential(*layers)
