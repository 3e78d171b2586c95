"""Copies between the host and the device that do not wait for the device, so that the host can prepare a round
while the device computes the last one (as vLLM's async scheduling and SGLang's overlap scheduler do).

A plain `copy_` from host memory to CUDA waits for everything queued before it, and `.cpu()` for everything queued
before the copy. `Staging` copies host arrays in through pinned buffers with `non_blocking`; `HostCopy` starts a
tensor's copy out into pinned memory at once and waits for it only when read. On a CPU both are plain copies.
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """Host arrays into device tensors through pinned buffers, a round's worth between `begin` and `end`.

    `begin` waits for the event `end` recorded after the last round's copies: until the device has taken them out
    of the pinned buffers (not until it is idle), so that writing the buffers again cannot change what a queued
    copy reads (vLLM's `prepare_inputs_event`)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.pinned: dict[str, torch.Tensor] = {}  # name -> its pinned buffer, grown as needed
        self.on_device: dict[str, torch.Tensor] = {}  # name -> its device buffer (`to_device`)
        self.event = torch.cuda.Event() if self.cuda else None

    def begin(self) -> None:
        if self.event is not None:
            self.event.synchronize()  # (at once if nothing was recorded yet)

    def end(self) -> None:
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))  # (the copies' stream, whatever is current)

    def copy(self, name: str, dst: torch.Tensor, src: np.ndarray) -> None:
        """`src` into `dst` (on the device, of `src`'s shape), in the stream's order, without waiting for it."""
        if not self.cuda:
            dst.copy_(torch.from_numpy(src))
            return
        dst.copy_(self._pinned(name, src), non_blocking=True)

    def to_device(self, name: str, src: np.ndarray) -> torch.Tensor:
        """`src` on the device, in a buffer of `name`'s that the next round's copy under that name overwrites."""
        if not self.cuda:
            return torch.from_numpy(src).to(self.device)
        buffer = self.on_device.get(name)
        if buffer is None or buffer.numel() < src.size or buffer.dtype != _dtype(src):
            with torch.inference_mode(False):  # (made in a tick's inference mode, it could not be written outside)
                buffer = torch.empty(_grown(buffer, src), dtype=_dtype(src), device=self.device)
            self.on_device[name] = buffer
        out = buffer[: src.size].view(src.shape)
        out.copy_(self._pinned(name, src), non_blocking=True)
        return out

    def _pinned(self, name: str, src: np.ndarray) -> torch.Tensor:
        buffer = self.pinned.get(name)
        if buffer is None or buffer.numel() < src.size or buffer.dtype != _dtype(src):
            buffer = self.pinned[name] = torch.empty(_grown(buffer, src), dtype=_dtype(src), pin_memory=True)
        view = buffer[: src.size].view(src.shape)
        view.numpy()[...] = src
        return view


class HostCopy:
    """A device tensor's copy to the host, started at once (on CUDA: into pinned memory, then an event); `numpy()`
    waits for that copy only, not for what was queued after it."""

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(tensor.device))
        else:
            self.host = tensor

    def numpy(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()


def _grown(buffer: torch.Tensor | None, src: np.ndarray) -> int:
    """A buffer's new size: `src`'s, or twice the old one's, so that a growing input reallocates it seldom."""
    return max(src.size, 1, 2 * buffer.numel() if buffer is not None and buffer.dtype == _dtype(src) else 0)


def _dtype(array: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
