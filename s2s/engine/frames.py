"""Frames: one stream of a conversation, `[frames, K]` codes indexed by absolute frame, that can forget its middle.

A conversation with a bounded context (`ContextBound`) keeps the frames of its attention sink (from frame 0) and
of its recent window; `forget(keep, start)` drops the ones between, so that its memory stays flat however long it
runs. Reading or writing a forgotten frame raises `IndexError`.

A live session's recent frames are a row of an engine-wide `FrameRows` (`attach`), so that a tick reads and writes
those of many sessions by whole-array operations (`DuplexLane`, `AudioIO`); the kept head stays the session's own.
"""

from __future__ import annotations

import copy
import functools

import numpy as np

UNKNOWN = -1


def along_last(reduce: np.ufunc, a: np.ndarray) -> np.ndarray:
    """`reduce` (a binary ufunc) over `a`'s last axis, one whole-array operation per entry of it: numpy's own
    reduction loops over a short innermost axis (a few codebooks, a few frames) at up to twenty times the cost."""
    return functools.reduce(reduce, np.moveaxis(a, -1, 0))


class FrameRows:
    """One stream's recent frames of every live session, a row each: `array` `[rows, capacity, K]`, row r's stream
    from its frame `start` on at `array[r, base[r]:]`. Forgetting frames moves a row's base on (`advance`), not its
    frames; a row whose base leaves too little room for what it must hold moves its frames to the front
    (`room`), once in every capacity less window of frames. When a row needs more room than that, every row grows
    (doubling, up to `limit` frames), and each attached `Frames` is handed its row of the new array. A stream that
    needs more than `limit` leaves its row for an array of its own (`Frames.ensure`): one conversation that falls far
    behind does not grow every row.

    Readers and writers index the rows through `read`, `write` and `held`, by frames from each stream's `start`,
    which `start` holds for every row (and `holding` which rows hold a stream), so that a tick reads them for many
    sessions at once."""

    def __init__(self, rows: int, num_codebooks: int, limit: int):
        self.array = np.full((rows, min(64, limit), num_codebooks), UNKNOWN, dtype=np.int64)
        self.base = np.zeros(rows, dtype=np.int64)
        self.start = np.zeros(rows, dtype=np.int64)  # each attached stream's `Frames.start`
        self.holding = np.zeros(rows, dtype=bool)  # the rows in `attached`
        self.attached: dict[int, Frames] = {}
        self.limit = limit

    def reserve(self, capacity: int) -> None:
        """Rows of at least `capacity` frames (at most `limit`)."""
        if capacity <= self.array.shape[1]:
            return
        if capacity > self.limit:
            raise ValueError(f"{capacity} frames in a row, over the rows' limit of {self.limit}")
        rows, held, k = self.array.shape
        grown = np.full((rows, min(max(capacity, 2 * held), self.limit), k), UNKNOWN, dtype=np.int64)
        grown[:, :held] = self.array
        self.array = grown
        for row in self.attached:
            self._point(row)

    def room(self, rows: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Room in row `rows[i]` for its stream's frames up to `ends[i]` - 1 (from its `start`); the rows' bases."""
        base = self.base[rows]
        if len(rows):
            if (over := (base + ends > self.array.shape[1]) & (base > 0)).any():  # (else it grows)
                for row in np.unique(rows[over]).tolist():
                    self._to_front(row)
                base = self.base[rows]
            if (end := int(ends.max())) > self.array.shape[1]:
                self.reserve(end)
        return base

    def held(self, rows: np.ndarray) -> np.ndarray:
        """Frames each row holds from its stream's `start` (UNKNOWN past what was written)."""
        return self.array.shape[1] - self.base[rows]

    def read(self, rows: np.ndarray, offsets: np.ndarray, count: int) -> np.ndarray:
        """`[n, count, K]`: row `rows[i]`'s frames from `offsets[i]` on (UNKNOWN past what is held)."""
        base = self.room(rows, offsets + count)
        at = (rows * self.array.shape[1] + base + offsets)[:, None] + np.arange(count)
        return np.take(self.array.reshape(-1, self.array.shape[2]), at, axis=0)  # (a third of indexing's time)

    def write(
        self, rows: np.ndarray, offsets: np.ndarray, values: np.ndarray, codebooks: np.ndarray | None = None
    ) -> None:
        """Row `rows[i]`'s frames at `offsets[i, ...]` (from its stream's `start`) become `values[i, ...]`: whole
        frames, or codebook `codebooks[..., j]` of each."""
        base = self.room(rows, along_last(np.maximum, offsets) + 1)
        capacity, k = self.array.shape[1:]
        frames = (rows * capacity + base)[:, None] + offsets  # each frame's place in the flattened rows
        codes = frames[..., None] * k + np.arange(k) if codebooks is None else frames * k + codebooks
        self.array.reshape(-1)[codes] = values  # (a third of a three-index assignment's time)

    def advance(self, row: int, frames: int) -> None:
        """The row's stream forgets its first `frames` frames from `start`: its base moves on past them."""
        start = self.start[row] + frames
        if frames >= self.array.shape[1] - self.base[row]:  # nothing it holds is kept
            self.clear(row)
        else:
            self.base[row] += frames
            self._point(row)
        self.start[row] = start

    def clear(self, row: int) -> None:
        """The row holds nothing, from its front, and its stream starts at frame 0."""
        self.array[row] = UNKNOWN
        self.base[row] = self.start[row] = 0
        self._point(row)

    def _to_front(self, row: int) -> None:
        base = int(self.base[row])
        held = self.array.shape[1] - base
        self.array[row, :held] = self.array[row, base:]
        self.array[row, held:] = UNKNOWN
        self.base[row] = 0
        self._point(row)

    def _point(self, row: int) -> None:
        if (frames := self.attached.get(row)) is not None:
            frames.data = self.array[row, self.base[row] :]


class Frames:
    def __init__(self, num_codebooks: int):
        self.head = np.full((0, num_codebooks), UNKNOWN, dtype=np.int64)  # frames 0 .. len(head)-1, once forgetting
        self.data = np.full((64, num_codebooks), UNKNOWN, dtype=np.int64)  # frames start .. start+len(data)-1
        self.start = 0
        self.rows: FrameRows | None = None  # where `data` is a row, once attached
        self.row = -1

    def attach(self, rows: FrameRows, row: int) -> None:
        """From now on `data` is row `row` of `rows` (what that row held is overwritten); a stream longer than the
        rows' limit keeps its own array."""
        if row in rows.attached:
            raise ValueError(f"row {row} holds another stream's frames")
        if len(self.data) > rows.limit:
            return
        rows.reserve(len(self.data))
        own, self.rows, self.row = self.data, rows, row
        rows.attached[row], rows.holding[row] = self, True
        rows.clear(row)  # (`data` is its row from here)
        rows.start[row] = self.start
        self.data[: len(own)] = own

    def detach(self) -> None:
        """`data` is its own again (a copy of its row, which the next session may take)."""
        if self.rows is not None:
            del self.rows.attached[self.row]
            self.rows.holding[self.row] = False
            self.data, self.rows, self.row = self.data.copy(), None, -1

    def __deepcopy__(self, memo: dict) -> Frames:
        """A detached copy."""
        twin = Frames(self.data.shape[1])
        twin.head, twin.data, twin.start = self.head.copy(), self.data.copy(), self.start
        return twin

    def until(self, frame: int) -> Frames:
        """A detached copy of the frames before `frame`, no longer than they are (a copy of a row would be as long
        as every row): what a closed conversation keeps."""
        kept = copy.deepcopy(self)
        kept.truncate(frame)
        kept.data = kept.data[: frame - kept.start].copy()
        return kept

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + self.data.nbytes

    def __len__(self) -> int:
        """One past the last frame held (known or not)."""
        return self.start + len(self.data)

    def ensure(self, frames: int) -> None:
        """Room for frames up to `frames` - 1 (new ones UNKNOWN)."""
        if frames > self.start + len(self.data):
            if self.rows is not None and frames - self.start <= self.rows.limit:
                self.rows.room(np.array([self.row]), np.array([frames - self.start]))
                return
            self.detach()
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
        if self.rows is None:
            self.data = self.data[start - self.start :].copy()  # what is held from there, room to grow included
        else:  # its row's base moves on: no frame moves
            self.rows.advance(self.row, start - self.start)
        self.start = start

    def truncate(self, frame: int) -> None:
        """Every frame from `frame` on becomes UNKNOWN; back to one piece when that reaches into the kept head."""
        if frame < self.start:
            if frame > len(self.head):
                raise IndexError(f"frames {len(self.head)}..{self.start - 1} are forgotten: cannot cut at {frame}")
            if self.rows is not None and frame <= self.rows.limit:
                self.rows.reserve(min(max(64, 2 * frame), self.rows.limit))
                self.rows.clear(self.row)
            else:
                self.detach()
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
