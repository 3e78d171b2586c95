"""s2s/scheduling/duplex_lane.py: steady duplex conversations stepped as rows of arrays compute what the scheduler
computes."""

from __future__ import annotations

import numpy as np
import pytest
from clocks import SimClock

from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.engine import CodesEvent, Engine, EngineConfig, MetaEvent

K = 3  # delays 0, 1, 2


class WithoutLane(Engine):
    duplex_lane = False


@pytest.fixture(scope="module")
def model() -> S2SModel:
    return S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=K, codebook_size=64), seed=0)


def run(
    engine_class: type[Engine],
    model: S2SModel,
    num_pages: int,
    seed: int,
    edits: bool,
    frame_limit: int | None = None,
    page_size: int = 16,
) -> tuple:
    """A scripted mix on a bounded context: duplex conversations with and without a shared voice prompt, fed
    uneven blocks, beside turn conversations; with `edits`, one paused and started again, one restarted, one closed
    and another opened meanwhile. After each tick, the engine loop's `_behind` is checked against every session.
    `frame_limit`: the frames a row of the engine's `FrameRows` may hold; `page_size`: the cache's (below a tick's
    4 rounds, a row's steps need pages in more than one round of a tick). Returns each conversation's events (codes
    by first frame, and meta), the steps the lane took, who was preempted at which tick, how often the pool ran out,
    how many sessions' frames left the rows (at the end of a tick, summed over the ticks), and how often rows that
    needed a page got it at once and how often through the scheduler."""
    cfg = EngineConfig(
        max_context=48,
        page_size=page_size,
        num_pages=num_pages,
        calibration_ticks=0,
        max_conversations=12,
        frames_per_tick=4,
        max_reply_frames=10,
        deterministic=True,  # a step's logits do not depend on its batch: rows may come in any order
    )
    clock = SimClock()  # deadlines, and so the order of picks and victims, follow the script, not the machine
    engine = engine_class(model, None, cfg, clock=clock)
    if frame_limit is not None:
        engine.user_rows.limit = engine.model_rows.limit = frame_limit
    lane_steps, ahead, left = [0], [0], 0
    forward = engine.runner.forward

    def counted(batch):
        lane_steps[0] += len(batch.lane) if batch.lane is not None else 0
        return forward(batch)

    engine.runner.forward = counted
    tick, victims, preempt = 0, [], engine.kv.preempt

    def preempted(s) -> None:
        victims.append((tick, s.id))
        preempt(s)

    engine.kv.preempt = preempted
    at_once, grow_steps = [0, 0], engine.kv.grow_steps  # rows' pages given at once, and not (the scheduler's)

    def counted_grow(sessions, spare) -> bool:
        grown = grow_steps(sessions, spare)
        at_once[0 if grown else 1] += 1
        return grown

    engine.kv.grow_steps = counted_grow
    rng = np.random.default_rng(seed)
    engine.add_voice("v", rng.integers(0, 64, (K, 20)))
    cids = [
        engine.open("duplex", prompt="v" if i % 2 else None, sampling=SamplingParams(seed=i, top_k=20))
        for i in range(6)
    ]
    turns = [engine.open("turn", sampling=SamplingParams(seed=10 + i)) for i in range(2)]
    streams = {cid: rng.integers(0, 64, (K, 400)) for cid in cids}
    fed = dict.fromkeys(cids, 0)
    for tick in range(90):
        if tick == 20 and edits:
            engine.pause(cids[1])
        if tick == 30 and edits:
            engine.unpause(cids[1])
        if tick == 40 and edits:
            engine.restart(cids[2])
        if tick == 50 and edits:
            engine.close(cids[3])
            cids[3] = engine.open("duplex", prompt="v", sampling=SamplingParams(seed=99), admit=False)
            streams[cids[3]], fed[cids[3]] = rng.integers(0, 64, (K, 400)), 0
        for cid in cids:
            n = int(rng.integers(0, 8)) if tick % 7 else 0  # uneven blocks, and ticks with none
            if n:
                engine.push_codes(cid, streams[cid][:, fed[cid] : fed[cid] + n])
                fed[cid] += n
        if tick % 15 == 0:
            for cid in turns:
                engine.push_codes(cid, rng.integers(0, 64, (K, 6)))
                engine.end_turn(cid)
        engine.step()
        clock.now += cfg.tick_s
        behind = any(  # the loop's question, asked of every session the slow way
            s.mode == "duplex" and not s.paused and s.step_token(s.computed) is not None and s.wanted_after(1)
            for s in engine.sessions.values()
        )
        assert engine._behind() == behind, tick
        for s in engine.sessions.values():  # `KVManager.tables` mirrors each session's page list
            table = engine.kv.tables
            assert table.array[s.row, : table.lengths[s.row]].tolist() == s.pages, (tick, s.id)
            assert not table.array[s.row, table.lengths[s.row] :].any(), (tick, s.id)
        ahead[0] += behind
        left += sum(s.user.rows is None or s.model.rows is None for s in engine.sessions.values())
    events = {}
    for cid in [*cids, *turns]:
        q = engine.event_queue(cid)
        events[cid] = [
            (e.first_frame, e.codes.tolist())
            if isinstance(e, CodesEvent)
            else {k: v for k, v in e.data.items() if k != "times"}
            for e in (q.get() for _ in range(q.qsize()))
            if isinstance(e, CodesEvent | MetaEvent)
        ]
        assert q.frames == 0, "the frames the engine counted as it put its events are those read"
    assert ahead[0] > 5, "some ticks ended with input ahead of real time"
    return events, lane_steps[0], victims, engine.stats.out_of_pages, left, at_once


@pytest.mark.parametrize(
    ("num_pages", "seed", "edits", "page_size"),
    [(400, 0, True, 16), (28, 0, True, 16), (24, 1, False, 16), (800, 2, True, 2)],
)
def test_the_lane_streams_what_the_scheduler_streams(
    model, num_pages: int, seed: int, edits: bool, page_size: int
) -> None:
    """The same scripted mix with and without the lane: every conversation gets the same events, tick for tick, and
    the same conversations are preempted at the same ticks, with plenty of pages and with a pool short enough that
    they preempt each other (a row whose step needs a page then competes for it in deadline order), and with pages
    shorter than a tick."""
    with_lane, without = (run(c, model, num_pages, seed, edits, page_size=page_size) for c in (Engine, WithoutLane))
    assert with_lane[1] > 1000 and without[1] == 0, "the lane took the steady duplex steps"
    assert with_lane[5][0] > 0, "rows that needed a page got it at once"
    if num_pages < 400:
        assert len(without[2]) > 0, "the pool was short"
        assert with_lane[5][1] > 0, "and rows that needed a page then went through the scheduler"
    spoke = [sum(len(e[1][0]) for e in events if isinstance(e, tuple)) for events in without[0].values()]
    assert sum(n > 20 for n in spoke) >= 6, spoke
    for cid, events in without[0].items():
        assert with_lane[0][cid] == events, cid
    assert with_lane[2:4] == without[2:4]


def test_sessions_whose_frames_outgrow_the_rows_stream_the_same(model) -> None:
    """Rows of the engine's `FrameRows` too short for what sessions that fall behind hold (a pool short enough to
    preempt them): those leave the rows for arrays of their own, and go through the scheduler, with the same events
    and the same preemptions as with rows long enough for all."""
    limited, roomy = run(Engine, model, 24, 1, False, frame_limit=96), run(Engine, model, 24, 1, False, 4096)
    assert limited[4] > 0 and roomy[4] == 0, "some sessions' frames left the rows, and only where they were short"
    assert limited[1] > 1000, "the others stepped in the lane"
    assert limited[0] == roomy[0] and limited[2:4] == roomy[2:4]


def test_the_host_reads_a_round_s_codes_only_once_the_next_round_is_on_the_device(model) -> None:
    """Lane-only rounds keep their sampled codes on the device: the next round's forward takes them there, and the
    host reads them (a wait on the device) after that forward is given, not before: in a steady tick of 4 rounds,
    forward, forward, read, forward, read, forward, read, then the last read as the steps go back."""
    engine = Engine(model, None, EngineConfig(num_pages=400, calibration_ticks=0, frames_per_tick=4))
    log: list[str] = []
    forward, write_pending = engine.runner.forward, engine.lane._write_pending

    def logged_forward(batch):
        log.append("forward")
        return forward(batch)

    def logged_write_pending():
        if engine.lane._pending is not None:
            log.append("read")
        write_pending()

    engine.runner.forward, engine.lane._write_pending = logged_forward, logged_write_pending
    cids = [engine.open("duplex", sampling=SamplingParams(seed=i)) for i in range(3)]
    rng = np.random.default_rng(0)
    ticks = []
    for _ in range(12):
        for cid in cids:
            engine.push_codes(cid, rng.integers(0, 64, (K, 4)))
        log.clear()
        engine.step()
        ticks.append(list(log))
    steady = ["forward", "forward", "read", "forward", "read", "forward", "read", "read"]
    assert sum(t == steady for t in ticks) >= 6, ticks  # (a tick whose rows need pages gives their steps back early)
    assert all(t.count("read") <= t.count("forward") for t in ticks), ticks
