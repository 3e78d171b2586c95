"""`Frames`' quick reads (`window`, `code`, each tick's) against its general one (`gather`), however the stream has
grown and forgotten its middle."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s.frames import Frames


@settings(max_examples=60, deadline=None)
@given(
    known=st.integers(1, 300),
    keep=st.integers(0, 20),
    forget_to=st.integers(0, 300),
    start=st.integers(0, 320),
    length=st.integers(0, 5),
)
def test_window_and_code_read_what_gather_reads(known: int, keep: int, forget_to: int, start: int, length: int) -> None:
    frames = Frames(2)
    frames.ensure(known)
    frames[:known] = np.arange(2 * known).reshape(known, 2)
    if keep < forget_to < known:
        frames.forget(keep, forget_to)
    stop = start + length
    want = frames.gather(np.arange(start, stop)[:, None], np.arange(2)[None, :]) if start >= frames.start else None
    if want is None:
        with pytest.raises(IndexError):
            frames.window(start, length)
    else:
        assert np.array_equal(frames.window(start, length), want)
    for k in range(2):
        for f in range(start, stop):
            if not frames.forgotten(f):
                assert frames.code(f, k) == frames.gather(np.array([f]), np.array(k))[0]
