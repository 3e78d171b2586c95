"""Streaming steps: layers as pure functions `layer(x, state) -> (y, new_state)`, where `state=None` starts a stream
and pads its left edge as the offline model does, and the state carries what the next chunk needs (see
`codec/streaming.py` for how the encoder and decoder use them). The steps are built from plain torch modules
(sharing their weights), so both codecs use them: `StreamingNet` wraps EnCodec's transformers layers, `codec/mimi/`
builds Mimi's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers.models.encodec.modeling_encodec import EncodecLSTM

State = tuple  # nested tuples of tensors, batch row first
Step = Callable[[torch.Tensor, "State | None"], tuple[torch.Tensor, State]]


def pad_left(x: torch.Tensor, n: int, mode: str) -> torch.Tensor:
    """`x` padded by `n` steps on the left: "constant" (zeros), "replicate", or "reflect", which on an input of `n`
    steps or fewer reflects zeros appended on the right (as transformers' and audiocraft's `pad1d` do)."""
    if mode != "reflect":
        return F.pad(x, (n, 0), mode)
    extra = max(0, n - x.shape[-1] + 1)
    padded = F.pad(F.pad(x, (0, extra)), (n, 0), mode)
    return padded[..., : padded.shape[-1] - extra]


class Conv1dStep:
    """A causal convolution: keeps its last `padding` inputs (a chunk's length must be a multiple of the stride).

    `matmul`: computed as one matrix product over the unfolded input instead of torch's convolution (oneDNN), which
    on a CPU is many times slower for wide layers over a few steps (Mimi's 512 -> 1024 channels, kernel 16, over 2
    steps a frame: ~20 ms against ~2 for 4 rows).

    `taps` (stride 1): one matrix product of every tap's weights with the input, whose shifted slices are then summed:
    no unfolded copy of the input, which for a narrow layer over many steps costs more than the product (EnCodec's
    16 -> 8 channels, kernel 3, over 1,280 steps for 8 rows: ~0.26 ms against oneDNN's ~0.6-1.1)."""

    def __init__(self, conv: nn.Conv1d, pad_mode: str, matmul: bool = False, taps: bool = False):
        k, s, d = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
        if conv.padding != (0,):
            raise ValueError("a causal convolution pads by itself: the torch convolution must not")
        if (matmul or taps) and conv.groups != 1:
            raise ValueError("a grouped convolution runs as torch's, not as a matrix product")
        if taps and (matmul or s != 1):
            raise ValueError("taps are for a convolution of stride 1, not computed as one matrix product")
        self.conv = conv
        self.stride, self.span, self.dilation = s, (k - 1) * d + 1, d
        self.padding = self.span - s
        self.pad_mode = pad_mode
        self.matmul, self.taps = matmul, taps

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        if x.shape[-1] % self.stride:
            raise AssertionError("chunk length must be a multiple of the stride")
        new_state: State = ()
        if self.padding:
            x = pad_left(x, self.padding, self.pad_mode) if state is None else torch.cat([state[0], x], dim=-1)
            new_state = (x[..., -self.padding :],)
        if self.taps:
            return self._taps(x), new_state
        if not self.matmul:
            return self.conv(x), new_state
        cols = x.unfold(2, self.span, self.stride)[..., :: self.dilation]  # [B, C, T, k]
        batch, steps = cols.shape[0], cols.shape[2]
        cols = cols.permute(0, 2, 1, 3).reshape(batch * steps, -1)
        w = self.conv.weight
        y = F.linear(cols, w.view(w.shape[0], -1), self.conv.bias)
        return y.view(batch, steps, -1).transpose(1, 2), new_state

    def _taps(self, x: torch.Tensor) -> torch.Tensor:
        w = self.conv.weight  # [C_out, C_in, k]
        c_out, k, steps = w.shape[0], w.shape[2], x.shape[-1] - self.padding
        each = torch.matmul(w.permute(2, 0, 1).reshape(k * c_out, -1), x).view(x.shape[0], k, c_out, -1)
        y = each[:, 0, :, :steps]
        y = y + self.conv.bias[:, None] if self.conv.bias is not None else y.clone()
        for j in range(1, k):
            y += each[:, j, :, j * self.dilation : j * self.dilation + steps]
        return y


class ConvTranspose1dStep:
    """A causal transposed convolution trimmed on the right: keeps the overlap it has not emitted yet.

    `matmul`: each input step's contribution as one matrix product, then overlapped and added (see `Conv1dStep`)."""

    def __init__(self, conv: nn.ConvTranspose1d, matmul: bool = False):
        if conv.padding != (0,) or conv.output_padding != (0,) or conv.dilation != (1,):
            raise ValueError("streaming needs a transposed convolution without padding or dilation")
        if matmul and conv.groups != 1:
            raise ValueError("a grouped transposed convolution runs as torch's, not as a matrix product")
        self.weight, self.bias, self.stride, self.groups = conv.weight, conv.bias, conv.stride[0], conv.groups
        self.overlap = conv.kernel_size[0] - self.stride
        if self.overlap > self.stride:
            raise ValueError("overlap longer than one input step is not supported")
        self.matmul = matmul

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        if self.matmul:
            return self._matmul(x, state)
        y = F.conv_transpose1d(x, self.weight, None, self.stride, groups=self.groups)
        n = x.shape[-1] * self.stride
        if state is not None:
            y[..., : self.overlap] += state[0]
        out = y[..., :n]
        if self.bias is not None:
            out = out + self.bias[:, None]
        return out, (y[..., n:],)

    def _matmul(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        batch, c_in, steps = x.shape
        s, overlap = self.stride, self.overlap
        cols = torch.matmul(x.transpose(1, 2), self.weight.view(c_in, -1)).view(batch, steps, -1, s + overlap)
        out = cols[..., :s].clone()  # [B, T, C, stride]: each step's own samples ...
        tail = cols[..., s:]  # ... and what it adds to the next step's first `overlap`
        if overlap:
            out[:, 1:, :, :overlap] += tail[:, :-1]
            if state is not None:
                out[:, 0, :, :overlap] += state[0]
        y = out.permute(0, 2, 1, 3).reshape(batch, -1, steps * s)
        if self.bias is not None:
            y = y + self.bias[:, None]
        return y, (tail[:, -1],)


class _LSTM:
    """EnCodec's LSTM with its skip connection: torch's fused LSTM on a GPU, stepped by hand on a CPU.

    torch's CPU LSTM (oneDNN) re-packs its weights on every call, which costs more than the step itself when a call
    holds a few frames. There the input projection of all frames is one matmul and each frame one matmul per layer.
    On a GPU that is ~14 kernel launches a frame and layer, 226 of the codec's ~500 a tick (`s2s bench launches`):
    cuDNN's LSTM is one.
    """

    def __init__(self, m: EncodecLSTM):
        lstm = m.lstm
        self.lstm = lstm
        self.layers = [
            (
                getattr(lstm, f"weight_ih_l{i}").T.contiguous(),
                getattr(lstm, f"weight_hh_l{i}").T.contiguous(),
                getattr(lstm, f"bias_ih_l{i}") + getattr(lstm, f"bias_hh_l{i}"),
            )
            for i in range(lstm.num_layers)
        ]
        self.hidden = lstm.hidden_size

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        return self.fused(x, state) if x.is_cuda else self.stepped(x, state)

    def fused(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        seq = x.permute(2, 0, 1)  # [T, B, C], as nn.LSTM (not batch-first) takes it
        start = None if state is None else tuple(s.transpose(0, 1).contiguous() for s in state)  # [layers, B, H]
        out, (h, c) = self.lstm(seq, start)
        return (out + seq).permute(1, 2, 0), (h.transpose(0, 1), c.transpose(0, 1))

    def stepped(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        seq = x.transpose(1, 2)  # [B, T, C]
        batch, steps = seq.shape[0], seq.shape[1]
        if state is None:
            h0 = c0 = seq.new_zeros(batch, len(self.layers), self.hidden)
        else:
            h0, c0 = state
        hs, cs = [], []
        out = seq
        for i, (w_ih, w_hh, bias) in enumerate(self.layers):
            gates_in = torch.addmm(bias, out.reshape(batch * steps, -1), w_ih).view(batch, steps, -1)
            h, c = h0[:, i], c0[:, i]
            outs = []
            for t in range(steps):
                gates = torch.addmm(gates_in[:, t], h, w_hh)
                i_g, f_g, _, o_g = gates.sigmoid().chunk(4, dim=-1)  # (one op for three gates: a frame's ops count)
                c = f_g * c + i_g * torch.tanh(gates[:, 2 * self.hidden : 3 * self.hidden])
                h = o_g * torch.tanh(c)
                outs.append(h)
            out = torch.stack(outs, dim=1)
            hs.append(h)
            cs.append(c)
        return (out + seq).transpose(1, 2), (torch.stack(hs, 1), torch.stack(cs, 1))


class EluStep:
    def __init__(self, alpha: float):
        self.alpha = alpha

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        return F.elu(x, self.alpha), ()


class SequenceStep:
    def __init__(self, layers: Sequence[Step]):
        self.layers = list(layers)

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        new = []
        for i, layer in enumerate(self.layers):
            x, s = layer(x, None if state is None else state[i])
            new.append(s)
        return x, tuple(new)


class ResidualStep:
    """`shortcut(x) + block(x)`, the shortcut the identity when None (SEANet's residual block)."""

    def __init__(self, block: Step, shortcut: Step | None):
        self.block, self.shortcut = block, shortcut

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        h, s_block = self.block(x, None if state is None else state[0])
        if self.shortcut is None:
            return x + h, (s_block, ())
        r, s_short = self.shortcut(x, None if state is None else state[1])
        return r + h, (s_block, s_short)


def _wide(conv: nn.Conv1d | nn.ConvTranspose1d) -> bool:
    """Whether a convolution of EnCodec's streams as one matrix product (`matmul`): those that read many inputs an
    output, the strided convolutions into the lower rates and those at the frame rate, and the transposed one out of
    it. Measured on the shipped codec's layers, a tick's 4 frames on one core at 1 and 8 rows: these took 0.2-0.9x
    oneDNN's time, but at 8 rows the 128 -> 256 channel one, kernel 16, 0.4-1.2x, and the transposed ones at the
    upper rates (kernel 10 and below) 0.9-2.5x."""
    reads = conv.in_channels * conv.kernel_size[0]
    return reads >= 2048 if isinstance(conv, nn.ConvTranspose1d) else reads >= 448


def _tapped(conv: nn.Conv1d) -> bool:
    """Whether a narrow convolution of EnCodec's streams as `Conv1dStep`'s `taps`: of stride 1, a kernel over 1 and
    no wider than its 8 to 64 input channels, over many steps (the residual blocks' first at the three upper rates,
    and the decoder's last). Measured on the shipped codec's, a tick's 4 frames on one core: at 8 rows 0.3-0.8x
    oneDNN's time (the decoder's last, 16 channels to 1 with kernel 7: 0.3), at 1 row 0.4-1.7x; the encoder's first
    (1 channel to 16, kernel 7) took 4x, and the block's at 128 channels over 32 steps 1.3x."""
    k = conv.kernel_size[0]
    return conv.stride[0] == 1 and 1 < k <= conv.in_channels < 128


def _wrap(m: nn.Module) -> Step:
    """EnCodec's transformers layer `m` as a step."""
    from transformers.models.encodec.modeling_encodec import (
        EncodecConv1d,
        EncodecConvTranspose1d,
        EncodecLSTM,
        EncodecResnetBlock,
    )

    if isinstance(m, EncodecConv1d):
        if not m.causal or m.norm_type != "weight_norm":
            raise ValueError("streaming needs causal convolutions without group norm")
        wide = _wide(m.conv)
        return Conv1dStep(m.conv, m.pad_mode, matmul=wide, taps=not wide and _tapped(m.conv))
    if isinstance(m, EncodecConvTranspose1d):
        if not m.causal or m.trim_right_ratio != 1.0 or m.norm_type != "weight_norm":
            raise ValueError("streaming needs causal transposed convolutions trimmed on the right")
        return ConvTranspose1dStep(m.conv, matmul=_wide(m.conv))
    if isinstance(m, EncodecLSTM):
        return _LSTM(m)
    if isinstance(m, EncodecResnetBlock):
        shortcut = None if isinstance(m.shortcut, nn.Identity) else _wrap(m.shortcut)
        return ResidualStep(StreamingNet(m.block), shortcut)
    if isinstance(m, nn.ELU):
        return EluStep(m.alpha)
    raise TypeError(f"no streaming version of {type(m).__name__}")


class StreamingNet(SequenceStep):
    """A SEANet encoder or decoder of transformers' EnCodec as a streaming step function over a batch of rows."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__([_wrap(layer) for layer in layers])
