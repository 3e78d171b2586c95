"""Scheduler: which prefill a tick's step budget goes to first."""

from __future__ import annotations

import numpy as np

from s2s.engine.session import Session
from s2s.engine.turns import Phase, Turn
from s2s.models.config import ModelConfig
from s2s.runner.sampling import SamplingParams
from s2s.scheduling.scheduler import Scheduler

CFG = ModelConfig.preset("tiny", num_codebooks=2)
FRAME_S = 320 / 24000  # EnCodec's frames


def conv(cid: str, mode: str = "turn", frames: int = 40, cached: int = 0) -> Session:
    c = Session(cid, mode, CFG, SamplingParams(seed=0), row=0, now=0.0, frame_size=320)
    c.set_prompt(np.random.default_rng(0).integers(0, 1024, size=(2, frames)))
    c.computed = cached  # steps a prefix cache gave back (the scheduler reads only the count without page_size)
    return c


def answering(c: Session) -> Session:
    """The user stopped speaking: the turn's reply starts once its speech is computed."""
    c.turns.append(Turn(0, c.user_frames, reply_start=c.user_frames))
    c.phase = Phase.REPLY
    return c


def prefill_order(s: Scheduler, convs: list[Session], now: float = 0.0) -> list[tuple[str, int]]:
    return [(w.session.id, len(w.tokens)) for w in s.pick(convs, now) if not w.decode]


def test_background_prefill_goes_longest_cached_prefix_first() -> None:
    s = Scheduler(prefill_budget=32, background_budget=32, frame_s=FRAME_S)
    assert prefill_order(s, [conv("cold"), conv("warm", cached=16)]) == [("warm", 24), ("cold", 8)]


def test_a_turn_being_answered_goes_before_background_prefill() -> None:
    s = Scheduler(prefill_budget=32, background_budget=32, frame_s=FRAME_S)
    order = prefill_order(s, [conv("prompt", cached=16), answering(conv("tail", frames=20))])
    assert order == [("tail", 20), ("prompt", 12)]


def test_a_live_duplex_stream_goes_before_background_prefill() -> None:
    live = conv("live", mode="duplex", frames=20)
    live.first_frame_at = 0.0  # its user frames arrive: frame deadlines run
    s = Scheduler(prefill_budget=16, background_budget=16, frame_s=FRAME_S)
    assert prefill_order(s, [conv("prompt", cached=16), live]) == [("live", 16)]
    assert prefill_order(s, [conv("prompt", cached=16), conv("opening", mode="duplex")]) == [("prompt", 16)]


def test_urgent_prefill_goes_oldest_first() -> None:
    s = Scheduler(prefill_budget=16, background_budget=16, frame_s=FRAME_S)
    served, first, second = answering(conv("served")), answering(conv("first")), answering(conv("second", cached=30))
    assert prefill_order(s, [served, first], now=0.0) == [("served", 16)]  # `first` waits from 0.0 on
    # 10 ms of aging is worth 20 cached steps, fewer than `second` has: only "longest waiting first" puts `first` first
    assert prefill_order(s, [second, first], now=0.01) == [("first", 16)]


def test_background_prefill_is_capped_in_a_tick_someone_waits_on() -> None:
    s = Scheduler(prefill_budget=64, background_budget=16, frame_s=FRAME_S)
    assert prefill_order(s, [conv("prompt", frames=80), conv("other", frames=80)]) == [("prompt", 64)]
    order = prefill_order(s, [conv("prompt", frames=80), conv("other", frames=80), answering(conv("tail", frames=20))])
    assert order == [("tail", 20), ("prompt", 16)]


def test_background_prefill_is_capped_while_a_reply_has_not_yet_sounded() -> None:
    s = Scheduler(prefill_budget=64, background_budget=16, frame_s=FRAME_S)
    replying = answering(conv("reply", frames=20))  # its speech is computed and its first frame partly sampled:
    replying.user[20:30] = CFG.silent_id  # the user is silent while it replies
    replying.model[20, 0] = 5  # codebook 0 of the reply's first frame (codebook 1 is a step behind)
    replying.computed = replying.emitted = 20  # the next step is the reply's first; nothing has been sent
    work = s.pick([conv("prompt", frames=80), replying], 0.0)
    assert [(w.session.id, len(w.tokens), w.decode) for w in work] == [("reply", 1, True), ("prompt", 16, False)]
    replying.emitted += 4  # its first audio has left: nobody waits on this tick any more
    work = s.pick([conv("prompt", frames=80), replying], 0.0)
    assert [(w.session.id, len(w.tokens), w.decode) for w in work] == [("reply", 1, True), ("prompt", 64, False)]


def test_victims_paused_first_and_never_a_reply_that_has_ended() -> None:
    """A paused session goes first; a reply whose last frame is sampled is about to finish (it rewinds to its
    computed steps), so it is never preempted."""
    s, ended, newest = conv("s"), answering(conv("ended")), conv("newest")
    ended.turns[-1].reply_end = ended.user_frames + 5
    for c in (s, ended, newest):
        c.pages = [1]
    assert Scheduler.victim(s, [s, ended, newest], set()) is newest
    assert Scheduler.victim(s, [newest, s, ended], set()) is None  # only the ended reply opened after s
    newest.paused = True
    assert Scheduler.victim(s, [s, ended, newest], set()) is newest
