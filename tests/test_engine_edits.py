"""Edits to a turn-mode conversation's context (the Realtime API's commit, clear, truncate and delete): `commit`,
`clear_input` and `remove`. After an edit, what the engine predicts is what a full forward over the edited context
predicts: the K/V of everything after the edit were computed again."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_context import masked_forward

from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.engine import Engine, EngineConfig, MetaEvent
from s2s.engine.turns import Phase

GREEDY = SamplingParams(temperature=0)
CFG = ModelConfig.preset("tiny", num_codebooks=2, codebook_size=64)


@pytest.fixture(scope="module")
def model() -> S2SModel:
    return S2SModel.from_seed(CFG, seed=1)


@pytest.fixture
def engine(model: S2SModel) -> Engine:
    cfg = EngineConfig(max_context=512, num_pages=128, calibration_ticks=0, max_reply_frames=12, frames_per_tick=4)
    return Engine(model, None, cfg)


def speak(engine: Engine, cid: str, frames: int, seed: int) -> np.ndarray:
    codes = np.random.default_rng(seed).integers(0, 60, (CFG.num_codebooks, frames))
    engine.push_codes(cid, codes)
    engine.step()
    return codes


def reply(engine: Engine, cid: str) -> None:
    engine.end_turn(cid)
    s = engine.sessions[cid]
    for _ in range(200):
        engine.step()
        if s.phase is Phase.LISTEN and s.turns[-1].reply_end is not None:
            return
    raise AssertionError("the reply did not finish")


def settle(engine: Engine, cid: str) -> None:
    """Compute every known step."""
    s = engine.sessions[cid]
    for _ in range(100):
        engine.step()
        if not len(s.ready_steps(64)):
            return


def committed(engine: Engine, cid: str) -> list[int | None]:
    events = list(engine.event_queue(cid).queue)
    return [e.data["turn"] for e in events if isinstance(e, MetaEvent) and e.data.get("event") == "committed"]


def errors(engine: Engine, cid: str) -> list[str]:
    q = engine.event_queue(cid)
    out = []
    while not q.empty():
        e = q.get()
        if isinstance(e, MetaEvent) and e.data.get("event") == "error":
            out.append(e.data["message"])
    return out


def agrees_with_full_forward(model: S2SModel, s, frames: range) -> None:
    """The engine's greedy codes of `frames` are the argmax of a full forward over the context as it is now."""
    cfg = model.config
    n = s.user_frames
    tokens = torch.from_numpy(s.key(min(s.computed, n)))
    logits = masked_forward(model, tokens, torch.ones(len(tokens), len(tokens)).tril().bool())
    logits[..., cfg.pad_id] = -torch.inf
    top2 = logits.topk(2, dim=-1)
    compared = 0
    for f in frames:
        for k, d in enumerate(cfg.delays):
            step = f + d - 1
            if step >= len(tokens) or top2.values[step, k, 0] - top2.values[step, k, 1] < 1e-3:
                continue
            compared += 1
            assert int(top2.indices[step, k, 0]) == int(s.model[f, k]), (f, k)
    assert compared > len(frames)


def test_commit_closes_a_turn_with_no_reply_and_the_next_audio_opens_another(engine: Engine) -> None:
    cid = engine.open("turn", sampling=GREEDY)
    speak(engine, cid, 10, seed=1)
    engine.commit(cid)
    speak(engine, cid, 8, seed=2)
    engine.commit(cid)
    engine.step()
    s = engine.sessions[cid]
    assert [(t.id, t.first_frame, t.committed, t.reply_start) for t in s.turns] == [
        (0, 0, True, None),
        (1, 10, True, None),
    ]
    reply(engine, cid)  # a reply to what is committed: the last turn's
    assert s.turns[1].reply_start == 18 and s.turns[0].reply_start is None
    engine.commit(cid)  # nothing new to close: no change
    engine.step()
    assert len(s.turns) == 2
    assert committed(engine, cid) == [0, 1, None]  # one answer to each commit, in order


def test_clear_drops_the_open_turn_and_keeps_what_was_committed(engine: Engine) -> None:
    cid = engine.open("turn", sampling=GREEDY)
    first = speak(engine, cid, 10, seed=1)
    engine.commit(cid)
    speak(engine, cid, 9, seed=2)
    settle(engine, cid)
    engine.clear_input(cid)
    engine.push_codes(cid, np.zeros((2, 3), np.int64))  # pushed after the clear: kept
    engine.step()
    s = engine.sessions[cid]
    assert s.user_frames == 13 and np.array_equal(s.user[:10].T, first)
    assert [t.first_frame for t in s.turns] == [0, 10]
    reply(engine, cid)
    agrees_with_full_forward(engine.model, s, range(s.turns[1].reply_start, s.turns[1].reply_end))


@pytest.mark.parametrize("keep", [0, 5])
def test_truncating_a_finished_reply_keeps_what_was_played_and_the_speech_after_it(engine: Engine, keep: int) -> None:
    cid = engine.open("turn", sampling=GREEDY)
    speak(engine, cid, 10, seed=1)
    reply(engine, cid)
    s = engine.sessions[cid]
    turn = s.turns[0]
    start, end = turn.reply_start, turn.reply_end
    played = s.model[start : start + keep].copy()
    after = speak(engine, cid, 12, seed=2)  # the user speaks again before the client tells what it played
    settle(engine, cid)
    engine.remove(cid, 0, "reply", keep)
    engine.step()
    assert turn.reply_end == start + keep and s.turns[1].first_frame >= turn.reply_end
    assert np.array_equal(s.model[start : start + keep], played)
    assert np.array_equal(s.user[s.user_frames - 12 : s.user_frames].T, after)
    assert s.user_frames == end + (s.turns[1].first_frame - turn.reply_end) + 12 - (end - start - keep)
    reply(engine, cid)  # the next reply is predicted from the edited context, computed again
    agrees_with_full_forward(engine.model, s, range(s.turns[1].reply_start, s.turns[1].reply_end))
    engine.cache.check()


def test_removing_a_reply_that_plays_cuts_it_as_a_barge_in(engine: Engine) -> None:
    cid = engine.open("turn", sampling=GREEDY)
    speak(engine, cid, 10, seed=1)
    engine.end_turn(cid)
    s = engine.sessions[cid]
    while s.complete_model_frames() < 15:
        engine.step()
    engine.remove(cid, 0, "reply", 3)
    engine.step()
    assert s.phase is Phase.LISTEN and s.turns[0].reply_end == 13 and "interrupted" in s.turns[0].times


def test_deleting_an_earlier_turns_speech_moves_the_later_turns_back(engine: Engine) -> None:
    cid = engine.open("turn", sampling=GREEDY)
    speak(engine, cid, 10, seed=1)
    reply(engine, cid)
    s = engine.sessions[cid]
    first_reply = s.model[s.turns[0].reply_start : s.turns[0].reply_end].copy()
    speak(engine, cid, 7, seed=2)
    engine.remove(cid, 0, "user")
    reply(engine, cid)
    assert s.turns[0].first_frame == 0 and s.turns[0].reply_start == 0
    assert np.array_equal(s.model[: len(first_reply)], first_reply)
    agrees_with_full_forward(engine.model, s, range(s.turns[1].reply_start, s.turns[1].reply_end))


def test_what_cannot_be_removed_is_an_error_event_and_changes_nothing(engine: Engine) -> None:
    cid = engine.open("turn", sampling=GREEDY)
    speak(engine, cid, 10, seed=1)
    reply(engine, cid)
    errors(engine, cid)
    engine.remove(cid, 7, "reply")
    speak(engine, cid, 6, seed=2)
    engine.end_turn(cid)
    engine.step()
    engine.step()
    s = engine.sessions[cid]
    frames = s.user_frames
    engine.remove(cid, 0, "user")  # the reply to turn 1 plays after it
    engine.step()
    assert errors(engine, cid) == [
        "no turn 7 in this conversation",
        "turn 0 is before the reply playing now: cancel that reply first",
    ]
    assert s.user_frames >= frames and s.turns[0].first_frame == 0
    with pytest.raises(ValueError, match="turn mode"):
        engine.remove(engine.open("duplex", admit=False), 0, "reply")  # (admission: not what this is about)
    with pytest.raises(ValueError, match="part"):
        engine.remove(cid, 0, "both")


def test_a_resumed_conversation_keeps_its_commits(engine: Engine) -> None:
    cid = engine.open("turn", sampling=GREEDY)
    speak(engine, cid, 10, seed=1)
    engine.commit(cid)
    engine.step()
    engine.close(cid, keep=True)
    engine.step()
    engine.open("turn", session_id=cid, resume=True, sampling=GREEDY)
    speak(engine, cid, 6, seed=2)  # the next turn's, not the committed one's
    s = engine.sessions[cid]
    assert [(t.id, t.committed) for t in s.turns] == [(0, True), (1, False)] and s.turns[1].first_frame == 10
    engine.remove(cid, 0, "reply")  # no finished reply: an error event, and the engine goes on
    engine.step()
    assert errors(engine, cid) == ["turn 0 has no finished reply"]
