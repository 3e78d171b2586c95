"""The shipped echo model through `s2s serve`'s server, heard by the oracle (pocketsphinx over the held-out
sentences, `speech/oracle.py`): each reply must say its own question.

- turn mode, pcm16 and Ogg/Opus, in the naive and the radix cache: recognised at no less than 85 % of the
  originals' rate (every cache mode gives the same replies: tests/test_engine.py, test_engine_codes.py and
  test_deterministic.py), and every reply ends: its `reply_done` within the question's length and a second,
  nothing after it;
- cross-talk: 4 conversations at once with one voice prompt, in the radix cache with pages short enough to force
  preemption: no reply is ever heard as another conversation's sentence;
- duplex, Opus and pcm16: the echo is recognised at no less than 80 % of the originals' rate;
- barge-in: a reply cut after a few frames, then a new question: the next reply says the new sentence, and the
  context holds only the frames that were played.
"""

import asyncio

import numpy as np
import pytest

from bench.oracle_bench import ended, replies
from bench.oracle_bench import serve as oracle_serve
from codec import EncodecTokenizer
from s2s import Engine, EngineConfig, S2SModel, SamplingParams
from s2s.engine.events import AudioEvent, MetaEvent
from s2s.models.shipped import shipped
from s2s.training.echo_init import DUPLEX_DELAY
from speech import oracle
from speech.sentences import training_sentences
from speech.voices import TRAIN_VOICES, say


@pytest.fixture(scope="module")
def parts():
    return S2SModel.from_pretrained(shipped("model")), EncodecTokenizer.from_pretrained(shipped("codec"))


def serve(parts, body, **kw):
    return oracle_serve(*parts, body, **kw)


def serve_turns(parts, body, **kw):
    """`serve` for turn mode alone, without the engine's calibration ticks (~3 s of the shipped model on silent
    duplex streams). They seed the cost model, which only admission reads, and `serve` sets an admission headroom
    that admits everything; and they warm the engine up for a duplex stream's real time, which turn mode's replies,
    waited for, do not need. What the replies say is what these tests hear."""
    return serve(parts, body, calibration_ticks=0, **kw)


@pytest.mark.paced  # a server at real time: alone and last (tests/conftest.py)
@pytest.mark.parametrize(("cache", "offset"), [("naive", 0), ("radix", 24)], ids=["naive", "radix"])
def test_turn_replies_say_the_question(parts, takes, originals_rate, cache: str, offset: int) -> None:
    """Eight takes per cache mode at once (four in pcm16, four in Opus), a different eight for each mode. Two modes
    at the ends of the range: naive (a whole context per conversation, nothing shared) and radix (the default: pages
    shared down to part of a page). Paged and exact give the very frames naive does, which the engine's tests check
    in every mode (test_engine.py's greedy_identical_across_cache_modes_and_batches, test_engine_codes.py) and
    test_deterministic.py through the server; what this test adds is that those frames say the question."""
    some = takes[offset : offset + 8]

    async def body(url, engine):
        pcm16, opus = replies(url, some[:4], "turn", "pcm16"), replies(url, some[4:], "turn", "opus")
        return sum(await asyncio.gather(pcm16, opus), [])  # all 8 at once

    results = serve_turns(parts, body, cache_mode=cache)
    heard = oracle.rate(some, [r.reply for r in results])
    assert heard >= 0.85 * originals_rate(some), f"{cache}: replies heard {heard:.0%}"
    unended = [str(t.voice) for t, r in zip(some, results, strict=True) if not ended(t, r)]
    assert not unended, f"{cache}: replies that did not end within the question and a second, or went on: {unended}"


@pytest.mark.paced  # a server at real time: alone and last (tests/conftest.py)
def test_no_cross_talk_under_preemption(parts, takes) -> None:
    """Four conversations at once, each a different sentence, one voice prompt, radix cache, few pages."""
    model, tok = parts
    prompt = tok.encode(say(training_sentences(1, seed=5)[0], TRAIN_VOICES[0]))[0]
    some = takes[40:48:2]  # four sentences, one voice

    async def body(url, engine):
        got = await replies(url, some, "turn", "pcm16", voice="shared")
        return got, engine.snapshot().stats.preempted

    got, preemptions = serve_turns(parts, body, voices={"shared": prompt}, cache_mode="radix", num_pages=48)
    assert preemptions > 0, "the pages were not short enough to force preemption"
    heard = [oracle.heard(r.reply) for r in got]
    others = [{s.index for s in some} - {t.index} for t in some]
    assert not any(h in o for h, o in zip(heard, others, strict=True)), f"cross-talk: {heard}"
    assert sum(h == t.index for h, t in zip(heard, some, strict=True)) >= 3, heard


@pytest.mark.paced  # a server at real time: alone and last (tests/conftest.py)
def test_duplex_echo_says_the_question(parts, takes, originals_rate) -> None:
    """Sixteen takes, eight in Opus and eight in pcm16, sent in real time."""
    some = takes[48:64]

    async def body(url, engine):
        return await replies(url, some[:8], "duplex", "opus") + await replies(url, some[8:], "duplex", "pcm16")

    heard = oracle.rate(some, [r.reply for r in serve(parts, body, cache_mode="radix")])
    assert heard >= 0.8 * originals_rate(some), f"duplex echo heard {heard:.0%}"


def test_duplex_waits_quietly_then_echoes_38_frames_later(parts, takes) -> None:
    """Through the engine alone, sampled: until the delay has passed the model says the codec's quiet frame (not the
    user's first frame, nor a stray code that sets the copy going), then the user's frames 38 back."""
    model, tok = parts
    quiet = tok.encode(np.zeros(24000, np.float32))[0, :, -1].numpy()
    engine = Engine(model, tok, EngineConfig(cache_mode="radix", num_pages=512, calibration_ticks=0))
    cid = engine.open("duplex", sampling=SamplingParams(seed=12))
    pcm = np.concatenate([takes[24].pcm, np.zeros(12000, np.float32)])  # a take that starts loud
    for a in range(0, len(pcm), 1920):
        engine.push_audio(cid, pcm[a : a + 1920])
        for _ in range(8):
            engine.step()
    conv = engine.sessions[cid]
    said = np.stack([conv.model[f] for f in range(conv.complete_model_frames())])
    assert len(said) > 2 * DUPLEX_DELAY
    assert (said[1:DUPLEX_DELAY] == quiet).all(), "the duplex stream spoke before its delay"
    heard = np.stack([conv.user[f] for f in range(len(said) - DUPLEX_DELAY)])
    assert (said[DUPLEX_DELAY:] == heard).all(axis=1).mean() >= 0.95


def test_reply_after_a_voice_prompt_starts_at_the_turn(parts, takes) -> None:
    """After a voice prompt the codec's first frame of the user's stream can have a loud codebook 1 before any
    speech: the reply still starts at the turn's first loud frame, and replays the turn from there."""
    model, tok = parts
    engine = Engine(model, tok, EngineConfig(cache_mode="radix", num_pages=512, calibration_ticks=0))
    engine.add_voice("shared", tok.encode(say(training_sentences(1, seed=5)[0], TRAIN_VOICES[0]))[0])
    cid = engine.open("turn", prompt="shared", sampling=SamplingParams(seed=40))
    for a in range(0, len(takes[40].pcm), 1920):
        engine.push_audio(cid, takes[40].pcm[a : a + 1920])
        engine.step()
    engine.end_turn(cid)
    conv = engine.sessions[cid]
    while conv.turns[-1].reply_end is None:
        engine.step()
    turn = conv.turns[-1]
    user = np.stack([conv.user[f] for f in range(turn.first_frame, turn.reply_start)])
    reply = np.stack([conv.model[f] for f in range(turn.reply_start + 1, turn.reply_end)])  # after its quiet frame
    onset = int(np.flatnonzero(user[:, 0] != user[0, 0])[0])  # the turn opens on a quiet frame
    assert len(reply) >= 0.8 * (len(user) - onset), "the reply ended early"
    assert (reply[:20, 0] == user[onset : onset + 20, 0]).all(), "the reply did not start at the turn's onset"


def test_barge_in_then_a_new_question(parts, takes) -> None:
    """A reply cut after 20 frames; the next question's reply says the new sentence, and the context holds the 20
    played frames of the first reply, then the new question."""
    model, tok = parts
    engine = Engine(model, tok, EngineConfig(cache_mode="radix", num_pages=512, calibration_ticks=0))
    cid = engine.open("turn", sampling=SamplingParams(seed=7))
    conv = engine.sessions[cid] if cid in engine.sessions else None
    first, second = takes[60], takes[63]

    def say_turn(pcm: np.ndarray) -> None:
        for a in range(0, len(pcm), 1920):
            engine.push_audio(cid, pcm[a : a + 1920])
            engine.step()
        engine.end_turn(cid)

    say_turn(first.pcm)
    conv = engine.sessions[cid]
    while not conv.turns[-1].reply_start or conv.emitted - conv.turns[-1].reply_start < 30:
        engine.step()
    cut_turn = conv.turns[-1]
    played = 20
    kept = conv.model[cut_turn.reply_start : cut_turn.reply_start + played].copy()
    engine.interrupt(cid, played)
    engine.step()
    list(engine.event_queue(cid).queue)  # what was queued for the cut reply is gone (checked in test_engine)
    engine.event_queue(cid).queue.clear()
    say_turn(second.pcm)
    audio = []
    while not any(isinstance(e, MetaEvent) and e.data.get("event") == "reply_done" for e in _drain(engine, cid, audio)):
        engine.step()
    reply = np.concatenate(audio)
    assert oracle.heard(reply) == second.index
    cut = cut_turn.reply_start + played
    key = conv.key(conv.computed)
    k = model.config.num_codebooks
    assert np.array_equal(key[cut_turn.reply_start : cut, k], kept[:, 0]), "the context lost the played frames"
    delays = model.config.delays
    follows = [key[cut + d : cut + d + 5, c] for c, d in enumerate(delays)]  # frames cut.. of each user codebook
    assert (np.stack(follows) != model.config.silent_id).all(), "the next question does not follow the cut"


def _drain(engine: Engine, cid: str, audio: list) -> list:
    events = []
    queue = engine.event_queue(cid).queue
    while queue:
        e = queue.popleft()
        events.append(e)
        if isinstance(e, AudioEvent):
            audio.append(np.asarray(e.pcm))
    return events
