"""s2s/ engine fed codes: a codec-free engine (one codebook of bytes, a text model) and codes into a speech engine."""

from __future__ import annotations

import numpy as np
import pytest
from clocks import CallClock

from codec import EncodecTokenizer
from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.engine import AudioEvent, CodesEvent, Engine, EngineConfig, MetaEvent
from s2s.engine.turns import Phase

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def text_model() -> S2SModel:
    return S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=1, codebook_size=256), seed=0)


def make(model, tok=None, **kw) -> Engine:
    kw.setdefault("calibration_ticks", 0)
    return Engine(model, tok, EngineConfig(max_context=512, num_pages=200, max_reply_frames=12, **kw))


def as_bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)[None]


def reply(engine: Engine, cid: str, text: str) -> tuple[np.ndarray, list]:
    """Feed `text` as user codes, end the turn, tick until the reply is done; the streamed codes and the events."""
    engine.push_codes(cid, as_bytes(text))
    engine.end_turn(cid)
    for _ in range(200):
        engine.step()
        if engine.sessions[cid].phase is Phase.LISTEN and engine.sessions[cid].turns[-1].reply_end is not None:
            break
    q, events = engine.event_queue(cid), []
    while not q.empty():
        events.append(q.get())
    return streamed(events), events


def streamed(events: list) -> np.ndarray:
    return np.concatenate([e.codes[0] for e in events if isinstance(e, CodesEvent)])


def test_codec_free_engine_streams_codes(text_model) -> None:
    engine = make(text_model, calibration_ticks=2)  # calibration runs on codes too
    cid = engine.open("turn", sampling=GREEDY)
    codes, events = reply(engine, cid, "what is the weather like")
    turn = engine.sessions[cid].turns[-1]
    assert turn.reply_end - turn.reply_start == 12  # max_reply_frames (END is not sampled with these weights)
    first = next(e for e in events if isinstance(e, CodesEvent))
    assert not any(isinstance(e, AudioEvent) for e in events)
    assert all(e.codes.shape[0] == 1 for e in events if isinstance(e, CodesEvent))
    assert len(codes) == 12 and first.first_frame == turn.reply_start
    assert "first_audio_out" in first.times  # the stage clock: when the first codes left the engine
    done = [e for e in events if isinstance(e, MetaEvent)]
    assert done and done[-1].data["event"] == "reply_done" and done[-1].data["frames"] == 12
    second, _ = reply(engine, cid, "and tomorrow")  # a second turn in the same conversation
    assert len(second) == 12


def test_codec_free_reply_is_the_same_alone_batched_and_in_any_cache_mode(text_model) -> None:
    texts = ["hello there", "book a table for two", "hello there, again"]
    alone = []
    for text in texts:
        engine = make(text_model, cache_mode="naive")
        alone.append(reply(engine, engine.open("turn", sampling=GREEDY), text)[0])
    engine = make(text_model, cache_mode="radix")
    cids = [engine.open("turn", sampling=GREEDY) for _ in texts]
    for cid, text in zip(cids, texts, strict=True):
        engine.push_codes(cid, as_bytes(text))
        engine.end_turn(cid)
    for _ in range(200):
        engine.step()
        if all(engine.sessions[c].phase is Phase.LISTEN and engine.sessions[c].turns[-1].reply_end for c in cids):
            break
    for cid, expected in zip(cids, alone, strict=True):
        q = engine.event_queue(cid)
        assert np.array_equal(streamed([q.get() for _ in range(q.qsize())]), expected)


def test_bad_codes_and_audio_into_a_codec_free_engine_are_refused_clearly(text_model) -> None:
    engine = make(text_model)
    cid = engine.open("turn")
    with pytest.raises(ValueError, match="no codec"):
        engine.push_audio(cid, np.zeros(320, dtype=np.float32))
    with pytest.raises(ValueError, match=r"\[K=1"):
        engine.push_codes(cid, np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match=r"lie in \[0, 256\)"):
        engine.push_codes(cid, np.array([[256]]))
    with pytest.raises(KeyError):
        engine.push_codes("nobody", as_bytes("hi"))


def test_speech_engine_reply_to_codes_is_audio() -> None:
    tok = EncodecTokenizer.from_pretrained(seed=0)
    engine = make(S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0), tok)
    cid = engine.open("turn", sampling=GREEDY)
    text = as_bytes("hello there")
    engine.push_codes(cid, np.repeat(text, 2, axis=0))  # each byte on both codebooks
    with pytest.raises(ValueError, match="fed codes, not audio"):
        engine.push_audio(cid, np.zeros(320, dtype=np.float32))
    engine.end_turn(cid)
    for _ in range(100):
        engine.step()
        if engine.sessions[cid].phase is Phase.LISTEN and engine.sessions[cid].turns[-1].reply_end is not None:
            break
    q = engine.event_queue(cid)
    events = [q.get() for _ in range(q.qsize())]
    assert sum(len(e.pcm) for e in events if isinstance(e, AudioEvent)) == 12 * 320
    assert not any(isinstance(e, CodesEvent) for e in events)
    assert engine.sessions[cid].turns[-1].first_frame == 0


@pytest.mark.parametrize("mode", ["paged", "exact", "radix"])
@pytest.mark.parametrize("pages", [9, 11, 14])
def test_two_conversations_in_pages_for_one_both_answer(text_model, mode: str, pages: int) -> None:
    """Found in review: an idle listener preempted for a replying conversation locked its cached pages again on the
    next tick, and a conversation holding pages only through a cache lock was never a victim, so both waited for
    ever. Each conversation needs 7 of the 8-13 usable pages; both must answer, with the replies a roomy engine
    gives (greedy)."""
    answers = {}
    for num_pages in (200, pages):
        engine = Engine(
            text_model,
            None,
            EngineConfig(
                cache_mode=mode, max_context=512, num_pages=num_pages, max_reply_frames=12,
                calibration_ticks=0, prefill_budget=32, admission_headroom=float("inf"),
            ),
            clock=CallClock(),  # the same chunking in every run, whatever the machine's load (see clocks.py)
        )  # fmt: skip
        g = np.random.default_rng(0)
        cids = [engine.open("turn", sampling=GREEDY, admit=False) for _ in range(2)]
        for cid in cids:
            engine.push_codes(cid, g.integers(0, 256, (1, 100)))
            engine.end_turn(cid)
        for _ in range(300):
            engine.step()
            convs = [engine.sessions[c] for c in cids]
            if all(c.phase is Phase.LISTEN and c.turns[-1].reply_end is not None for c in convs):
                break
        engine.cache.check()
        answers[num_pages] = [engine.sessions[c].model[100:112, 0].copy() for c in cids]
        assert all(engine.sessions[c].turns[-1].reply_end is not None for c in cids), "a conversation never answered"
    assert all(np.array_equal(a, b) for a, b in zip(answers[200], answers[pages], strict=True))


def duplex_codes(engine: Engine, cid: str, frames: int) -> np.ndarray:
    """Feed `frames` user frames, one a tick; the model frames the conversation streamed."""
    for t in range(frames):
        engine.push_codes(cid, as_bytes("abcdefghijklmnopqrstuvwxyz"[t % 26]))
        engine.step()
    q = engine.event_queue(cid)
    return streamed([q.get() for _ in range(q.qsize())])


@pytest.mark.parametrize("mode", ["naive", "paged", "exact", "radix"])
def test_duplex_on_cached_prompts_speaks_the_same_whatever_the_prefix_reused(text_model, mode: str) -> None:
    """Duplex conversations on voice prompts that an earlier one cached: one the same (32 steps, two whole pages),
    one sharing its first 20 steps (a page and 4 steps). Regression: radix matched all 32 steps of the page-aligned
    prompt, leaving nothing to compute its first frame from, and the conversation never spoke. Exact reuses whole
    pages but never the key's last step; radix also copies the steps of a partly matching page (copy-on-write)."""
    g = np.random.default_rng(3)
    prompt = g.integers(0, 256, (1, 32))
    branch = np.concatenate([prompt[:, :20], g.integers(0, 256, (1, 12))], axis=1)
    engine = make(text_model, cache_mode=mode)
    first = engine.open("duplex", prompt=prompt, sampling=GREEDY)
    expected = duplex_codes(engine, first, 12)
    engine.close(first)
    same = engine.open("duplex", prompt=prompt, sampling=GREEDY)
    engine._apply_commands()
    assert engine.sessions[same].cached_at_open == {"exact": 16, "radix": 31}.get(mode, 0)
    assert np.array_equal(duplex_codes(engine, same, 12), expected) and len(expected) == 12
    engine.close(same)
    alone = make(text_model, cache_mode="naive")
    reference = duplex_codes(alone, alone.open("duplex", prompt=branch, sampling=GREEDY), 12)
    other = engine.open("duplex", prompt=branch, sampling=GREEDY)
    engine._apply_commands()
    assert engine.sessions[other].cached_at_open == {"exact": 16, "radix": 20}.get(mode, 0)
    assert np.array_equal(duplex_codes(engine, other, 12), reference)
    assert engine.stats.copied_steps == (15 + 4 if mode == "radix" else 0)
    engine.cache.check()
