"""The prefix study's measures: common prefixes, position-wise and chance equality, the engine key, radix reuse."""

import numpy as np
import pytest

from bench.prefix_study_bench import (
    PAGE,
    chance_equal,
    common_prefix,
    equal_fraction,
    prefix_frames,
    radix_reuse,
    turn_key,
)
from s2s import ModelConfig


def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2  # equal again after the mismatch: not a prefix
    assert common_prefix([7, 2, 3], [1, 2, 3]) == 0  # must not match at all
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3  # the shorter one, wholly shared
    rows = np.array([[1, 1], [2, 2], [3, 3]])
    other = rows.copy()
    other[1, 1] = 9  # one code of a step differs: the step does not match
    assert common_prefix(rows, other) == 1
    with pytest.raises(ValueError):
        common_prefix(rows, rows[:, :1])


def test_per_codebook_and_position_wise():
    a = np.arange(80).reshape(8, 10)
    b = a.copy()
    b[5, 3] = -1  # a fine codebook differs first
    prefix = prefix_frames(a, b)
    assert prefix["cb0"] == 10 and prefix["cb5"] == 3 and prefix["all2"] == 10 and prefix["all8"] == 3
    eq = equal_fraction(a, b)
    assert eq["cb5"] == 0.9 and eq["all2"] == 1.0 and eq["all8"] == 0.9
    later = np.concatenate([np.full((8, 1), -5), a], axis=1)  # one frame later
    assert equal_fraction(a, later)["all8"] == 0.0 and equal_fraction(a, later, skip=1)["all8"] == 1.0
    x = np.zeros((8, 4), dtype=int)
    x[:, 2:] = 1
    y = np.ones((8, 4), dtype=int)
    y[:, 0] = 0
    assert chance_equal(x, y)["cb0"] == pytest.approx(0.5 * 0.25 + 0.5 * 0.75)


def test_turn_key_and_radix_reuse():
    cfg = ModelConfig.preset("tiny", num_codebooks=2)
    codes = np.arange(2 * 40).reshape(2, 40)
    key = turn_key(codes, cfg)
    assert key.shape == (40, 4)
    assert key[0].tolist() == [0, cfg.pad_id, cfg.silent_id, cfg.pad_id]  # codebook 1 lags one step
    assert radix_reuse(key, key) == 40 // PAGE * PAGE  # the partial last page is not cached
    late = codes.copy()
    late[0, 20] = 999
    assert radix_reuse(key, turn_key(late, cfg)) == 20  # a whole page, and 4 steps copied from the next one
    early = codes.copy()
    early[1, 0] = 999  # enters the key at step 1
    assert radix_reuse(key, turn_key(early, cfg)) == 1
    early[0, 0] = 999  # and now at step 0: nothing
    assert radix_reuse(key, turn_key(early, cfg)) == 0
