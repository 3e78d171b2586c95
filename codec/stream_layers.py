"""EnCodec's SEANet layers as pure streaming steps: each transformers layer wrapped (sharing its weights) as
`layer(x, state) -> (y, new_state)`, where `state=None` starts a stream and pads its left edge exactly as transformers
does (see `codec/streaming.py` for how the encoder and decoder use them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.encodec.modeling_encodec import (
    EncodecConv1d,
    EncodecConvTranspose1d,
    EncodecLSTM,
    EncodecResnetBlock,
)

State = tuple  # nested tuples of tensors, batch row first


class _Conv1d:
    def __init__(self, m: EncodecConv1d):
        if not m.causal or m.norm_type != "weight_norm":
            raise ValueError("streaming needs causal convolutions without group norm")
        self.conv = m.conv
        k, s, d = m.conv.kernel_size[0], m.conv.stride[0], m.conv.dilation[0]
        self.stride = s
        self.padding = (k - 1) * d + 1 - s
        self.pad_mode = m.pad_mode

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        if x.shape[-1] % self.stride:
            raise AssertionError("chunk length must be a multiple of the stride")
        if self.padding == 0:
            return self.conv(x), ()
        if state is None:
            x = EncodecConv1d._pad1d(x, (self.padding, 0), mode=self.pad_mode)
        else:
            x = torch.cat([state[0], x], dim=-1)
        return self.conv(x), (x[..., -self.padding :],)


class _ConvTranspose1d:
    def __init__(self, m: EncodecConvTranspose1d):
        if not m.causal or m.trim_right_ratio != 1.0 or m.norm_type != "weight_norm":
            raise ValueError("streaming needs causal transposed convolutions trimmed on the right")
        conv = m.conv
        self.weight, self.bias, self.stride = conv.weight, conv.bias, conv.stride[0]
        self.overlap = conv.kernel_size[0] - self.stride
        if self.overlap > self.stride:
            raise ValueError("overlap longer than one input step is not supported")

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        y = F.conv_transpose1d(x, self.weight, None, self.stride)
        n = x.shape[-1] * self.stride
        if state is not None:
            y[..., : self.overlap] += state[0]
        out = y[..., :n]
        if self.bias is not None:
            out = out + self.bias[:, None]
        return out, (y[..., n:],)


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
                i_g, f_g, g_g, o_g = gates.chunk(4, dim=-1)
                c = torch.sigmoid(f_g) * c + torch.sigmoid(i_g) * torch.tanh(g_g)
                h = torch.sigmoid(o_g) * torch.tanh(c)
                outs.append(h)
            out = torch.stack(outs, dim=1)
            hs.append(h)
            cs.append(c)
        return (out + seq).transpose(1, 2), (torch.stack(hs, 1), torch.stack(cs, 1))


class _ELU:
    def __init__(self, m: nn.ELU):
        self.alpha = m.alpha

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        return F.elu(x, self.alpha), ()


class _Sequence:
    def __init__(self, layers: Sequence[nn.Module]):
        self.layers = [_wrap(layer) for layer in layers]

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        new = []
        for i, layer in enumerate(self.layers):
            x, s = layer(x, None if state is None else state[i])
            new.append(s)
        return x, tuple(new)


class _ResnetBlock:
    def __init__(self, m: EncodecResnetBlock):
        self.block = _Sequence(m.block)
        self.shortcut = None if isinstance(m.shortcut, nn.Identity) else _wrap(m.shortcut)

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        h, s_block = self.block(x, None if state is None else state[0])
        if self.shortcut is None:
            return x + h, (s_block, ())
        r, s_short = self.shortcut(x, None if state is None else state[1])
        return r + h, (s_block, s_short)


def _wrap(m: nn.Module) -> Callable[[torch.Tensor, State | None], tuple[torch.Tensor, State]]:
    for kind, wrapper in (
        (EncodecConv1d, _Conv1d),
        (EncodecConvTranspose1d, _ConvTranspose1d),
        (EncodecLSTM, _LSTM),
        (EncodecResnetBlock, _ResnetBlock),
        (nn.ELU, _ELU),
    ):
        if isinstance(m, kind):
            return wrapper(m)
    raise TypeError(f"no streaming version of {type(m).__name__}")


class StreamingNet(_Sequence):
    """A SEANet encoder or decoder as a streaming step function over a batch of rows."""
