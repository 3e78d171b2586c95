"""SamplingGraphs: a round's sampling replayed from CUDA graphs, one per batch bucket.

`sample` picks its ops on the host from the rows' settings (greedy, top-k, nucleus): on a GPU that is dozens of
launches a round, as many as the decode step's graph saves. Here every round runs `sample_static`, one fixed
sequence of ops over each row's settings as tensors, captured once per bucket size (`bucket_sizes`, as the decode
graphs) over static buffers: a round copies in its logits, keys and settings and replays. Rows past the real batch
are padding; their codes are dropped. It chooses what `sample` chooses, stream for stream, but where logits tie at a
row's top-k cut (`sample_static`).
"""

from __future__ import annotations

import numpy as np
import torch

from s2s.runner.cuda_graphs import bucket_sizes, capture
from s2s.runner.sampling import RandomStream, SamplingParams, sample_static, stream_keys
from s2s.runner.transfers import Staging


class SamplingGraphs:
    """Sampling of up to `max_batch` rows of logits `[K, vocab]`, one static graph per bucket size.

    With `capture=False` the same static buffers and padding run eagerly (the CPU path of the tests: it checks
    everything here but the capture itself)."""

    def __init__(
        self,
        max_batch: int,
        num_codebooks: int,
        vocab: int,
        banned_id: int | None,
        device: torch.device | str,
        capture: bool = True,
    ):
        device = torch.device(device)
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.banned_id, self.capture = banned_id, capture
        self.sizes = bucket_sizes(max_batch)
        b = self.sizes[-1]
        self.logits = torch.zeros(b, num_codebooks, vocab, dtype=torch.float32, device=device)
        self.keys = torch.zeros(b, dtype=torch.int64, device=device)
        self.temperature = torch.zeros(b, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(b, dtype=torch.int64, device=device)
        self.top_p = torch.ones(b, dtype=torch.float32, device=device)
        self.staging = Staging(device)  # (the settings go in without waiting for the device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.codes: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _sample(self, size: int) -> torch.Tensor:
        return sample_static(
            self.logits[:size],
            self.keys[:size],
            self.temperature[:size],
            self.top_k[:size],
            self.top_p[:size],
            self.banned_id,
        )

    @torch.no_grad()
    def _capture_all(self) -> None:
        self.graphs, self.codes = capture(self.logits.device, self.sizes[::-1], self._sample)

    def fits(self, num_rows: int) -> bool:
        return num_rows <= self.sizes[-1]

    def run(self, logits: torch.Tensor, params: list[SamplingParams], streams: list[RandomStream]) -> torch.Tensor:
        """The next step's codes `[S, K]` from logits `[S, K, vocab]`, each row with its own settings and stream
        (each stream counts one draw), as `sample` gives them, on the device (a copy: the graph's buffer is
        reused)."""
        n = len(logits)
        if len(params) != n or len(streams) != n:
            raise ValueError(f"{n} rows but {len(params)} params and {len(streams)} streams")
        if logits.shape[1:] != self.logits.shape[1:]:
            raise ValueError(f"need logits [S, {', '.join(map(str, self.logits.shape[1:]))}], got {list(logits.shape)}")
        if not self.fits(n):
            raise ValueError(f"{n} rows exceed the captured buffers ({self.sizes[-1]})")
        size = next(s for s in self.sizes if s >= n)
        self.logits[:n].copy_(logits)
        self.staging.begin()
        try:
            for name, dst, src in (
                ("keys", self.keys, stream_keys(streams).numpy()),
                ("temperature", self.temperature, np.array([p.temperature for p in params], dtype=np.float32)),
                ("top_k", self.top_k, np.array([p.top_k for p in params], dtype=np.int64)),
                ("top_p", self.top_p, np.array([p.top_p for p in params], dtype=np.float32)),
            ):
                self.staging.copy(name, dst[:n], src)
        finally:
            self.staging.end()
        if self.capture:
            self.graphs[size].replay()
            return self.codes[size][:n].clone()
        return self._sample(size)[:n]
