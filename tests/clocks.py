"""Clocks for driving an engine by hand: its scheduling (prefill aging, victims by age) then follows the calls, not
the machine's load. That matters wherever a test compares greedy replies: how prefill is chunked moves logits by
~1e-7, which can flip an argmax at a near-tie, so two runs agree only if they chunk alike."""

from __future__ import annotations


class SimClock:
    """Time moves only when told: by the tick, and by the simulated cost of each forward."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CallClock:
    """Every reading is a microsecond after the last one: order is kept, and nothing depends on real time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now
