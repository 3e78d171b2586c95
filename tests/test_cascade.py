"""server/cascade.py: the cascade answers a turn over the websocket with audio and its per-stage timestamps."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from codec import EncodecTokenizer
from s2s import Engine, EngineConfig, ModelConfig, S2SModel
from server.cascade import CascadeServer, printable, split_phrase, text_engine_for
from server.client import talk
from server.speech import speech

STAGES = ["endpoint", "stt_done", "llm_first_token", "phrase_ready", "tts_first_audio", "sent"]


def test_phrases_and_printable_bytes() -> None:
    assert split_phrase("  abc de", 1) == ("abc", "de")
    assert split_phrase("abc", 1) is None
    assert split_phrase("abc defg hij klm", 5) == ("abc defg", "hij klm")
    text = printable(np.arange(300))
    assert len(text) == 300 and set(text) <= set("abcdefghijklmnopqrstuvwxyz ")


@pytest.mark.parametrize("tts", ["espeak", "engine"])
def test_cascade_answers_a_turn(tts: str) -> None:
    tok = EncodecTokenizer.from_pretrained(seed=0)
    cfg = EngineConfig(calibration_ticks=0, max_conversations=2, max_reply_frames=75, frames_per_tick=4)
    speech_engine = Engine(S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0), tok, cfg)
    text_engine = text_engine_for("tiny", 75, 2, calibration_ticks=0)
    wav, _ = speech("What is the weather like tomorrow?")

    async def run():
        server = CascadeServer(text_engine, speech_engine, port=0, stt_decoders=1)
        port = await server.start()
        try:
            return await talk(f"ws://127.0.0.1:{port}", wav, "turn", "pcm16", speed=4, listen_s=30, tts=tts, seed="1")
        finally:
            await server.stop()

    result = asyncio.run(run())
    assert result.handshake and not result.errors
    assert len(result.reply) > 0 and result.turn_latency_s is not None
    first = next(m for m in result.metadata if m.get("event") == "first_audio")
    times = [first["times"][k] for k in STAGES]
    assert times == sorted(times), first["times"]
    assert any(m.get("event") == "reply_done" for m in result.metadata)
