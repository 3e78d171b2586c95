"""s2s/engine/resumable.py: what closed conversations keep for a resume, bounded by count, bytes and time, and only
when their close asks (`close(cid, keep=True)`)."""

from __future__ import annotations

import numpy as np
import pytest
from clocks import SimClock

from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.engine import Engine, EngineConfig
from s2s.engine.resumable import Resumable

GREEDY = SamplingParams(temperature=0)
CFG = ModelConfig.preset("tiny", num_codebooks=2, codebook_size=64)


@pytest.fixture(scope="module")
def model() -> S2SModel:
    return S2SModel.from_seed(CFG, seed=1)


def make(model: S2SModel, clock: SimClock | None = None, **kw) -> Engine:
    cfg = dict(max_context=512, num_pages=128, calibration_ticks=0, frames_per_tick=4) | kw
    return Engine(model, None, EngineConfig(**cfg), **({"clock": clock} if clock else {}))


def speak(engine: Engine, cid: str, frames: int, seed: int = 0) -> None:
    engine.push_codes(cid, np.random.default_rng(seed).integers(0, 60, (CFG.num_codebooks, frames)))
    engine.step()


def test_the_oldest_go_past_the_count_and_past_the_bytes() -> None:
    table = Resumable(max_count=2, max_bytes=100, ttl_s=60, clock=SimClock())
    for cid in "abc":
        table.put(cid, {"cid": cid}, 10)
    assert [c in table for c in "abc"] == [False, True, True] and table.nbytes == 20
    table.put("d", {"cid": "d"}, 95)  # over the count, then the bytes: b and c go, oldest first
    assert [c in table for c in "bcd"] == [False, False, True] and table.nbytes == 95
    assert table.take("d") == {"cid": "d"} and "d" not in table and table.nbytes == 0
    table.put("e", {"cid": "e"}, 101)  # alone over the bytes: not kept at all
    assert "e" not in table and table.nbytes == 0 and table.take("e") is None


def test_a_place_held_at_close_takes_its_context_in_the_engines_turn() -> None:
    table = Resumable(max_count=4, max_bytes=100, ttl_s=60, clock=SimClock())
    table.put("a")
    assert "a" in table and table.nbytes == 0
    table.put("a", {"cid": "a"}, 30)
    assert len(table) == 1 and table.nbytes == 30 and table.take("a") == {"cid": "a"}


def test_what_is_kept_expires_on_the_clock_with_no_open(model: S2SModel) -> None:
    clock = SimClock()
    engine = make(model, clock, session_ttl_s=10)
    cid = engine.open("duplex", sampling=GREEDY)
    speak(engine, cid, 40)
    engine.close(cid, keep=True)
    engine.step()
    assert cid in engine.resumable and engine.resumable.nbytes > 0
    clock.now += 10.5
    engine.step()  # a tick, nothing opened
    assert len(engine.resumable) == 0 and engine.resumable.nbytes == 0
    with pytest.raises(KeyError, match="resume"):
        engine.open("duplex", session_id=cid, resume=True)


def test_a_resume_right_after_the_close_gets_the_whole_context(model: S2SModel) -> None:
    """Closed and resumed twice before the engine ticks: each open gets what the close before it kept."""
    engine = make(model)
    cid = engine.open("turn", sampling=GREEDY, session_id="alice")
    speak(engine, cid, 30)
    frames = engine.sessions[cid].user_frames
    for _ in range(2):
        engine.close(cid, keep=True)
        engine.open("turn", sampling=GREEDY, session_id=cid, resume=True)
    engine.step()
    s = engine.sessions[cid]
    assert s.user_frames == frames and len(s.turns) == 1
    assert len(engine.resumable) == 0  # taken by the open that resumed it
    engine.close(cid, keep=True)
    engine.step()
    # its streams' frames alone, not the width of the engine's frame rows
    assert engine.resumable.nbytes == 2 * frames * CFG.num_codebooks * 8


def test_a_close_without_keep_keeps_nothing(model: S2SModel) -> None:
    engine = make(model)
    for i in range(20):
        cid = engine.open("duplex", sampling=GREEDY)
        speak(engine, cid, 20, seed=i)
        engine.close(cid)
        engine.step()
    assert len(engine.resumable) == 0 and engine.resumable.nbytes == 0
    with pytest.raises(KeyError, match="resume"):
        engine.open("duplex", session_id=cid, resume=True)


def test_the_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="resumable_bytes"):
        EngineConfig(resumable_bytes=-1)
