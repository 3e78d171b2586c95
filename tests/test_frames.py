"""`Frames`' quick reads (`code`, and `FrameRows.read` of an attached stream) against its general one (`gather`),
however the stream has grown and forgotten its middle."""

from copy import deepcopy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s.engine.frames import FrameRows, Frames


@settings(max_examples=60, deadline=None)
@given(
    known=st.integers(1, 300),
    keep=st.integers(0, 20),
    forget_to=st.integers(0, 300),
    start=st.integers(0, 320),
    length=st.integers(0, 5),
)
def test_code_reads_what_gather_reads(known: int, keep: int, forget_to: int, start: int, length: int) -> None:
    frames = Frames(2)
    frames.ensure(known)
    frames[:known] = np.arange(2 * known).reshape(known, 2)
    if keep < forget_to < known:
        frames.forget(keep, forget_to)
    stop = start + length
    for k in range(2):
        for f in range(start, stop):
            if not frames.forgotten(f):
                assert frames.code(f, k) == frames.gather(np.array([f]), np.array(k))[0]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["write", "fill", "write_rows", "forget", "truncate", "grow_other", "read"]),
        st.integers(0, 400),
    ),
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_frames_in_rows_behave_as_their_own(ops: list[tuple[str, int]]) -> None:
    """A stream held in a row of `FrameRows` reads and writes what one holding its own array does, whatever it and
    the other rows do (a forget moves its row's base on, a write past the row's end moves its frames to the front or
    grows every row, and each attached stream follows its row); `FrameRows.read` and `write` read and write what its
    own frames do, and a detached copy keeps the frames."""
    own, held, other, rows = Frames(2), Frames(2), Frames(2), FrameRows(3, 2, limit=512)  # (past it: its own array)
    held.attach(rows, 1)
    other.attach(rows, 2)
    written, kept = 0, None  # frames 0..written-1 are known; frames 0..kept-1 stay once forgetting
    for op, n in ops:
        if op in ("write", "fill"):  # some frames, or up to the end of the row
            count = n % 50 if op == "write" else len(held) - written
            for frames in (own, held):
                frames.ensure(written + count)
                frames[written : written + count] = np.arange(2 * count).reshape(-1, 2) + written
            written += count
        elif op == "write_rows":  # through the rows' own writer, where the stream is in its row
            count, values = n % 20 + 1, np.arange(2 * (n % 20 + 1)).reshape(-1, 2) + 1000 + written
            own.ensure(written + count)
            own[written : written + count] = values
            if held.rows is not None and written + count - held.start <= rows.limit and written >= held.start:
                rows.write(np.array([1]), np.arange(written, written + count)[None, :] - held.start, values[None])
            else:
                held.ensure(written + count)
                held[written : written + count] = values
            written += count
        elif op == "forget" and n < written:
            kept = min(n, 8) if kept is None else kept
            if n > max(kept, own.start):
                own.forget(kept, n)
                held.forget(kept, n)
        elif op == "truncate" and (n >= own.start or n <= len(own.head)):
            own.truncate(n)
            held.truncate(n)
            written = min(written, n)
            kept = None if own.start == 0 else kept
        elif op == "grow_other":
            other.ensure(other.start + len(other.data) + n)
        assert held.start == own.start and np.array_equal(held.head, own.head)
        assert held.rows is None or rows.held(np.array([1]))[0] == len(held.data)
        assert rows.holding.tolist() == [False, held.rows is not None, other.rows is not None]
        assert held.rows is None or rows.start[1] == held.start
        stop = max(len(own), len(held))
        frames = np.arange(held.start, stop)[:, None]
        assert np.array_equal(held.gather(frames, np.arange(2)), own.gather(frames, np.arange(2)))
        if op == "read" and n >= held.start and held.rows is not None and n - held.start + 6 <= rows.limit:
            window = rows.read(np.array([1]), np.array([n - held.start]), 6)[0]
            assert np.array_equal(window, own.gather(np.arange(n, n + 6)[:, None], np.arange(2)))
    assert rows.array.shape[1] <= rows.limit
    copy = deepcopy(held)
    held.detach()
    assert copy.rows is None and held.rows is None and 1 not in rows.attached and not rows.holding[1]
    frames = np.arange(own.start, len(own))[:, None]
    for frames_of in (copy, held):
        assert np.array_equal(frames_of.gather(frames, np.arange(2)), own.gather(frames, np.arange(2)))


def test_a_row_holds_one_stream() -> None:
    rows = FrameRows(2, 2, limit=512)
    Frames(2).attach(rows, 0)
    with pytest.raises(ValueError, match="holds another"):
        Frames(2).attach(rows, 0)
