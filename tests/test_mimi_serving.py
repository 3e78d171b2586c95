"""Mimi served end to end: a tiny random Mimi saved as Kyutai's file (its config beside it), loaded from its path as
`s2s serve --codec FILE` loads it, with a seeded `tiny` model of its codebooks. The engine hears what the codec
encodes offline and keeps every 80 ms frame's deadline (a simulated clock); a duplex pcm16 client of `s2s serve` gets
its audio back in whole 80 ms frames; `s2s roundtrip --codec FILE` streams as the offline paths code and decode."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest
from clocks import SimClock
from test_engine import slow_machine
from test_frame_size import FRAME
from test_mimi import kyutai_config
from test_server import speech, through_frontends
from tests_support import FRONTENDS

from codec import MimiTokenizer
from codec.pcm import load_wav, save_wav
from s2s import AudioEvent, Engine, EngineConfig, ModelConfig, S2SModel, SamplingParams
from s2s.build import load_codec
from server.app import ChatServer, ServerOptions
from server.cli.engine_args import engine_of
from server.cli.main import main, parser
from server.moshi.client import talk

TINY_MIMI = kyutai_config([8, 6, 5, 4], 12.5)  # Kyutai's Mimi's shape (80 ms frames) at small widths: 8 codebooks of 64


@pytest.fixture(scope="module")
def mimi_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mimi") / "mimi.safetensors"
    MimiTokenizer.random(TINY_MIMI, seed=0).save_pretrained(path)
    return path


def test_the_engine_hears_mimi_s_codes_and_keeps_its_80_ms_deadlines(mimi_file) -> None:
    """2 s of duplex speech, a frame a tick, on a machine whose step takes 40 ms: every model frame comes out once, in
    whole 80 ms frames, none late; the user frames the engine heard are the codec's offline codes of that speech. The
    model's codebooks are delayed as Moshi's are (the acoustic ones a step after the semantic one): the default, a
    step more for each codebook, would hold a frame back 7 x 80 ms, past its deadline."""
    tok = load_codec(mimi_file)
    moshi_delays = [0] + [1] * (tok.num_codebooks - 1)
    shape = ModelConfig.preset(
        "tiny", num_codebooks=tok.num_codebooks, codebook_size=tok.codebook_size, delays=moshi_delays
    )
    clock = SimClock()
    engine = Engine(S2SModel.from_seed(shape, seed=0), tok, EngineConfig(num_pages=400, calibration_ticks=0), clock)
    slow_machine(engine, clock, step_s=0.04)
    said = (0.3 * np.random.default_rng(0).standard_normal(25 * FRAME)).clip(-1, 1).astype(np.float32)
    cid = engine.open("duplex", sampling=SamplingParams(temperature=0), admit=False)
    out = []
    for tick in range(25):  # the user speaks in real time
        engine.push_audio(cid, said[tick * FRAME : (tick + 1) * FRAME])
        start = clock.now
        engine.step()
        q = engine.event_queue(cid)
        out += [e for e in (q.get_nowait() for _ in range(q.qsize())) if isinstance(e, AudioEvent)]
        clock.now = max(clock.now, start + engine.cfg.tick_s)
    assert (engine.cfg.frame_size, engine.cfg.frames_per_tick) == (FRAME, 1)
    assert engine.stats.deadline_misses == 0
    assert all(len(e.pcm) % FRAME == 0 and np.isfinite(e.pcm).all() for e in out)
    assert [e.first_frame + i for e in out for i in range(len(e.pcm) // FRAME)] == list(range(25))
    session = engine.sessions[cid]
    heard, codes = session.user[: session.user_frames].T, tok.encode(said)[0].numpy()
    assert len(np.unique(codes)) > 20  # varied codes, frame to frame
    np.testing.assert_array_equal(heard, codes)


@pytest.mark.paced  # a server at real time: alone and last (tests/conftest.py)
def test_s2s_serve_with_a_mimi_file_answers_in_whole_80_ms_frames(mimi_file) -> None:
    args = parser().parse_args(
        ["serve", "--codec", str(mimi_file), "--preset", "tiny", "--threads", "1", "--admission-headroom", "inf"]
    )
    engine, tok = engine_of(args)
    assert isinstance(tok, MimiTokenizer)
    assert (engine.cfg.frame_size, engine.cfg.frames_per_tick) == (FRAME, 1)  # the tick nearest 50 ms: one frame
    sizes: list[int] = []

    def on_audio(arrival: tuple[float, int]) -> None:
        sizes.append(arrival[1])

    async def body(url: str, server) -> object:
        return await talk(url, speech(2.0), mode="duplex", codec="pcm16", listen_s=1.0, on_audio=on_audio)

    async def serve() -> object:
        if FRONTENDS:
            return await through_frontends(engine, ServerOptions(port=0), body)
        server = ChatServer(engine, ServerOptions(port=0))
        port = await server.start()
        try:
            return await body(f"ws://127.0.0.1:{port}", server)
        finally:
            await server.stop()

    result = asyncio.run(serve())
    assert result.handshake and not result.errors
    assert sizes and all(n % FRAME == 0 for n in sizes), sizes
    assert len(result.reply) >= 16 * FRAME  # a frame for each frame heard (25) but the last 7 (the codebooks' delays)


def test_roundtrip_streams_a_mimi_file_as_its_offline_paths(mimi_file, tmp_path, capsys) -> None:
    wav = tmp_path / "speech.wav"
    save_wav(wav, speech(2.0))
    main(["roundtrip", "--codec", str(mimi_file), "--wav", str(wav), "--out", str(tmp_path / "out.wav")])
    out = capsys.readouterr().out
    assert f"codec: Mimi, 8 of 8 codebooks of 64, 1920-sample frames (12.5 Hz), checkpoint {mimi_file}" in out
    assert "codes: 25 frames x 8 codebooks" in out
    assert "streaming codes equal offline encode(): True" in out
    diff = re.search(r"streaming audio vs offline decode\(\): max \|diff\| (\S+) \(from frame 0 on\)", out)
    assert diff and float(diff[1]) <= 1e-4, out
    assert len(load_wav(tmp_path / "out.wav")) == 25 * FRAME
