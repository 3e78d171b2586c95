"""A linear layer that multiplies only its weight's nonzero block, for weights mostly of exact zeros.

The shipped echo's weights are a planted circuit: 84 % of them are zeros, and most projections use a few of their
rows and columns (layer 0's query reads one input column; the heads read 57 of 384). On a CPU a decode round at a
few rows is bound by reading weights (2 to 6 GB/s from a shared L3 on the 2-core VMs), so multiplying the dense
14 MB every round costs what multiplying its 1.4 MB nonzero block need not. `linear` keeps, per weight, its nonzero
rows and columns as one dense block: the input's columns selected, the block multiplied, the rows scattered into
zeros. A dense weight (every preset's, Moshi's) is multiplied as it is. The products are the same; only the order
in which MKL sums a row's nonzero terms may differ (float rounding), and a NaN or an infinity in an input column no
weight reads gives 0 where the dense product gives NaN.

The block is made on a weight's first use and made again when the weight is another tensor, or changed in place (its
version counter), on the CPU only (finding the block syncs a GPU, which a CUDA graph's capture forbids) and outside
autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

WORTH = 0.5  # the block's share of the weights under which the block is used


class Block:
    """Weights `[out_i, in]` that read one input, stacked: their nonzero rows and columns as one dense block, and
    those rows' and columns' indices (None: all of them)."""

    def __init__(self, weights: tuple[torch.Tensor, ...]):
        self.signatures = [_signature(w) for w in weights]
        self.sizes = [w.shape[0] for w in weights]
        # (made outside inference mode, as `Rotary.inv_freq` is: an engine's tick may make it, and a later forward
        # with autograd may read it)
        with torch.inference_mode(False), torch.no_grad():
            nonzero = torch.cat([w.ne(0) for w in weights])
            rows, cols = nonzero.any(1).nonzero().flatten(), nonzero.any(0).nonzero().flatten()
            self.dense = len(rows) * len(cols) > WORTH * nonzero.numel()
            self.rows = None if self.dense or len(rows) == nonzero.shape[0] else rows
            self.cols = None if self.dense or len(cols) == nonzero.shape[1] else cols
            # (a copy, never a weight: the weights are weak keys)
            self.block = None if self.dense else torch.cat(weights)[rows][:, cols].contiguous()

    def fits(self, weights: tuple[torch.Tensor, ...]) -> bool:
        """Made from these weights as they are now: the same memory, layout and type, none changed in place since
        (through autograd's version counter: an edit through `.data` is not seen)."""
        return self.signatures == [_signature(w) for w in weights]

    def __call__(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.block is None:
            return tuple(F.linear(x, w) for w in weights)
        if self.cols is not None:
            x = x.index_select(-1, self.cols)
        y = F.linear(x, self.block)
        if self.rows is not None:
            y = y.new_zeros(*y.shape[:-1], sum(self.sizes)).index_copy_(-1, self.rows, y)
        return y.split(self.sizes, -1) if len(self.sizes) > 1 else (y,)


_blocks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # by the first weight (a view's base: views are made per call)


def linears(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, w)` for each weight, as one product of their nonzero `Block` where that is under `WORTH` of
    them (one product, not one each: a few ops a round fewer), else as they are. The weights keep their order.
    Dense products on a GPU, under autograd, and for inference tensors (which carry no version counter, so an edit
    in place would go unseen)."""
    first = weights[0]
    if (
        first.device.type != "cpu"
        or (torch.is_grad_enabled() and any(w.requires_grad for w in weights))
        or any(w.is_inference() for w in weights)
    ):
        return tuple(F.linear(x, w) for w in weights)
    key = first if first._base is None else first._base
    block = _blocks.get(key)
    if block is None or not block.fits(weights):
        block = _blocks[key] = Block(weights)
    return block(x, weights)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` through its nonzero block (`linears`)."""
    return linears(x, weight)[0]


def _signature(weight: torch.Tensor) -> tuple:
    """What a block made from `weight` depends on: its memory, layout, type and in-place change count."""
    return (
        weight.data_ptr(),
        weight.storage_offset(),
        weight.shape,
        weight.stride(),
        weight.dtype,
        weight.device,
        weight._version,
    )
