"""PagedBatch: what one batched forward needs to read and write K/V through a page table.

A batch holds S sequences; sequence s brings `new_len` new steps on top of `cached_len` steps whose K/V already sit
in its pages. Decode is `new_len == 1`, extend (prefill of a prompt or a turn, on top of a cached prefix) is more.
A step's place in its pages (`positions`: where attention and the slots count from) and its position for RoPE
(`rope_positions`) differ by its sequence's `shift`: the steps a bounded context left out (`s2s/scheduling/context.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PagedBatch:
    positions: torch.Tensor  # [N] each new step's place in its sequence's pages
    rope_positions: torch.Tensor  # [N] its position in the conversation (RoPE)
    slot_mapping: torch.Tensor  # [N] page * page_size + offset where its K/V goes
    page_table: torch.Tensor  # [S, max_pages] int32
    cu_seqlens_q: torch.Tensor  # [S + 1] offsets of each sequence's new tokens
    seqlens_k: torch.Tensor  # [S] cached + new steps
    page_size: int
    new_lens: list[int]

    @classmethod
    def build(
        cls,
        cached_lens: Sequence[int],
        new_lens: Sequence[int],
        pages: Sequence[Sequence[int]],
        page_size: int,
        device: str | torch.device = "cpu",
        shifts: Sequence[int] | None = None,
    ) -> PagedBatch:
        """`pages[s]` must cover `cached_lens[s] + new_lens[s]` steps; pages a sliding window dropped may be 0.
        `shifts[s]` (default 0) is added to sequence s's positions for RoPE."""
        if not (len(cached_lens) == len(new_lens) == len(pages)) or not pages:
            raise ValueError("cached_lens, new_lens and pages must be non-empty and of equal length")
        lengths = np.fromiter(map(len, pages), dtype=np.int64, count=len(pages))
        return cls.from_table(cached_lens, new_lens, page_table(pages), lengths, page_size, device, shifts)

    @classmethod
    def from_table(
        cls,
        cached_lens: Sequence[int] | np.ndarray,
        new_lens: Sequence[int] | np.ndarray,
        table: np.ndarray,
        lengths: np.ndarray,
        page_size: int,
        device: str | torch.device = "cpu",
        shifts: Sequence[int] | np.ndarray | None = None,
    ) -> PagedBatch:
        """`build` from a `page_table` and each row's page count, checked as whole arrays (hundreds of rows)."""
        cached, new = np.asarray(cached_lens, dtype=np.int64), np.asarray(new_lens, dtype=np.int64)
        if not (len(cached) == len(new) == len(table) == len(lengths)) or not len(new):
            raise ValueError("cached_lens, new_lens, table and lengths must be non-empty and of equal length")
        if (new < 1).any() or (cached < 0).any():
            raise ValueError(f"each sequence needs >= 1 new step and >= 0 cached ones, got {new} and {cached}")
        if (short := np.flatnonzero(lengths * page_size < cached + new)).size:
            s = int(short[0])
            raise ValueError(f"{lengths[s]} pages of {page_size} cannot hold {cached[s] + new[s]} steps")
        # on the host in numpy, then each array in one copy: a few dozen elements, where a torch op's dispatch costs
        # more than its work
        cu = np.zeros(len(new) + 1, dtype=np.int32)
        cu[1:] = new.cumsum()
        seq = np.repeat(np.arange(len(new)), new)
        positions = np.arange(int(cu[-1])) - cu[:-1][seq] + cached[seq]
        shift = np.zeros(len(new), dtype=np.int64) if shifts is None else np.asarray(shifts, dtype=np.int64)
        rope = positions + shift[seq]
        slots = table[seq, positions // page_size].astype(np.int64) * page_size + positions % page_size

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        return cls(
            positions=to_device(positions),
            rope_positions=to_device(rope),
            slot_mapping=to_device(slots),
            page_table=to_device(table),
            cu_seqlens_q=to_device(cu),
            seqlens_k=to_device(cached + new),
            page_size=page_size,
            new_lens=new.tolist(),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.new_lens)

    def per_query(self) -> PagedBatch:
        """The same new steps, each as a one-step sequence of its own that sees the keys up to its position: the
        decode form, in which attention computes a query the same way whatever chunk or batch it came in."""
        q_lens = self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]
        seqs = [s for s, n in enumerate(self.new_lens) for _ in range(n)]
        return PagedBatch(
            positions=self.positions,
            rope_positions=self.rope_positions,
            slot_mapping=self.slot_mapping,
            page_table=self.page_table.repeat_interleave(q_lens, dim=0),
            cu_seqlens_q=torch.arange(len(seqs) + 1, dtype=self.cu_seqlens_q.dtype, device=self.positions.device),
            seqlens_k=self.positions + 1,
            page_size=self.page_size,
            new_lens=[1] * len(seqs),
        )


def page_table(pages: Sequence[Sequence[int]], rows: int | None = None) -> np.ndarray:
    """The sequences' page lists as one `[rows, longest]` int32 table (`rows` defaults to one per list), zeros past
    each list's end: filled through one flat array, not row by row (hundreds of rows a round)."""
    rows = len(pages) if rows is None else rows
    if rows < len(pages):
        raise ValueError(f"{len(pages)} page lists do not fit in {rows} rows")
    lengths = np.fromiter(map(len, pages), dtype=np.int64, count=len(pages))
    table = np.zeros((rows, int(lengths.max(initial=0))), dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(pages), dtype=np.int32, count=int(lengths.sum()))
    table[: len(pages)][np.arange(table.shape[1]) < lengths[:, None]] = flat
    return table


def stack_tables(top: np.ndarray, bottom: np.ndarray) -> np.ndarray:
    """Two page tables as one, `top`'s rows first; the narrower is padded with zeros."""
    table = np.zeros((len(top) + len(bottom), max(top.shape[1], bottom.shape[1])), dtype=np.int32)
    table[: len(top), : top.shape[1]] = top
    table[len(top) :, : bottom.shape[1]] = bottom
    return table
