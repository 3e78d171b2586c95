"""The engine's calibration: real ticks (codec and model) on silent duplex sessions before it serves, like vLLM's
profiling run, so that admission is right from the first burst."""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from codec import Tokenizer
from s2s.engine.config import EngineConfig
from s2s.engine.metrics import CostModel, EngineStats
from s2s.models.model import S2SModel
from s2s.runner.sampling import SamplingParams

# frames at each size the cost model does not learn from: first calls at a new batch size, and the codec's streams
# starting (the encoder holds its first codes for 7 frames, then the decoder re-decodes 7)
WARMUP_FRAMES = 16


class Calibrated(Protocol):
    """What calibration drives: an `Engine`, through its public calls and its tick."""

    cfg: EngineConfig
    model: S2SModel
    tok: Tokenizer | None
    cost: CostModel
    stats: EngineStats

    def open(self, mode: str = ..., *, sampling: SamplingParams | None = ..., admit: bool = ...) -> str: ...
    def push_audio(self, cid: str, pcm: np.ndarray) -> None: ...
    def push_codes(self, cid: str, codes: np.ndarray) -> None: ...
    def step(self) -> None: ...
    def discard(self, cid: str) -> None: ...


def calibrate(engine: Calibrated) -> None:
    """Seed `engine.cost` from ticks on 1, 2 and 4 sessions, each bringing a tick's worth of frames as in service;
    then forget the sessions and the stats. The first pass only warms up (kernel builds, allocators, a page
    crossing)."""
    cfg = engine.cfg
    frames = cfg.frames_per_tick
    silence = np.zeros(cfg.frame_size * frames, dtype=np.float32)
    zeros = np.zeros((engine.model.config.audio_codebooks, frames), dtype=np.int64)
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
