"""The engine's calibration: real ticks (codec and model) on silent duplex sessions before it serves, like vLLM's
profiling run, so that admission is right from the first burst."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from s2s.sampling import SamplingParams

if TYPE_CHECKING:
    from s2s.engine import Engine

# frames at each size the cost model does not learn from: first calls at a new batch size, and the codec's streams
# starting (the encoder holds its first codes for 7 frames, then the decoder re-decodes 7)
WARMUP_FRAMES = 16


def calibrate(engine: Engine) -> None:
    """Seed `engine.cost` from ticks on 1, 2 and 4 sessions, each bringing a tick's worth of frames as in service;
    then forget the sessions and the stats. The first pass only warms up (kernel builds, allocators, a page
    crossing)."""
    cfg = engine.cfg
    frames = cfg.frames_per_tick
    silence = np.zeros(320 * frames, dtype=np.float32)
    zeros = np.zeros((engine.model.config.num_codebooks, frames), dtype=np.int64)
    warmup, ticks = math.ceil(WARMUP_FRAMES / frames), cfg.calibration_ticks
    # the first pass measures nothing: twice the warm-up, so that its frames cross into a second page too
    for n, unmeasured, measured in ((1, 2 * warmup, 0), (1, warmup, ticks), (2, warmup, ticks), (4, warmup, ticks)):
        if n > cfg.max_conversations or not cfg.calibration_ticks:
            break
        cids = [engine.open("duplex", sampling=SamplingParams(seed=i), admit=False) for i in range(n)]
        kept = len(engine.cost.samples)
        for tick in range(unmeasured + measured):
            for cid in cids:
                if engine.tok is None:
                    engine.push_codes(cid, zeros)
                else:
                    engine.push_audio(cid, silence)
            engine.step()
            if tick < unmeasured:
                engine.cost.forget_after(kept)
        for cid in cids:
            engine.discard(cid)
    engine.cost.pin()  # several batch sizes: service ticks alone may not tell rounds from steps
    engine.stats.clear()
