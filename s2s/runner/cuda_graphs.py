"""DecodeGraphs: the decode step (one new step for each of B conversations) replayed from CUDA graphs.

The models served here are small, and a duplex tick runs several decode rounds, so on a GPU a round is ~210 kernel
launches (`small`, counted by `s2s bench launches`) of microseconds each: the CPU issuing them, not the GPU, sets
the tick time (measured on an H200: one conversation's tick took 60 % of its frame budget in eager mode). As in
vLLM, each batch size of a bucket list is captured once into a graph over static input buffers; a round copies its
inputs into them and replays the graph of the smallest bucket that holds it. Rows past the real batch are padding:
slot -1 (its K/V is not stored), one key (page 0, read and ignored), and their logits are dropped.

The Triton kernels need no host sync on their inputs, which is what makes the step capturable; token ids are checked
on the host before they are copied in (`S2SModel.embed` checks them on the device, a sync a graph cannot hold;
the graph embeds through `embed_checked`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from s2s.runner.batch import PagedBatch
from s2s.runner.transfers import Staging

if TYPE_CHECKING:
    from s2s.models.family import StepModel


def capture(device: torch.device, keys: list, run: Callable) -> tuple[dict, dict]:
    """`run(key)` captured once for each key, in the order given, all in one memory pool (give the largest first:
    later, smaller graphs reuse its blocks), after a warm-up of each on a side stream, which builds the Triton kernels
    and the allocator's blocks. Returns each key's graph and the output its replays write. On `device`, as the
    current one: Triton launches on the current device."""
    graphs, outputs, pool = {}, {}, None
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for key in keys:
                run(key)
        torch.cuda.current_stream(device).wait_stream(side)
        for key in keys:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[key] = run(key)
            pool = graph.pool()
            graphs[key] = graph
        torch.cuda.synchronize(device)
    return graphs, outputs


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to `max_batch` (vLLM's list, cut at the batch this engine can hold)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    """Decode rounds of up to `max_batch` conversations over a page pool, one static graph per bucket size.

    With `capture=False` the same static buffers and padding run eagerly (the CPU path of the tests: it checks
    everything here but the capture itself).
    """

    def __init__(
        self,
        model: StepModel,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        page_size: int,
        max_batch: int,
        max_pages: int,
        capture: bool = True,
    ):
        cfg = model.config
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.page_size, self.max_pages, self.capture = page_size, max_pages, capture
        self.sizes = bucket_sizes(max_batch)
        device = k_caches[0].device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the K/V pool on a CUDA device, not {device}")
        b = self.sizes[-1]
        self.tokens = torch.zeros(b, cfg.step_width, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.rope_positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.long, device=device)
        self.page_table = torch.zeros(b, max_pages, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.seqlens_k = torch.ones(b, dtype=torch.long, device=device)
        self.staging = Staging(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _batch(self, size: int) -> PagedBatch:
        return PagedBatch(
            positions=self.positions[:size],
            rope_positions=self.rope_positions[:size],
            slot_mapping=self.slots[:size],
            page_table=self.page_table[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seqlens_k=self.seqlens_k[:size],
            page_size=self.page_size,
            new_lens=[],
        )

    def _step(self, size: int) -> torch.Tensor:
        """What a graph holds: embed, backbone over pages (K/V stored at the slots), logits; `[size, K, vocab]`."""
        model = self.model
        batch = self._batch(size)
        x = model.embed_checked(self.tokens[:size], batch.rope_positions)
        return model.step_state(model.backbone.forward_paged(x, batch, self.k_caches, self.v_caches))

    @torch.no_grad()
    def _capture_all(self) -> None:
        self.graphs, self.logits = capture(self.tokens.device, self.sizes[::-1], self._step)

    def fits(self, num_seqs: int, table: np.ndarray) -> bool:
        return num_seqs <= self.sizes[-1] and table.shape[1] <= self.max_pages

    def run(
        self,
        tokens: np.ndarray,
        cached_lens: np.ndarray,
        table: np.ndarray,
        lengths: np.ndarray,
        shifts: np.ndarray | None = None,
        fill: Callable[[torch.Tensor, Callable[[str, np.ndarray], torch.Tensor]], None] | None = None,
    ) -> torch.Tensor:
        """One decode round: `tokens[s]` `[2K]` is sequence s's new step, written at position `cached_lens[s]` of
        its pages (`table[s]`, `lengths[s]` of them: `page_table`), at position `cached_lens[s] + shifts[s]` for
        RoPE (`PagedBatch`); `fill(tokens, to_device)` then writes codes still on the device into the steps' tokens
        there (`[S, 2K]`). The inputs go in through `Staging`: the host does not wait for the device. Returns the
        logits `[S, K, vocab]` (a copy: the graph's output buffer is reused)."""
        n = len(cached_lens)
        vocab = self.model.config.vocab_size
        if tokens.shape != (n, self.model.config.step_width):
            raise ValueError(f"need [{n}, {self.model.config.step_width}] step tokens, got {list(tokens.shape)}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            raise ValueError(f"step tokens must lie in [0, {vocab})")
        if not self.fits(n, table):
            raise ValueError(f"{n} sequences or {table.shape[1]} pages exceed the captured buffers")
        pos = np.asarray(cached_lens, dtype=np.int64)
        if (short := np.flatnonzero(np.asarray(lengths) * self.page_size <= pos)).size:
            raise ValueError(f"sequences {short.tolist()} have no page for their new step")
        size = next(s for s in self.sizes if s >= n)
        # only the columns this round reads: the kernel never looks past a sequence's length, so what earlier rounds
        # left further right is never read
        table = np.pad(table, ((0, size - n), (0, 0)))  # padding rows: page 0
        slots = np.full(size, -1, dtype=np.int64)
        slots[:n] = table[np.arange(n), pos // self.page_size].astype(np.int64) * self.page_size + pos % self.page_size
        seqlens = np.ones(size, dtype=np.int64)
        seqlens[:n] = pos + 1
        padded_pos = np.zeros(size, dtype=np.int64)
        padded_pos[:n] = pos
        rope = padded_pos.copy()
        rope[:n] += np.asarray(shifts if shifts is not None else [0] * n, dtype=np.int64)
        padded_tokens = np.zeros((size, tokens.shape[1]), dtype=np.int64)
        padded_tokens[:n] = tokens
        self.staging.begin()
        try:
            for name, dst, src in (
                ("tokens", self.tokens, padded_tokens),
                ("positions", self.positions, padded_pos),
                ("rope", self.rope_positions, rope),
                ("slots", self.slots, slots),
                ("table", self.page_table[:, : table.shape[1]], table),
                ("seqlens", self.seqlens_k, seqlens),
            ):
                self.staging.copy(name, dst[:size], src)
            if fill is not None:
                fill(self.tokens[:n], self.staging.to_device)
        finally:
            self.staging.end()
        if self.capture:
            self.graphs[size].replay()
            return self.logits[size][:n].clone()
        return self._step(size)[:n]
