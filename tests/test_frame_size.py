"""The codec's frame is the engine's and the server's: on a codec of 80 ms frames (1920 samples, Mimi's; a
`LevelCodec`), the tick, the duplex deadlines, the audio that comes back and the Realtime API's audio offsets count in
80 ms frames, not in EnCodec's 13.3 ms."""

from __future__ import annotations

import base64

import pytest
from clocks import SimClock
from level_codec import LevelCodec
from test_engine import slow_machine
from test_realtime import OPTIONS, client, manual, manual_turn, until
from test_server import run_with_server, speech
from tests_support import engine_read_async, engine_until

from s2s import AudioEvent, Engine, EngineConfig, ModelConfig, S2SModel, SamplingParams

FRAME = 1920  # samples: 80 ms at 24 kHz
FRAME_S = 0.08
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def parts_at_80_ms() -> tuple[S2SModel, LevelCodec]:
    return S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=2), seed=0), LevelCodec(FRAME, 2)


def duplex_run(engine: Engine, clock: SimClock, ticks: int) -> list[tuple[float, AudioEvent]]:
    """A duplex user speaking in real time, a frame a tick; each audio event with when it left the engine."""
    cid = engine.open("duplex", sampling=GREEDY, admit=False)
    out = []
    for tick in range(ticks):
        engine.push_audio(cid, speech(FRAME_S, seed=tick))
        start = clock.now
        engine.step()
        q = engine.event_queue(cid)
        out += [(clock.now, e) for e in (q.get_nowait() for _ in range(q.qsize())) if isinstance(e, AudioEvent)]
        clock.now = max(clock.now, start + engine.cfg.tick_s)
    return out


@pytest.mark.parametrize("step_s, late", [(0.04, False), (0.12, True)])
def test_the_engine_ticks_and_keeps_its_deadlines_in_the_codec_s_frames(parts_at_80_ms, step_s, late) -> None:
    """A 40 ms step keeps up with 80 ms frames (it would miss 13.3 ms ones); a 120 ms step does not. What comes back
    is every model frame, one 80 ms frame a tick, each out by its deadline: its user frame's arrival, a frame, and the
    jitter buffer (80 ms and a tick)."""
    model, codec = parts_at_80_ms
    clock = SimClock()
    engine = Engine(model, codec, EngineConfig(num_pages=400, calibration_ticks=0), clock=clock)
    slow_machine(engine, clock, step_s)
    out = duplex_run(engine, clock, ticks=40)
    assert (engine.stats.deadline_misses > 0) == late
    assert all(len(e.pcm) % FRAME == 0 for _, e in out)
    frames = [(e.first_frame + i, at) for at, e in out for i in range(len(e.pcm) // FRAME)]
    assert [f for f, _ in frames] == list(range(40))
    if not late:  # the user's frame f came in at f x 80 ms, and model frame f left in that tick (a step, 1 ms more)
        assert all(f * FRAME_S < at <= f * FRAME_S + step_s + 0.002 for f, at in frames)
    assert (engine.cfg.frame_size, engine.cfg.frames_per_tick) == (FRAME, 1)
    assert engine.cfg.tick_s == pytest.approx(FRAME_S) and engine.cfg.jitter_buffer_s == pytest.approx(2 * FRAME_S)


def test_a_codec_free_engine_keeps_encodec_s_frames_unless_its_config_names_one(parts_at_80_ms) -> None:
    model, codec = parts_at_80_ms
    assert Engine(model, None, EngineConfig(num_pages=64, calibration_ticks=0)).cfg.frame_size == 320
    cfg = EngineConfig(num_pages=64, calibration_ticks=0, frame_size=FRAME)
    assert Engine(model, None, cfg).cfg.tick_s == pytest.approx(FRAME_S)
    with pytest.raises(ValueError, match="320 samples a frame, the codec 1920"):
        Engine(model, codec, EngineConfig(num_pages=64, calibration_ticks=0, frame_size=320))


@pytest.mark.paced  # a server at real time: alone and last (tests/conftest.py)
def test_the_realtime_api_counts_a_reply_s_audio_in_the_codec_s_frames(parts_at_80_ms) -> None:
    """A reply's deltas are whole 80 ms frames, as many as the engine's reply; truncating it at 200 ms keeps 2 frames
    of it in the engine's context (not the 15 of 13.3 ms)."""

    async def body(url, server):
        engine = server.engine
        async with client(url).realtime.connect(model="gpt-realtime") as conn:
            await manual(conn)
            seen = await manual_turn(conn, seconds=1.2)
            deltas = [len(base64.b64decode(e.delta)) // 2 for e in seen if e.type == "response.output_audio.delta"]
            assert deltas and all(n % FRAME == 0 for n in deltas), deltas
            item = next(e.item_id for e in seen if e.type == "response.output_audio.delta")

            def reply() -> tuple[int, int]:  # on the engine thread
                (s,) = engine.sessions.values()
                return s.turns[0].reply_start, s.turns[0].reply_end

            start, end = await engine_read_async(engine, reply)
            assert end - start == sum(deltas) // FRAME > 2
            truncate = {"type": "conversation.item.truncate", "item_id": item, "content_index": 0, "audio_end_ms": 200}
            await conn.send(truncate)
            assert (await until(conn, "conversation.item.truncated")).audio_end_ms == 200
            kept = await engine_until(engine, lambda: (r := reply())[1] - r[0] == 2 and r, what="not cut to 2 frames")
            assert kept[0] == start

    run_with_server(parts_at_80_ms, body, OPTIONS, max_reply_frames=12)
