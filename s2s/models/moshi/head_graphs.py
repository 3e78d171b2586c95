"""HeadGraphs: Moshi's step head (the text token, then the depformer's codebooks) for a whole round, replayed from
CUDA graphs, one per batch bucket.

A round's head is `1 + dep_q` samplings and `dep_q` depformer passes of a few layers each: hundreds of small
launches, every round. Here each bucket size runs one fixed sequence of ops over static buffers: the temporal
outputs, each row's key for the step and its audio and text settings as tensors (`sample_static`), and the
depformer's per-step K/V, which the graph allocates from its own pool. Rows past the real batch are padding. It
chooses what `MoshiLM.head` does, row for row, but where logits tie at a row's top-k cut (`sample_static`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from s2s.runner import cuda_graphs
from s2s.runner.sampling import RandomStream, SamplingParams, sample_static, stream_keys
from s2s.runner.transfers import Staging


class HeadGraphs:
    """With `capture=False` the same static buffers and padding run eagerly (the CPU path of the tests)."""

    def __init__(self, model, max_batch: int, device: torch.device | str, capture: bool = True):
        device = torch.device(device)
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model, self.capture = model, capture
        self.sizes = cuda_graphs.bucket_sizes(max_batch)
        b, dtype = self.sizes[-1], model.text_head.dtype
        self.state = torch.zeros(b, model.moshi.dim, dtype=dtype, device=device)
        self.keys = torch.zeros(b, dtype=torch.int64, device=device)
        self.settings = {  # (audio, text) x (temperature, top_k, top_p)
            name: torch.zeros(b, dtype=torch.int64 if "top_k" in name else torch.float32, device=device)
            for name in ("temperature", "top_k", "top_p", "text_temperature", "text_top_k", "text_top_p")
        }
        self.staging = Staging(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.codes: dict[int, torch.Tensor] = {}
        if capture:
            with torch.no_grad():
                self.graphs, self.codes = cuda_graphs.capture(device, self.sizes[::-1], self._head)

    def _head(self, size: int) -> torch.Tensor:
        model, s = self.model, {k: v[:size] for k, v in self.settings.items()}
        state, keys = self.state[:size], self.keys[:size]
        logits = F.linear(state, model.text_head)[:, None]
        text = sample_static(logits, keys, s["text_temperature"], s["text_top_k"], s["text_top_p"])[:, 0]
        codes, previous, cache = [text], text, model.depformer.new_cache(size)
        for k in range(model.moshi.dep_q):
            logits = model.depformer.step(state, k, previous, cache)[:, None]
            previous = sample_static(logits, keys, s["temperature"], s["top_k"], s["top_p"], None, 1 + k)[:, 0]
            codes.append(previous)
        return torch.stack(codes, 1)

    def fits(self, num_rows: int) -> bool:
        return num_rows <= self.sizes[-1]

    def run(self, state: torch.Tensor, params: list[SamplingParams], streams: list[RandomStream]) -> torch.Tensor:
        """`MoshiLM.head`: the next step's codes `[S, 1 + dep_q]` (each stream counts one draw)."""
        n = len(state)
        if len(params) != n or len(streams) != n:
            raise ValueError(f"{n} rows but {len(params)} params and {len(streams)} streams")
        if not self.fits(n):
            raise ValueError(f"{n} rows exceed the captured buffers ({self.sizes[-1]})")
        size = next(s for s in self.sizes if s >= n)
        self.state[:n].copy_(state)
        text = [self.model._text_params(p) for p in params]
        self.staging.begin()
        try:
            self.staging.copy("keys", self.keys[:n], stream_keys(streams).numpy())
            for prefix, rows in (("", params), ("text_", text)):
                for name, dtype in (("temperature", np.float32), ("top_k", np.int64), ("top_p", np.float32)):
                    values = np.array([getattr(p, name) for p in rows], dtype=dtype)
                    self.staging.copy(prefix + name, self.settings[prefix + name][:n], values)
        finally:
            self.staging.end()
        if self.capture:
            self.graphs[size].replay()
            return self.codes[size][:n].clone()
        return self._head(size)[:n]
