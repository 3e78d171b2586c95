"""s2s/duplex_lane.py: steady duplex conversations stepped as rows of arrays compute what the scheduler computes."""

from __future__ import annotations

import numpy as np
import pytest

from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine import CodesEvent, Engine, EngineConfig, MetaEvent

K = 3  # delays 0, 1, 2


class WithoutLane(Engine):
    duplex_lane = False


@pytest.fixture(scope="module")
def model() -> S2SModel:
    return S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=K, codebook_size=64), seed=0)


def run(engine_class: type[Engine], model: S2SModel, num_pages: int) -> tuple[dict, dict, int]:
    """A scripted mix on a bounded context: duplex conversations with and without a shared voice prompt, fed
    uneven blocks, one paused and started again, one restarted, one closed and another opened meanwhile, beside
    turn conversations. Returns each conversation's streamed codes and meta events, and the steps the lane took."""
    cfg = EngineConfig(
        max_context=48,
        num_pages=num_pages,
        calibration_ticks=0,
        max_conversations=12,
        frames_per_tick=4,
        max_reply_frames=10,
        deterministic=True,  # a step's logits do not depend on its batch: rows may come in any order
    )
    engine = engine_class(model, None, cfg)
    lane_steps, ahead = [0], [0]
    forward = engine.runner.forward

    def counted(work, lane=None):
        lane_steps[0] += len(lane) if lane is not None else 0
        return forward(work, lane)

    engine.runner.forward = counted
    rng = np.random.default_rng(0)
    engine.add_voice("v", rng.integers(0, 64, (K, 20)))
    cids = [
        engine.open("duplex", prompt="v" if i % 2 else None, sampling=SamplingParams(seed=i, top_k=20))
        for i in range(6)
    ]
    turns = [engine.open("turn", sampling=SamplingParams(seed=10 + i)) for i in range(2)]
    streams = {cid: rng.integers(0, 64, (K, 400)) for cid in cids}
    fed = dict.fromkeys(cids, 0)
    for tick in range(90):
        if tick == 20:
            engine.pause(cids[1])
        if tick == 30:
            engine.unpause(cids[1])
        if tick == 40:
            engine.restart(cids[2])
        if tick == 50:
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
        behind = any(  # the loop's question, asked of every session the slow way
            s.mode == "duplex" and not s.paused and s.step_token(s.computed) is not None and s.wanted_after(1)
            for s in engine.sessions.values()
        )
        assert engine._behind() == behind, tick
        ahead[0] += behind
    codes, meta = {}, {}
    for cid in [*cids, *turns]:
        q = engine.event_queue(cid)
        events = [q.get() for _ in range(q.qsize())]
        got = [e.codes for e in events if isinstance(e, CodesEvent)]
        codes[cid] = np.concatenate(got, axis=1) if got else np.zeros((K, 0))
        meta[cid] = [{k: v for k, v in e.data.items() if k != "times"} for e in events if isinstance(e, MetaEvent)]
    assert ahead[0] > 5, "some ticks ended with input ahead of real time"
    return codes, meta, lane_steps[0], engine.stats.preempted


@pytest.mark.parametrize("num_pages", [400, 28])
def test_the_lane_streams_what_the_scheduler_streams(model, num_pages: int) -> None:
    """The same scripted mix with and without the lane: every conversation streams the same codes and meta events,
    with plenty of pages and with a pool short enough that conversations preempt each other."""
    with_lane, without = run(Engine, model, num_pages), run(WithoutLane, model, num_pages)
    assert with_lane[2] > 1000 and without[2] == 0, "the lane took the steady duplex steps"
    if num_pages == 28:
        assert with_lane[3] > 0 and without[3] > 0, "the pool was short"
    for cid, codes in without[0].items():
        assert codes.shape[1] > 20, cid  # each spoke
        np.testing.assert_array_equal(with_lane[0][cid], codes, err_msg=cid)
    assert with_lane[1] == without[1]
