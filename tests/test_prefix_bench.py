"""bench/prefix_bench.py: the workload's shared prefixes are what the rows say they are."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bench.prefix_bench import QUICK, Workload, pooled_ttfa, pressure_working_set, round_interval, round_seed


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
    assert pressure_working_set(a, frame_size=320) > 0


def _rounds(samples: list[list[float]]) -> list[SimpleNamespace]:
    """Stand-ins for `Run`s: only their TTFA samples (seconds), one label."""
    return [SimpleNamespace(driver=SimpleNamespace(ttfa={"turn": s})) for s in samples]


def test_round_interval_pairs_rounds_across_modes() -> None:
    rng = np.random.default_rng(1)
    other = [list(scale * rng.exponential(1.0, 16)) for scale in (0.1, 1.0, 0.3, 2.0, 0.5)]
    radix = [[0.8 * t for t in ts] for ts in other]  # 20 % lower in every round, whatever the round's load

    def lower(a: list, b: list):
        return lambda i: 1 - pooled_ttfa(a, i, 50) / pooled_ttfa(b, i, 50)

    lo, hi = round_interval(lower(_rounds(radix), _rounds(other)), len(other))
    assert lo == pytest.approx(0.2) and hi == pytest.approx(0.2)
    # the same samples with rounds unpaired: the rounds' load swamps the 20 %, and the interval says so
    lo, hi = round_interval(lower(_rounds(radix[::-1]), _rounds(other)), len(other))
    assert lo < 0 < 0.2 < hi
    assert round_interval(lower(_rounds(radix), _rounds(other)), 2) is None


def test_every_round_has_its_own_arrivals_the_same_in_every_mode() -> None:
    clips = [np.zeros(24000, dtype=np.float32)]
    seeds = [round_seed("shared", r) for r in range(3)] + [round_seed("unique", r) for r in range(3)]
    assert len(set(seeds)) == 6 and round_seed("pressure", 1) == round_seed("pressure, no admission", 1)
    a, b = Workload(QUICK, clips, round_seed("shared", 0)), Workload(QUICK, clips, round_seed("shared", 1))
    assert not np.array_equal(a.arrivals, b.arrivals)
