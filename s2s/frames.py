"""Frames: one stream of a conversation, `[frames, K]` codes indexed by absolute frame, that can forget its middle.

A conversation with a bounded context (`s2s/context.py`) keeps the frames of its attention sink (from frame 0) and
of its recent window; `forget(keep, start)` drops the ones between, so that its memory stays flat however long it
runs. Reading or writing a forgotten frame raises `IndexError`.
"""

from __future__ import annotations

import numpy as np

UNKNOWN = -1


class Frames:
    def __init__(self, num_codebooks: int):
        self.head = np.full((0, num_codebooks), UNKNOWN, dtype=np.int64)  # frames 0 .. len(head)-1, once forgetting
        self.data = np.full((64, num_codebooks), UNKNOWN, dtype=np.int64)  # frames start .. start+len(data)-1
        self.start = 0

    def __len__(self) -> int:
        """One past the last frame held (known or not)."""
        return self.start + len(self.data)

    def ensure(self, frames: int) -> None:
        """Room for frames up to `frames` - 1 (new ones UNKNOWN)."""
        if frames > self.start + len(self.data):
            size = max(frames - self.start, 2 * len(self.data))
            grown = np.full((size, self.data.shape[1]), UNKNOWN, dtype=np.int64)
            grown[: len(self.data)] = self.data
            self.data = grown

    def forget(self, keep: int, start: int) -> None:
        """Drop frames `keep` .. `start`-1: frames 0 .. `keep`-1 stay (the same `keep` every time), and those from
        `start` on."""
        if start <= max(self.start, keep):
            return
        if self.start == 0:
            self.head = self.data[:keep].copy()
        elif keep != len(self.head):
            raise ValueError(f"frames 0..{len(self.head) - 1} are kept, not 0..{keep - 1}")
        self.data = self.data[start - self.start :].copy()  # what is held from there, room to grow included
        self.start = start

    def truncate(self, frame: int) -> None:
        """Every frame from `frame` on becomes UNKNOWN; back to one piece when that reaches into the kept head."""
        if frame < self.start:
            if frame > len(self.head):
                raise IndexError(f"frames {len(self.head)}..{self.start - 1} are forgotten: cannot cut at {frame}")
            self.data = np.full((max(64, 2 * frame), self.data.shape[1]), UNKNOWN, dtype=np.int64)
            self.data[:frame] = self.head[:frame]
            self.head, self.start = self.head[:0], 0
        else:
            self.data[frame - self.start :] = UNKNOWN

    def gather(self, frames: np.ndarray, codebooks: np.ndarray) -> np.ndarray:
        """The codes at (`frames`, `codebooks`), broadcast together (frames >= 0); frames past the end read UNKNOWN."""
        if not frames.size or frames.min() >= self.start:  # the usual read, each tick: recent frames only
            rows = np.minimum(frames - self.start, len(self.data) - 1)
            return np.where(frames < len(self), self.data[rows, codebooks], UNKNOWN)
        shape = np.broadcast_shapes(frames.shape, codebooks.shape)
        frames, codebooks = np.broadcast_to(frames, shape), np.broadcast_to(codebooks, shape)
        out = np.full(shape, UNKNOWN, dtype=np.int64)
        tail = (frames >= self.start) & (frames < len(self))
        out[tail] = self.data[frames[tail] - self.start, codebooks[tail]]
        head = frames < self.start
        if head.any():
            if (frames[head] >= len(self.head)).any():
                raise IndexError("a forgotten frame was read")
            out[head] = self.head[frames[head], codebooks[head]]
        return out

    def window(self, first: int, count: int) -> np.ndarray:
        """Frames `first`..`first + count - 1`, all from `start` on (the tick's usual read), as a view (`[count, K]`;
        the array grows to hold them: those past the end are UNKNOWN)."""
        if first < self.start:
            raise IndexError(f"frame {first} is before the recent frames ({self.start} on)")
        self.ensure(first + count)
        return self.data[first - self.start : first - self.start + count]

    def code(self, frame: int, codebook: int) -> int:
        """One code (UNKNOWN past the end); `frame` must not be forgotten."""
        if frame >= self.start:
            row = frame - self.start
            return int(self.data[row, codebook]) if row < len(self.data) else UNKNOWN
        array, row = self._row(frame)
        return int(array[row, codebook])

    def forgotten(self, frame: int) -> bool:
        return len(self.head) <= frame < self.start

    def _row(self, frame: int) -> tuple[np.ndarray, int]:
        if frame >= self.start:
            return self.data, frame - self.start
        if 0 <= frame < len(self.head):
            return self.head, frame
        raise IndexError(f"frame {frame} is forgotten")

    def _span(self, key: slice) -> tuple[np.ndarray, slice]:
        """A slice of frames as a view: wholly in the head or wholly from `start` on."""
        a, b = key.start or 0, len(self) if key.stop is None else key.stop
        if a >= self.start:
            return self.data, slice(a - self.start, max(a, b) - self.start)
        if b <= len(self.head):
            return self.head, slice(a, b)
        raise IndexError(f"frames {a}..{b - 1} reach forgotten ones")

    def _at(self, key) -> tuple[np.ndarray, tuple]:
        """`key` (frames, or frames and codebooks; frames an int or a slice) as an array and its index in it."""
        frames, codebooks = key if isinstance(key, tuple) else (key, slice(None))
        array, rows = self._span(frames) if isinstance(frames, slice) else self._row(int(frames))
        return array, (rows, codebooks)

    def __getitem__(self, key) -> np.ndarray:
        array, index = self._at(key)
        return array[index]

    def __setitem__(self, key, value) -> None:
        array, index = self._at(key)
        array[index] = value
