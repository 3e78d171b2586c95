"""One measured run: the model and questions (`setup`), an engine built the same in every mode (`make_engine`), and
one workload's scripts run on it to the end (`run_once`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from bench.prefix.config import FRAMES_PER_TICK, FULL, MAX_CONTEXT, PAGE, PREFILL_BUDGET, QUICK, Scale
from bench.prefix.driver import Driver, Script
from bench.prefix.engine_reads import EngineCounters, counters
from bench.prefix.workloads import Workload, shared_scripts
from codec import EncodecTokenizer
from codec.pcm import SAMPLE_RATE
from s2s import ModelConfig, S2SModel
from s2s.engine.engine import Engine, EngineConfig
from speech.sample import synthesize

WORDS_PER_MINUTE = 220
QUESTIONS = [
    "Will it rain tomorrow?",
    "Book a table for two.",
    "Tell me a story.",
    "When is the next train?",
    "How far is the station?",
    "Play some music.",
    "What time is it?",
    "Call my sister.",
]


def setup(preset: str, quick: bool, rounds: int | None) -> tuple[Scale, EncodecTokenizer, S2SModel, list[np.ndarray]]:
    """The run's scale, codec, seeded model and user questions (espeak-ng speech)."""
    # one intra-op thread: on this shared 2-core machine two threads spin against other processes' work and ticks
    # slow down 20x at 16 conversations; the engine's work per tick is small (tiny preset)
    torch.set_num_threads(1)
    scale = QUICK if quick else FULL
    if rounds is not None:
        scale = replace(scale, rounds=rounds)
    tok = EncodecTokenizer.from_pretrained(None, bandwidth=1.5)
    model = S2SModel.from_seed(ModelConfig.preset(preset, num_codebooks=tok.num_codebooks), seed=0)
    clips = [synthesize(q, words_per_minute=WORDS_PER_MINUTE) for q in QUESTIONS]
    if scale.question_s:
        clips = [c[: round(scale.question_s * SAMPLE_RATE)] for c in clips]
    return scale, tok, model, clips


def make_engine(model: S2SModel, tok: EncodecTokenizer, mode: str, num_pages: int, scale: Scale, **kw) -> Engine:
    """An engine that differs from the others only in `mode` and `kw`; admission by tick cost off unless `kw` says."""
    cfg = EngineConfig(
        cache_mode=mode,
        page_size=PAGE,
        num_pages=num_pages,
        max_context=MAX_CONTEXT,
        frames_per_tick=FRAMES_PER_TICK,
        max_reply_frames=scale.reply_frames,
        prefill_budget=PREFILL_BUDGET,
        calibration_ticks=0,
        **{"admission_headroom": math.inf, **kw},
    )
    return Engine(model, tok, cfg)


@dataclass
class Run:
    """One run of one workload on one engine: the driver's records and the engine's counters (the engine itself,
    and its K/V pool, are let go: 132 pools of a full run would not fit in memory)."""

    driver: Driver
    wall: float
    conversations: int
    counters: EngineCounters
    frame_s: float  # the engine's frame (its codec's), kept as the engine goes


def run_once(engine: Engine, scripts_of: Callable[[Driver], list[Script]], streamed: bool, stall_s: float) -> Run:
    d = Driver(engine, streamed=streamed)
    scripts = scripts_of(d)
    wall = d.run(scripts, stall_s)
    run = Run(d, wall, len(scripts), counters(engine), engine.cfg.frame_s)
    d.engine = None
    return run


def warm_up(
    model: S2SModel, tok: EncodecTokenizer, scale: Scale, clips: list[np.ndarray], pages: int, streamed: bool
) -> None:
    """A throwaway run first: one-time costs (allocators, kernels) hit no measured run."""
    warm = Workload(scale, clips, 99)
    run_once(
        make_engine(model, tok, "paged", pages, scale), lambda d: shared_scripts(d, warm, 0.0), streamed, scale.stall_s
    )
