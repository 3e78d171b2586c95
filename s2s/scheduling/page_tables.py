"""PageTables: every live session's page table as a row of one array, kept by `KVManager` as it changes each
session's `pages`, so that a round's tables for hundreds of rows are one gather (`DuplexLane`), not a rebuild from
each session's list (which grows with its context)."""

from __future__ import annotations

import numpy as np


class PageTables:
    def __init__(self, rows: int):
        self.array = np.zeros((rows, 16), dtype=np.int32)  # row r: session r's pages, then zeros
        self.lengths = np.zeros(rows, dtype=np.int64)

    def set(self, row: int, pages: list[int]) -> None:
        self._reserve(len(pages))
        self.array[row, : len(pages)] = pages
        self.array[row, len(pages) :] = 0
        self.lengths[row] = len(pages)

    def append(self, row: int, pages: list[int]) -> None:
        n = int(self.lengths[row])
        self._reserve(n + len(pages))
        self.array[row, n : n + len(pages)] = pages
        self.lengths[row] = n + len(pages)

    def append_each(self, rows: np.ndarray, pages: list[int]) -> None:
        """Page `pages[i]` onto row `rows[i]`'s table (distinct rows)."""
        lengths = self.lengths[rows]
        self._reserve(int(lengths.max(initial=0)) + 1)
        self.array[rows, lengths] = pages
        self.lengths[rows] = lengths + 1

    def delete(self, row: int, start: int, count: int) -> None:
        """Pages `start .. start + count - 1` leave the row's table; those after them move up."""
        n = int(self.lengths[row])
        self.array[row, start : n - count] = self.array[row, start + count : n]
        self.array[row, n - count : n] = 0
        self.lengths[row] = n - count

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows' tables `[n, longest]` (zeros past each one's end) and lengths."""
        lengths = self.lengths[rows]
        return self.array[rows, : int(lengths.max(initial=0))], lengths

    def _reserve(self, pages: int) -> None:
        if pages > self.array.shape[1]:
            self.array = np.pad(self.array, ((0, 0), (0, max(pages, 2 * self.array.shape[1]) - self.array.shape[1])))
