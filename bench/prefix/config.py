"""The engines' fixed settings and the run's scale (`Scale`: SGLang's defaults scaled down to 2 CPU cores)."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("naive", "paged", "exact", "radix")
PAGE, FRAMES_PER_TICK, MAX_CONTEXT, PREFILL_BUDGET = 16, 4, 4096, 256


@dataclass
class Scale:
    """The run's shape (scaled down from SGLang's defaults; see `bench/prefix/workloads.py`)."""

    groups: int
    per_group: int
    prompt_frames: int
    reply_frames: int
    fractions: list[float]
    turns: int
    long_convs: int
    long_turns: int
    burst: int
    fit_pages: int
    arrival_rate: float  # conversations per second (Poisson), shared/multiturn/branching/unique
    rounds: int  # every (workload, mode) is run this often, each round its own seed; TTFA samples pooled
    long_prompt_frames: int = 2048  # "long prompts, at once": SGLang's system-prompt length, in frames
    long_prompt_convs: int = 4
    question_s: float | None = None  # questions cut to this many seconds (--quick: streamed turns take real time)
    stall_s: float = 4.0  # a run with no audio out and no open this long has stalled (`Driver.run`)


QUICK = Scale(2, 2, 150, 24, [0.6], 3, 2, 3, 6, 512, 8.0, 1, 600, 2, question_s=0.4, stall_s=1.5)
FULL = Scale(4, 4, 300, 32, [0.0, 0.3, 0.6, 0.9], 5, 4, 6, 12, 1024, 4.0, 3)
