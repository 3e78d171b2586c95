"""s2s/engine/metrics.py CostModel: the tick cost that admission control predicts, on a CPU and on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from s2s.engine.metrics import CostModel

FRAMES_PER_TICK = 4


def served(cost: CostModel, tick_s, conversations: list[int], seed: int = 0) -> None:
    """Ticks as an engine sees them: full ticks of FRAMES_PER_TICK rounds, and, as clients' 80 ms blocks do not
    line up with the ticks, some of fewer rounds; every round steps every conversation. 1 % timing noise."""
    rng = np.random.default_rng(seed)
    for n in conversations:
        for rounds in [FRAMES_PER_TICK] * 12 + [1, 2, 3]:
            cost.observe(rounds, rounds * n, 0, tick_s(rounds, rounds * n) * rng.normal(1, 0.01))


MACHINES = pytest.mark.parametrize(
    "machine, tick_s",
    [
        ("gpu: launches per round, batch size ~free", lambda rounds, steps: 0.004 + 0.006 * rounds + 0.0001 * steps),
        ("cpu: compute per step", lambda rounds, steps: 0.002 + 0.0005 * rounds + 0.006 * steps),
    ],
)


@MACHINES
def test_predicts_the_tick_of_more_conversations(machine, tick_s) -> None:
    cost = CostModel()
    served(cost, tick_s, [1, 2, 4])
    for n in (2, 8, 32):
        want = tick_s(FRAMES_PER_TICK, FRAMES_PER_TICK * n)
        assert cost.predict(FRAMES_PER_TICK, FRAMES_PER_TICK * n) == pytest.approx(want, rel=0.05), machine


def test_is_cautious_before_it_has_seen_two_batch_sizes() -> None:
    cost = CostModel()
    assert cost.predict(FRAMES_PER_TICK, 8) is None
    for _ in range(20):
        cost.observe(FRAMES_PER_TICK, FRAMES_PER_TICK, 0, 0.02)
    assert cost.predict(FRAMES_PER_TICK, 8) == pytest.approx(0.04)  # proportional to the steps
    cost.observe(FRAMES_PER_TICK, 0, 0, 1.0)  # an idle tick teaches nothing
    assert len(cost.samples) == 20


@MACHINES
@pytest.mark.parametrize("rounds", [[FRAMES_PER_TICK], [1, 2, 3, FRAMES_PER_TICK]])
def test_a_window_of_one_batch_size_keeps_the_calibrated_shape(machine, tick_s, rounds) -> None:
    """The engine pins its calibration (1, 2 and 4 conversations); then one conversation for longer than the window.
    With full ticks only, or with rounds moving with steps, the window alone cannot separate the two costs."""
    cost = CostModel(window=400)
    for n in (1, 2, 4):
        for _ in range(16):
            cost.observe(FRAMES_PER_TICK, FRAMES_PER_TICK * n, 0, tick_s(FRAMES_PER_TICK, FRAMES_PER_TICK * n))
    cost.pin()
    rng = np.random.default_rng(1)
    for i in range(1000):
        r = rounds[i % len(rounds)]
        cost.observe(r, r, 0, tick_s(r, r) * rng.normal(1, 0.01))
    for n in (2, 8):
        want = tick_s(FRAMES_PER_TICK, FRAMES_PER_TICK * n)
        assert cost.predict(FRAMES_PER_TICK, FRAMES_PER_TICK * n) == pytest.approx(want, rel=0.05), machine


def test_forgotten_warm_up_ticks_leave_the_fit() -> None:
    """The engine forgets its calibration's warm-up ticks (first calls at a new shape): they must leave the fit
    even when a prediction was made from them."""
    cost = CostModel()
    for _ in range(20):
        cost.observe(FRAMES_PER_TICK, FRAMES_PER_TICK, 0, 0.02)
    for _ in range(20):
        cost.observe(FRAMES_PER_TICK, FRAMES_PER_TICK, 0, 0.5)  # warm-up: kernel builds, allocators
    assert cost.predict(FRAMES_PER_TICK, FRAMES_PER_TICK) > 0.1
    cost.forget_after(20)
    assert len(cost.samples) == 20
    assert cost.predict(FRAMES_PER_TICK, FRAMES_PER_TICK) == pytest.approx(0.02)


def test_reading_keys_is_charged_at_the_measured_rate_and_not_mistaken_for_service_overhead() -> None:
    """Ticks whose keys (context) grow: with `key_seconds` known, the fit of the rest is that of short contexts,
    service ticks at long contexts raise no service ratio, and a prediction charges the keys it is given."""
    per_key, base = 4e-6, lambda rounds, steps: 0.002 + 0.0005 * rounds + 0.006 * steps
    cost = CostModel()
    cost.set_key_seconds(per_key)
    for n in (1, 2, 4):  # calibration: short contexts
        for _ in range(16):
            steps = FRAMES_PER_TICK * n
            cost.observe(FRAMES_PER_TICK, steps, 0, base(FRAMES_PER_TICK, steps) + per_key * steps * 50, steps * 50)
    cost.pin()
    for context in range(100, 3000, 50):  # one and two conversations in service, their contexts growing
        steps = FRAMES_PER_TICK * (1 + context // 50 % 2)
        cost.observe(
            FRAMES_PER_TICK, steps, 0, base(FRAMES_PER_TICK, steps) + per_key * steps * context, steps * context
        )
    for n in (1, 8):
        steps = n * FRAMES_PER_TICK
        want = base(FRAMES_PER_TICK, steps) + per_key * steps * 2000
        assert cost.predict(FRAMES_PER_TICK, steps, keys=steps * 2000) == pytest.approx(want, rel=0.02)
        assert cost.predict(FRAMES_PER_TICK, steps) == pytest.approx(base(FRAMES_PER_TICK, steps), rel=0.02)
