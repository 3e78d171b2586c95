"""EventQueue: the engine thread puts without a lock; readers blocked in `get` still wake for every event, and the
frame count each side keeps balances."""

import pickle
import threading
import time

import numpy as np

from s2s.engine.events import NO_TIMES, AudioEvent, CodesEvent, EventQueue, MetaEvent, made


def test_a_blocked_reader_wakes_for_every_put_of_a_lock_free_writer() -> None:
    q, n, got = EventQueue(320), 20_000, []
    q.max_frames = 10**9  # (this test is about wake-ups, not the bound)
    codes = np.zeros((2, 3), dtype=np.int64)

    def reader() -> None:
        while (event := q.get()) is not None:  # no timeout: a missed wake-up leaves it blocked
            got.append(event)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    for i in range(n):
        while i % 100 == 0 and not q._waiting:  # now and then, put only once the reader is blocked in `get`
            time.sleep(0.0001)
        q.put(CodesEvent("s0", 0, i, codes) if i % 2 else MetaEvent("s0", 0, {"i": i}))
    q.put(None)
    thread.join(timeout=30)
    assert not thread.is_alive(), "the reader missed a wake-up"
    assert len(got) == n and [e.first_frame if isinstance(e, CodesEvent) else e.data["i"] for e in got] == list(
        range(n)
    )
    assert q.frames == 0 and q.empty() and not q.overflowed


def test_dropping_a_turn_s_audio_keeps_the_count_of_what_is_left() -> None:
    q = EventQueue(320)
    for turn in (0, 1, 0, 1):
        q.put(CodesEvent("s0", turn, 0, np.zeros((2, 5), dtype=np.int64)))
    assert q.get_nowait().turn == 0 and q.frames == 15
    q.drop_turn_audio(1)
    assert q.frames == 5 and [q.get_nowait().turn] == [0] and q.frames == 0 and q.empty()


def test_events_made_at_once_are_the_events_and_cross_processes() -> None:
    """`made` builds the decoder's events without a call each; they, and those without times, pickle (the engine core
    sends them to the front-end processes)."""
    pcm = [np.full(320, i, np.float32) for i in range(3)]
    times = [{"first_audio_out": 1.0}, NO_TIMES, NO_TIMES]
    events = list(made(AudioEvent, ["a", "b", "c"], [0, 1, 2], [5, 6, 7], pcm, times, [None, np.arange(3), None]))
    assert events[0] == AudioEvent("a", 0, 5, pcm[0], times[0]) and isinstance(events[1], AudioEvent)
    assert (events[1].text == np.arange(3)).all() and events[2].text is None
    for event in events:
        back = pickle.loads(pickle.dumps(event))
        assert type(back) is AudioEvent and back.session == event.session and dict(back.times) == dict(event.times)
        assert (back.pcm == event.pcm).all()
    assert not NO_TIMES and dict(NO_TIMES) == {}
