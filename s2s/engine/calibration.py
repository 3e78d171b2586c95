"""The engine's calibration: real ticks (codec and model) on silent duplex sessions before it serves, like vLLM's
profiling run, so that admission is right from the first burst; and what attention to a full window's keys costs,
which short calibration sessions cannot show (`key_seconds`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np

from codec import Tokenizer
from s2s.engine.config import EngineConfig
from s2s.engine.metrics import CostModel, EngineStats
from s2s.models.model import S2SModel
from s2s.runner.model_runner import ModelRunner
from s2s.runner.sampling import SamplingParams
from s2s.scheduling.scheduler import Admission

# frames at each size the cost model does not learn from: first calls at a new batch size, and the codec's streams
# starting (the encoder holds its first codes for 7 frames, then the decoder re-decodes 7)
WARMUP_FRAMES = 16
KEY_ROWS = 4  # decode steps of `key_seconds`' forwards, each over pages of its own (as many streams' are)
KEY_REPEATS = 5  # timed forwards at each length, after one that warms up


class Calibrated(Protocol):
    """What calibration drives: an `Engine`, through its public calls and its tick."""

    cfg: EngineConfig
    model: S2SModel
    tok: Tokenizer | None
    cost: CostModel
    stats: EngineStats
    runner: ModelRunner
    admission: Admission
    clock: Callable[[], float]

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
    if cfg.calibration_ticks:
        engine.cost.set_key_seconds(key_seconds(engine))
    engine.cost.pin()  # several batch sizes: service ticks alone may not tell rounds from steps
    engine.stats.clear()


def key_seconds(engine: Calibrated) -> float:
    """Seconds a decode step spends on each key of context, every layer: the median forward of `KEY_ROWS` steps at a
    full window's keys (`Admission.window_keys`, or what the pool holds) less that at one page's, over the keys
    between. Reading keys is bound by memory, so each step reads pages of its own, as in service."""
    runner = engine.runner
    page = runner.pool.page_size
    pages = runner.pool.k[0].shape[0] - 1  # (page 0 aside)
    rows = max(1, min(KEY_ROWS, pages // math.ceil(engine.admission.window_keys / page)))
    keys = min(engine.admission.window_keys, pages // rows * page)
    if keys <= page:
        return 0.0
    times: dict[int, list[float]] = {page: [], keys: []}
    for _ in range(1 + KEY_REPEATS):
        for n, seen in times.items():
            start = engine.clock()
            runner.attend(rows, n)
            seen.append(engine.clock() - start)
    long, short = (float(np.median(times[n][1:])) for n in (keys, page))
    return max(0.0, long - short) / (rows * (keys - page))
