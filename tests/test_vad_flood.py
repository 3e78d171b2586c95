"""Flood control (server/vad/endpointer.py, server/vad/turn_gate.py): a spurious turn costs no reply, a real one still
gets its reply, a saturated engine answers only confident turns, and a turn the user only paused in is taken back."""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import generate_latest
from test_server import http_get, metric, metrics_when, run_with_server
from tests_support import engine_until, until

from codec.pcm import to_pcm16
from s2s import Engine, EngineConfig, ModelConfig, S2SModel, SamplingParams
from s2s.engine.turns import Phase
from server.moshi import protocol
from server.vad.config import TurnScore, VadConfig
from server.vad.endpointer import Endpointer
from server.vad.turn_gate import TurnGate
from speech.sample import synthesize

PLAIN = VadConfig(min_speech_s=0, min_confidence=0, resume_s=0)  # the endpointer before flood control


def voiced(text: str) -> np.ndarray:
    wav = synthesize(text)
    loud = np.flatnonzero(np.abs(wav) > 0.01)
    return wav[loud[0] : loud[-1] + 1]


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(24000 * seconds), np.float32)


@pytest.fixture(scope="module")
def fragment() -> np.ndarray:
    """150 ms of "Hey": speech to Silero, too short to be a turn."""
    return voiced("Hey")[:3600]


@pytest.fixture(scope="module")
def sentence() -> np.ndarray:
    return voiced("Book a table for two, please.")


def endpoint(cfg: VadConfig, *parts: np.ndarray, gate: TurnGate | None = None) -> tuple[list[str], Endpointer]:
    vad, events, audio = Endpointer(cfg, gate), [], np.concatenate(parts)
    for a in range(0, len(audio), 1920):
        events += vad.push(audio[a : a + 1920])
    return events, vad


def saturated_engine(reply_phases: int, tick_s: float = 0.0, listening: int = 2) -> SimpleNamespace:
    """What `TurnGate` reads of an engine: its snapshot (its sessions: replies in flight, and `listening` others;
    recent tick times) and `cfg.tick_s`."""
    stats = SimpleNamespace(ticks=1, recent_tick_seconds=deque([tick_s] * 16))
    sessions = [{"phase": "reply"}] * reply_phases + [{"phase": "listen"}] * listening
    snapshot = SimpleNamespace(stats=stats, sessions=sessions)
    return SimpleNamespace(snapshot=lambda: snapshot, cfg=SimpleNamespace(tick_s=0.05))


def test_a_short_fragment_is_no_turn(fragment) -> None:
    before, _ = endpoint(PLAIN, silence(0.5), fragment, silence(1.0))
    assert before == ["speech_start", "end_of_turn"]  # what used to cost a reply
    gate = TurnGate(saturated_engine(0), VadConfig())
    events, vad = endpoint(VadConfig(), silence(0.5), fragment, silence(1.0), gate=gate)
    assert events == ["speech_start", "speech_end"] and vad.turn.problem(vad.cfg) == "short"
    assert gate.dropped == {"short": 1} and gate.passed == 0


def test_a_real_utterance_is_a_confident_turn(sentence) -> None:
    events, vad = endpoint(VadConfig(), silence(0.5), sentence, silence(1.0))
    assert events == ["speech_start", "end_of_turn"]
    assert vad.turn.confidence >= vad.cfg.confident and vad.turn.speech_s > 1


def test_a_pause_takes_the_turn_back_and_a_fainter_voice_does_not(sentence) -> None:
    events, vad = endpoint(VadConfig(), sentence, silence(0.8), sentence, silence(1.0))
    assert events == ["speech_start", "end_of_turn", "take_back", "end_of_turn"]
    assert vad.turn.speech_s > 2 * 1.0  # the two stretches as one turn
    events, _ = endpoint(VadConfig(), sentence, silence(0.8), sentence * 0.05, silence(1.0))
    assert events[:3] == ["speech_start", "end_of_turn", "speech_start"]  # someone else: a turn of its own


def test_the_gate_drops_unsure_turns_only_when_saturated() -> None:
    unsure, sure = TurnScore(1.0, 0.9, -36.0, 0.6), TurnScore(1.0, 0.95, -20.0, 0.95)
    idle = TurnGate(saturated_engine(reply_phases=0, tick_s=0.01), VadConfig())
    assert idle.admit(unsure) and idle.admit(sure)
    busy = TurnGate(saturated_engine(reply_phases=0, tick_s=0.045), VadConfig())  # ticks 90 % of their budget
    assert not busy.admit(unsure) and busy.admit(sure)
    full = TurnGate(saturated_engine(reply_phases=3, tick_s=0.01), VadConfig(max_replies=3))
    assert not full.admit(unsure) and full.admit(sure)
    assert full.dropped == {"saturated": 1} and full.passed == 1
    alone = TurnGate(saturated_engine(reply_phases=0, tick_s=0.045, listening=1), VadConfig())
    assert alone.admit(unsure) and not alone.dropped  # the one conversation: its replies delay nobody else's
    text = generate_latest(full.registry).decode()
    assert 's2s_turns_dropped_total{reason="saturated"} 1.0' in text and "s2s_turns_passed_total 1.0" in text


def test_the_gate_counts_replies_in_the_engines_snapshot() -> None:
    model = S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=2), seed=0)
    engine = Engine(model, None, EngineConfig(calibration_ticks=0, num_pages=64, max_reply_frames=50))
    gate = TurnGate(engine, VadConfig(max_replies=2, busy_share=100))
    unsure = TurnScore(1.0, 0.9, -36.0, 0.6)
    cids = [engine.open("turn", sampling=SamplingParams(temperature=0)) for _ in range(2)]  # no END drawn by chance
    assert gate.admit(unsure)  # none in flight
    for cid in cids:
        engine.push_codes(cid, np.ones((2, 8), np.int64))
        engine.end_turn(cid)
    for _ in range(3):
        engine.step()
    assert all(s.phase is Phase.REPLY for s in engine.sessions.values())
    assert not gate.admit(unsure) and gate.dropped == {"saturated": 1}


@pytest.mark.paced  # a server at real time: alone and last (tests/conftest.py)
def test_through_the_server_a_fragment_gets_no_reply_and_a_pause_is_taken_back(parts, fragment, sentence) -> None:
    """Over one connection: a fragment (no turn), a sentence (a turn: its reply starts), a pause of 0.8 s and
    another sentence (the reply is cancelled unheard), then silence (one reply, to both sentences)."""
    audio = np.concatenate([silence(0.3), fragment, silence(1.0), sentence, silence(0.8), sentence, silence(1.0)])
    pcm = to_pcm16(audio)

    async def body(url, server):
        from websockets.asyncio.client import connect

        async with connect(f"{url}/api/chat?mode=turn&codec=pcm16") as ws:
            for a in range(0, len(pcm), 3840):
                await ws.send(protocol.audio(pcm[a : a + 3840]))
            # the gate's counts (every front end's, with front ends): until it has passed the second end of turn
            await until(
                lambda: metrics_when(url, lambda text: metric(text, "s2s_turns_passed_total") == 2),
                what="the gate did not pass two turns",
            )
            engine = server.engine

            def replying() -> list | None:  # on the engine thread: the turns, once the second has its reply started
                (s,) = engine.sessions.values()
                return (
                    [replace(t, times=dict(t.times)) for t in s.turns] if s.turns[-1].reply_start is not None else None
                )

            turns = await engine_until(engine, replying, 20, "the second end of turn did not start a reply")
            gate = await http_get(f"{url}/metrics")
            ws.transport.abort()  # not a close: the server reads no close frame while it paces the audio still due
            return gate, turns

    gate, turns = run_with_server(parts, body, max_reply_frames=400)
    assert metric(gate, "s2s_turns_dropped_total", 'reason="short"') == 1
    assert metric(gate, "s2s_turns_dropped_total", 'reason="unsure"') == 0
    assert metric(gate, "s2s_turns_dropped_total", 'reason="saturated"') == 0
    assert metric(gate, "s2s_turns_taken_back_total") == 1 and metric(gate, "s2s_turns_passed_total") == 2
    first, second = turns
    assert "interrupted" in first.times and first.reply_end == first.reply_start  # taken back: nothing kept
    assert second.reply_start is not None
