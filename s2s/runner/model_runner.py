"""ModelRunner: one round's batched forward over the page pool, and its sampling (each from CUDA graphs, or eager)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import torch

from cache import PagePool
from paged_kernels import batch_invariant as batch_invariant_kernels
from s2s.models.family import StepModel
from s2s.runner.batch import PagedBatch, page_table, stack_tables
from s2s.runner.cuda_graphs import DecodeGraphs
from s2s.scheduling.context import model_window_pages
from s2s.scheduling.round_batch import RoundBatch


class ModelRunner:
    """`batch_invariant`: every forward through the batch-invariant kernels (`paged_kernels/batch_invariant.py`), so
    that a step's logits and K/V do not depend on what else is in its batch or on its chunk; no CUDA graphs."""

    def __init__(self, model: StepModel, pool: PagePool, max_batch: int, cuda_graphs: bool, batch_invariant: bool):
        self.model, self.pool, self.batch_invariant = model, pool, batch_invariant
        self.device = pool.k[0].device
        if batch_invariant:
            batch_invariant_kernels.check(pool.k[0])
        self.graphs, self.sampler = None, None
        if cuda_graphs and not batch_invariant and self.device.type == "cuda":
            cfg = model.config
            max_pages = math.ceil(cfg.max_position_embeddings / pool.page_size)  # what a window may see
            if cfg.sliding_window is not None:  # the model's own window: the pages its steps reach (`ContextBound`)
                max_pages = model_window_pages(cfg.sliding_window, pool.page_size)
            self.graphs = DecodeGraphs(model, pool.k, pool.v, pool.page_size, max_batch, max_pages=max_pages)
            self.sampler = model.head_graphs(max_batch, self.device)
        if self.device.type == "cuda":
            with self.on_device():
                self.warm_up_prefill()

    def on_device(self) -> contextlib.AbstractContextManager:
        """The pool's GPU as the thread's current one: Triton launches and CUDA graphs go to the current device,
        which is per thread and cuda:0 unless set. On a CPU, denormal floats flushed to zero in the thread meanwhile
        (`flushing_denormals`)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else flushing_denormals()

    @torch.inference_mode()
    def warm_up_prefill(self) -> None:
        """Run the attention kernel's prefill variants once, storing nothing: Triton builds a kernel the first time
        it sees a tile shape, which takes seconds, and a turn's prefill in service must not wait for it (decode
        rounds warm up with the graphs and in calibration). The tile's rows are new steps per sequence times the
        query heads sharing a K/V head, rounded to 16, 32 or 64: these three step counts reach each of them."""
        ps, cfg = self.pool.page_size, self.model.config
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        for steps in (1, max(1, 32 // group), 64):
            batch = PagedBatch(
                positions=torch.arange(steps, device=self.device),
                rope_positions=torch.arange(steps, device=self.device),
                slot_mapping=torch.full((steps,), -1, dtype=torch.long, device=self.device),
                page_table=torch.zeros(1, -(-steps // ps), dtype=torch.int32, device=self.device),
                cu_seqlens_q=torch.tensor([0, steps], dtype=torch.int32, device=self.device),
                seqlens_k=torch.tensor([steps], device=self.device),
                page_size=ps,
                new_lens=[steps],
            )
            tokens = torch.zeros(steps, cfg.step_width, dtype=torch.long, device=self.device)
            self.model.forward_paged(tokens, batch, self.pool.k, self.pool.v)

    @torch.inference_mode()
    def attend(self, rows: int, keys: int) -> None:
        """A forward of `rows` decode steps, each over `keys` steps of context in pages of its own across the pool,
        storing nothing (the pages hold whatever they hold): what reading keys costs (calibration's `key_seconds`)."""
        ps, pool_pages = self.pool.page_size, self.pool.k[0].shape[0]
        count = -(-keys // ps)
        order = np.random.default_rng(0).permutation(np.arange(1, pool_pages))  # scattered, as a pool's pages get
        pages = np.resize(order, rows * count).reshape(rows, count)
        batch = PagedBatch.build([keys - 1] * rows, [1] * rows, pages.tolist(), ps, self.device)
        batch.slot_mapping.fill_(-1)
        tokens = torch.zeros(rows, self.model.config.step_width, dtype=torch.long, device=self.device)
        with self.on_device():
            self.model.forward_paged(tokens, batch, self.pool.k, self.pool.v, self.batch_invariant)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(self, batch: RoundBatch) -> torch.Tensor:
        """Logits `[len(batch), K, V]` of each piece of work's last step, then of each lane row's step; K/V of every
        step go into its pages."""
        work, lane = batch.work, batch.lane
        visible = [w.session.visible() for w in work]
        tokens = np.concatenate([w.tokens for w in work] + ([lane.tokens] if lane is not None else []))
        cached = np.array([v[1] for v in visible], dtype=np.int64)
        shifts = np.array([v[2] for v in visible], dtype=np.int64)
        new_lens = np.fromiter((len(w.tokens) for w in work), dtype=np.int64, count=len(work))
        lengths = np.fromiter((len(v[0]) for v in visible), dtype=np.int64, count=len(work))
        table = page_table([v[0] for v in visible])
        if lane is not None:
            cached, shifts = np.concatenate([cached, lane.cached]), np.concatenate([shifts, lane.shifts])
            new_lens = np.concatenate([new_lens, np.ones(len(lane), dtype=np.int64)])
            lengths = np.concatenate([lengths, lane.lengths])
            table = stack_tables(table, lane.table)
        batch.keys = int((cached + 1)[new_lens == 1].sum())  # decode steps' keys: the cost model's `key_seconds`
        fill = None  # (the lane's rows are the last)
        if lane is not None and lane.fill is not None:
            fill = lambda tokens, to_device: lane.fill_into(tokens[len(tokens) - len(lane) :], to_device)  # noqa: E731
        if self.graphs is not None and len(tokens) == len(new_lens) and self.graphs.fits(len(new_lens), table):
            return self.graphs.run(tokens, cached, table, lengths, shifts, fill)
        paged = PagedBatch.from_table(cached, new_lens, table, lengths, self.pool.page_size, self.device, shifts)
        device_tokens = torch.from_numpy(tokens).to(self.device)
        if fill is not None:
            fill(device_tokens, lambda name, array: torch.from_numpy(array).to(self.device))
        out = self.model.forward_paged(device_tokens, paged, self.pool.k, self.pool.v, self.batch_invariant)
        return out.state

    def sample(self, batch: RoundBatch) -> torch.Tensor | None:
        """The next step's codes `[S, K]` of the rows the batch samples (`RoundBatch.sampling`), each with its own
        settings and stream, on the logits' device (copying them to the host waits for the device); None: none."""
        logits, params, streams = batch.sampling()
        if logits is None:
            return None
        if self.sampler is not None and self.sampler.fits(len(logits)):
            return self.sampler.run(logits, params, streams)
        return self.model.head(logits, params, streams)


@contextlib.contextmanager
def flushing_denormals() -> Iterator[None]:
    """Denormal floats read and made as zeros by the calling thread's ops (x86's FTZ and DAZ; torch's other threads
    keep their own mode). The echo model's planted circuits make a few (the tails of its sharp softmaxes and SiLUs),
    and a CPU multiplies by a denormal through a microcode assist: an `[8, 384] x [384, 512]` matmul with ten of
    them in its input ran 9x slower (40 against 370 us). What it changes is below 1e-38."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
