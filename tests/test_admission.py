"""Admission: on a simulated clock, it holds from the first tick on what calibration measured of a slow machine, and
learns from the next ticks what serving costs beyond it; through the server with the shipped weights, 16 clients at
once. No conversation it admits misses a deadline."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from clocks import SimClock

from codec import EncodecTokenizer
from codec.pcm import SAMPLE_RATE
from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.calibration import calibrate
from s2s.engine.engine import Engine, EngineConfig, Refused
from server.moshi.client import ClientResult, talk
from server.process import ServerProcess
from server.scrape import scrape
from speech.sample import speech

GREEDY = SamplingParams(temperature=0)
FRAME_S = EncodecTokenizer.frame_size / SAMPLE_RATE
STEP_S = 0.0025  # the simulated machine: 1 ms a round and 2.5 ms a decode step: a tick of 4 frames (53 ms) takes
# 4 + 10 N ms, and admission's budget (0.75 of it, 40 ms) fits 3


@pytest.fixture(scope="module")
def parts() -> tuple[S2SModel, EncodecTokenizer]:
    return S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0), EncodecTokenizer.from_pretrained(seed=0)


def slow_engine(
    parts, clock: SimClock, serving_extra_s: float = 0.0, key_s: float = 0.0, **config
) -> tuple[Engine, dict]:
    """An engine whose forward costs simulated time, calibrated on that machine as `Engine` does at start: a round 1
    ms, a decode step `STEP_S`, and each key of context a step attends to `key_s` (also in calibration's forwards
    at a window's keys). From then on each decode step costs `serving_extra_s` more (`extra["s"]`): what a server's
    threads add in service, which calibration cannot see. `config`: `EngineConfig` fields."""
    cfg = EngineConfig(num_pages=2000, max_conversations=16, frames_per_tick=4, calibration_ticks=0, **config)
    engine = Engine(*parts, cfg, clock=clock)
    real_forward, real_attend, extra = engine.runner.forward, engine.runner.attend, {"s": 0.0}

    def costly_forward(batch):
        out = real_forward(batch)  # (which counts the batch's keys)
        clock.now += 0.001 + (STEP_S + extra["s"]) * batch.decode_steps + 0.00005 * batch.prefill_steps
        clock.now += key_s * batch.keys
        return out

    def costly_attend(rows: int, keys: int) -> None:
        real_attend(rows, keys)
        clock.now += 0.001 + STEP_S * rows + key_s * rows * keys

    engine.runner.forward, engine.runner.attend = costly_forward, costly_attend
    engine.cfg = EngineConfig(**{**cfg.__dict__, "calibration_ticks": 16})
    calibrate(engine)
    extra["s"] = serving_extra_s
    return engine, extra


def burst(engine: Engine, asks: int) -> tuple[list[str], int]:
    """`asks` conversations ask at once: those admitted, and how many were refused."""
    live, refused = [], 0
    for _ in range(asks):
        try:
            live.append(engine.open("duplex", sampling=GREEDY))
        except Refused:
            refused += 1
    return live, refused


def tone(tick: int) -> np.ndarray:
    t = np.arange(int(4 * FRAME_S * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.2 * np.sin(2 * np.pi * (200 + tick % 7) * t)).astype(np.float32)


def serve(engine: Engine, clock: SimClock, live: list[str], ticks: int, asks_every: int | None) -> int:
    """Ticks in real time on the simulated clock, every live conversation speaking 4 frames a tick; one more asks
    every `asks_every` ticks. Returns the refusals."""
    refused = 0
    for tick in range(ticks):
        if asks_every and tick % asks_every == 0:
            try:
                live.append(engine.open("duplex", sampling=GREEDY))
            except Refused as e:
                assert "deadline" in str(e), e
                refused += 1
        for cid in live:
            engine.push_audio(cid, tone(tick))
        start = clock.now
        engine.step()
        clock.now = max(clock.now, start + engine.cfg.tick_s)
    return refused


def test_a_burst_at_the_first_tick_is_admitted_only_as_far_as_calibration_says_fits(parts) -> None:
    """Twelve ask before the engine has served a tick: calibration alone decides, and none admitted misses."""
    clock = SimClock()
    engine, _ = slow_engine(parts, clock)
    live, refused = burst(engine, 12)
    budget = engine.cfg.tick_s * engine.cfg.admission_headroom
    fits = int((budget - 0.004) // (4 * STEP_S))  # 4 rounds of 1 ms, and 4 steps a stream
    assert len(live) == fits and refused == 12 - fits
    serve(engine, clock, live, 60, asks_every=None)
    assert engine.stats.deadline_misses == 0


def test_what_serving_adds_is_learned_before_another_is_admitted(parts) -> None:
    """Service costs 70 % more a step than calibration saw (4 + 17 N ms a tick): admitting on calibration alone
    would take a third, whose ticks (55 ms) miss. One asks every 10 ticks; the excess is learned from the ticks
    served, 2 are admitted, and none misses."""
    clock = SimClock()
    engine, _ = slow_engine(parts, clock, serving_extra_s=0.7 * STEP_S)
    live = [engine.open("duplex", sampling=GREEDY)]
    refused = serve(engine, clock, live, 120, asks_every=10)
    assert refused > 0 and len(live) == 2
    assert engine.stats.deadline_misses == 0
    assert all(c["deadline_misses"] == 0 for c in engine.snapshot().sessions)


def test_a_cost_that_grows_faster_than_calibration_is_seen_at_the_newest_load(parts) -> None:
    """Service costs 1 ms a round more for every pair of streams (threads contending): 14, 32 and 58 ms ticks at
    1, 2 and 3 streams, where calibration's fit says 14, 24 and 34. After 40 ticks of one, one asks every 4 ticks:
    the second is admitted; the third, whose ticks would miss, is refused on the ticks at two streams (the code
    before took their median with the 40 at one, and admitted it)."""
    clock = SimClock()
    engine, _ = slow_engine(parts, clock)
    real_forward = engine.runner.forward

    def contended_forward(batch):
        clock.now += 0.001 * batch.decode_steps * (batch.decode_steps - 1)
        return real_forward(batch)

    engine.runner.forward = contended_forward
    live = [engine.open("duplex", sampling=GREEDY)]
    serve(engine, clock, live, 40, asks_every=None)
    refused = serve(engine, clock, live, 40, asks_every=4)
    assert len(live) == 2 and refused == 9
    assert engine.stats.deadline_misses == 0


def test_each_stream_is_charged_a_full_window_of_keys(parts) -> None:
    """Attention costs 11 us a key of context: at the window (176 steps) a stream's tick costs 7.7 ms more than at
    its first steps. Calibration measures that cost apart (its forwards at a window's keys against a page's);
    admission charges it to every stream, so of 12 that ask at once 2 are admitted, not the 3 their first ticks fit
    (4 + 10 N ms, and 4 + 17.7 N once the window is full: 57 ms at 3, 495 frames late with this charge
    left out). Served long past their windows' filling, none misses."""
    clock, key_s = SimClock(), 1.1e-5
    engine, _ = slow_engine(parts, clock, key_s=key_s, max_context=160)
    assert engine.cost.key_seconds == pytest.approx(key_s)
    assert engine.admission.window_keys == 176
    live, refused = burst(engine, 12)
    assert len(live) == 2 and refused == 10
    serve(engine, clock, live, 120, asks_every=None)  # 480 steps each: the window is full from step 176
    assert engine.stats.deadline_misses == 0
    _, steps, _, keys, _ = engine.cost.samples[-1]  # a step sees its sink's page and 9 to 10 of the window's
    assert steps == 8 and 176 - 16 < keys / steps <= 176, keys


@pytest.mark.paced  # a server at real time: alone and last (tests/conftest.py)
def test_through_the_server_every_admitted_conversation_is_served_whole() -> None:
    """`s2s serve` as a user starts it (the shipped weights, its default threads and admission), in its own process:
    16 duplex clients, 0.1 s apart, each speaking 4 s in real time, half in pcm16 and half in Opus. Those refused are
    told why before the upgrade; every one admitted gets its whole echo back, and no deadline is missed."""
    pcm, _ = speech()
    pcm = pcm[: 4 * SAMPLE_RATE]

    async def client(url: str, i: int) -> ClientResult:
        await asyncio.sleep(0.1 * i)
        tail = np.zeros(SAMPLE_RATE, np.float32)  # a microphone goes on: the echo's half second comes back
        return await talk(url, np.concatenate([pcm, tail]), "duplex", "opus" if i % 2 else "pcm16", listen_s=1.5)

    async def clients(url: str) -> list[ClientResult]:
        return await asyncio.gather(*(client(url, i) for i in range(16)))

    with ServerProcess("--max-conversations-per-client", "0") as url:
        results = asyncio.run(clients(url))
        misses = scrape(url)["s2s_deadline_misses_total"]
    admitted = [r for r in results if r.handshake]
    refused = [r for r in results if not r.handshake]
    assert admitted, [r.errors for r in results]
    assert all(any("deadline" in e for e in r.errors) for r in refused), [r.errors for r in refused]
    assert misses == 0, f"{misses} frames late across {len(admitted)} admitted conversations"
    short = [len(r.reply) / SAMPLE_RATE for r in admitted if len(r.reply) < len(pcm) + SAMPLE_RATE // 2]
    assert not short, f"admitted conversations got back only these seconds of 5: {short}"
