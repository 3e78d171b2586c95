"""bench/prefix_bench.py: the workload's shared prefixes are what the rows say they are."""

from __future__ import annotations

import numpy as np

from bench.prefix_bench import QUICK, Workload, pressure_working_set


def test_prompts_share_exactly_their_fraction_within_a_group() -> None:
    clips = [np.zeros(24000, dtype=np.float32)]
    w = Workload(QUICK, clips, seed=0)
    for fraction in (0.0, 0.3, 0.6, 0.9):
        a, b = w.prompt(0, fraction), w.prompt(0, fraction)
        shared = round(fraction * QUICK.prompt_frames)
        assert a.shape == b.shape == (2, QUICK.prompt_frames)
        assert np.array_equal(a[:, :shared], b[:, :shared])
        diverged = np.flatnonzero((a != b).any(axis=0))
        assert shared == QUICK.prompt_frames or diverged[0] < shared + 2  # random codes differ at once (p ~ 1e-6)
        assert not np.array_equal(w.prompt(1, fraction)[:, :shared], a[:, :shared]) or shared == 0


def test_arrivals_are_seeded_and_start_at_zero() -> None:
    clips = [np.zeros(24000, dtype=np.float32)]
    a, b = Workload(QUICK, clips, seed=3), Workload(QUICK, clips, seed=3)
    assert np.array_equal(a.arrivals, b.arrivals) and a.arrivals[0] == 0 and np.all(np.diff(a.arrivals) > 0)
    assert pressure_working_set(a) > 0
