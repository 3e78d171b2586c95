"""s2s/ engine: batching, caches, admission, barge-in, turn ids, page accounting."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch
from clocks import CallClock, SimClock
from tests_support import wait_until

from codec import EncodecTokenizer
from codec.pcm import SAMPLE_RATE
from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.engine import AudioEvent, Engine, EngineConfig, MetaEvent, Refused
from s2s.engine.turns import Phase

GREEDY = SamplingParams(temperature=0)
FRAME_S = EncodecTokenizer.frame_size / SAMPLE_RATE  # a frame of the tests' codec


@pytest.fixture(scope="module")
def tok() -> EncodecTokenizer:
    return EncodecTokenizer.from_pretrained(seed=0)


@pytest.fixture(scope="module")
def model() -> S2SModel:
    return S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0)


def speech(seconds: float, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * 24000)) / 24000
    return (0.2 * np.sin(2 * np.pi * (150 + 40 * seed) * t) * (0.5 + 0.5 * g.random(len(t)))).astype(np.float32)


def drain(engine: Engine, cid: str) -> list:
    q = engine.event_queue(cid)
    out = []
    while not q.empty():
        out.append(q.get())
    return out


def run_turns(engine: Engine, cids: list[str], turns: int, seconds: float = 0.4) -> dict[str, list[np.ndarray]]:
    """Every conversation speaks `turns` times; returns each one's reply model frames per turn."""
    replies: dict[str, list[np.ndarray]] = {c: [] for c in cids}
    for turn in range(turns):
        wavs = {c: speech(seconds, seed=10 * i + turn) for i, c in enumerate(cids)}
        for a in range(0, int(seconds * 24000), 1920):
            for c in cids:
                engine.push_audio(c, wavs[c][a : a + 1920])
            engine.step()
        for c in cids:
            engine.end_turn(c)
        for _ in range(400):
            engine.step()
            if all(
                engine.sessions[c].phase is Phase.LISTEN and len(engine.sessions[c].turns) == turn + 1 for c in cids
            ):
                break
        for c in cids:
            conv = engine.sessions[c]
            t = conv.turns[-1]
            assert t.reply_end is not None, "reply did not finish"
            replies[c].append(conv.model[t.reply_start : t.reply_end].copy())
    return replies


def make(model, tok, mode: str = "radix", clock=None, **kw) -> Engine:
    kw.setdefault("max_context", 512)
    kw.setdefault("calibration_ticks", 0)
    cfg = EngineConfig(cache_mode=mode, num_pages=kw.pop("num_pages", 400), max_reply_frames=10, **kw)
    return Engine(model, tok, cfg, **({"clock": clock} if clock else {}))


def test_greedy_identical_across_cache_modes_and_batches(model, tok) -> None:
    prompt = tok.encode(speech(0.5, seed=99))[0]  # a shared voice prompt, 38 frames
    results = {}
    for mode in ("naive", "paged", "exact", "radix"):
        together = make(model, tok, mode)
        cids = [together.open("turn", prompt=prompt, sampling=GREEDY) for _ in range(3)]
        results[(mode, "together")] = run_turns(together, cids, turns=2)
        alone = {}
        for i in range(3):
            engine = make(model, tok, mode)
            cid = engine.open("turn", prompt=prompt, sampling=GREEDY, session_id=cids[i])
            # the same speech as conversation i had in the batch
            alone.update(_run_as(engine, cid, i))
        results[(mode, "alone")] = alone
        together.cache.check()
    reference = results[("naive", "alone")]
    for key, got in results.items():
        for cid in reference:
            for a, b in zip(reference[cid], got[cid], strict=True):
                assert np.array_equal(a, b), (key, cid)
    assert any(len(r) for rs in reference.values() for r in rs)


def _run_as(engine: Engine, cid: str, index: int) -> dict[str, list[np.ndarray]]:
    """run_turns for one conversation that plays the part of conversation `index` of a batch."""
    replies = []
    for turn in range(2):
        wav = speech(0.4, seed=10 * index + turn)
        for a in range(0, len(wav), 1920):
            engine.push_audio(cid, wav[a : a + 1920])
            engine.step()
        engine.end_turn(cid)
        for _ in range(400):
            engine.step()
            conv = engine.sessions[cid]
            if conv.phase is Phase.LISTEN and len(conv.turns) == turn + 1:
                break
        t = engine.sessions[cid].turns[-1]
        replies.append(engine.sessions[cid].model[t.reply_start : t.reply_end].copy())
    return {cid: replies}


def test_prefix_cache_reuses_the_shared_prompt(model, tok) -> None:
    prompt = tok.encode(speech(1.0, seed=5))[0]  # 75 frames
    hits = {}
    for mode in ("paged", "exact", "radix"):
        engine = make(model, tok, mode)
        engine.add_voice("narrator", prompt)
        first = engine.open("turn", prompt="narrator", sampling=GREEDY)
        for _ in range(3):
            engine.step()
        engine.close(first)
        engine.open("turn", prompt="narrator", sampling=GREEDY)
        engine.step()  # applies the close, then the open
        hits[mode] = engine.cache.stats().hit_steps
        engine.cache.check()
        with pytest.raises(KeyError, match="no voice prompt named 'nobody'"):
            engine.open("turn", prompt="nobody")
        with pytest.raises(ValueError, match="voice codes"):
            engine.add_voice("bad", np.zeros((3, 4), dtype=np.int64))
    assert hits["paged"] == 0 and hits["radix"] >= hits["exact"] >= 64


@pytest.mark.parametrize("mode", ["exact", "radix"])
def test_conversations_opening_together_compute_a_shared_prompt_once(model, tok, mode: str) -> None:
    """Matching again when prefill is scheduled, and holding back all but one conversation about to compute the
    same page: four conversations opened in the same instant on one 150-frame prompt compute it about once."""
    prompt = tok.encode(speech(2.0, seed=7))[0]
    computed, hit = {}, {}
    for m in ("paged", mode):
        engine = make(model, tok, m, prefill_budget=32)
        cids = [engine.open("turn", prompt=prompt, sampling=GREEDY) for _ in range(4)]
        for _ in range(40):
            engine.step()
        assert all(engine.sessions[c].computed == prompt.shape[1] for c in cids)
        computed[m], hit[m] = engine.stats.prefill_steps, engine.cache.stats().hit_steps
        engine.cache.check()
        for c in cids:
            engine.close(c)
        engine.cache.check()
    assert computed["paged"] == 4 * 150 and hit["paged"] == 0
    # the first computes all 150 steps; the others get 144 (9 full pages) back and compute the last 6
    assert computed[mode] == 150 + 3 * 6 and hit[mode] == 3 * 144


@pytest.mark.parametrize("mode", ["paged", "exact", "radix"])
def test_out_of_pages_preempts_the_last_opened_and_every_reply_finishes(model, tok, mode: str) -> None:
    """Three conversations in pages for about one: without preemption each would hold some pages and wait for one
    more for ever. With it, every turn is answered, and with the replies a roomy engine gives (greedy)."""
    prompt = tok.encode(speech(0.5, seed=99))[0]
    replies, preempted = {}, {}
    for pages in (400, 14):
        engine = make(model, tok, mode, num_pages=pages, admission_headroom=math.inf, clock=CallClock())
        cids = [engine.open("turn", prompt=prompt, sampling=GREEDY, admit=False) for _ in range(3)]
        replies[pages] = run_turns(engine, cids, turns=2)
        preempted[pages] = engine.stats.preempted
        engine.cache.check()
        for c in cids:
            engine.close(c)
        engine._apply_commands()
        engine.cache.check()
        assert engine.cache.stats().private == 0
    assert preempted[400] == 0 and preempted[14] > 0
    for cid, got in replies[14].items():
        for a, b in zip(replies[400][cid], got, strict=True):
            assert np.array_equal(a, b), cid


def slow_machine(engine: Engine, clock: SimClock, step_s: float) -> None:
    """The engine's forward on a simulated machine: 1 ms + `step_s` per decode step + 0.05 ms per prefill step."""
    real_forward = engine.runner.forward

    def costly_forward(batch):
        clock.now += 0.001 + step_s * batch.decode_steps + 0.00005 * batch.prefill_steps
        return real_forward(batch)

    engine.runner.forward = costly_forward


def test_late_duplex_frames_count_as_misses_per_conversation(model, tok) -> None:
    """A machine too slow for two duplex streams: both miss frames, and each conversation's count adds up to the
    engine's."""
    clock = SimClock()
    engine = Engine(model, tok, EngineConfig(num_pages=400, calibration_ticks=0), clock=clock)
    slow_machine(engine, clock, step_s=0.02)
    live = [engine.open("duplex", sampling=GREEDY, admit=False) for _ in range(2)]
    pushed = 0
    for tick in range(60):  # the users speak in real time, however slow the machine
        due = int(clock.now / FRAME_S) + 1
        for cid in live:
            engine.push_audio(cid, speech(FRAME_S * (due - pushed), seed=tick)[: 320 * (due - pushed)])
        pushed = due
        start = clock.now
        engine.step()
        clock.now = max(clock.now, start + engine.cfg.tick_s)
    per_session = [c["deadline_misses"] for c in engine.snapshot().sessions]
    assert len(per_session) == 2 and all(m > 0 for m in per_session)
    assert sum(per_session) == engine.stats.deadline_misses


def test_a_client_that_mutes_for_seconds_is_not_counted_late_when_it_goes_on(model, tok) -> None:
    """Its frames are due from when they came: a 3 s gap in its input moves their deadlines on (a fast machine: no
    miss either side of the gap)."""
    clock = SimClock()
    engine = Engine(model, tok, EngineConfig(num_pages=400, calibration_ticks=0), clock=clock)
    slow_machine(engine, clock, step_s=0.001)
    cid = engine.open("duplex", sampling=GREEDY, admit=False)
    for tick in range(330):
        if not 30 <= tick < 30 + round(3 / FRAME_S):  # muted for 3 s after 30 frames
            engine.push_audio(cid, speech(FRAME_S, seed=tick)[:320])
        start = clock.now
        engine.step()
        clock.now = max(clock.now, start + engine.cfg.tick_s)
    s = engine.sessions[cid]
    assert s.emitted >= 100 and engine.stats.deadline_misses == 0


def test_admission_refuses_and_admitted_duplex_keep_deadlines(model, tok) -> None:
    clock = SimClock()
    engine = Engine(model, tok, EngineConfig(num_pages=2000, max_conversations=12, calibration_ticks=0), clock=clock)
    slow_machine(engine, clock, step_s=0.002)
    live = [engine.open("duplex", sampling=GREEDY) for _ in range(2)]
    refused = 0
    # the burst admits its last conversation by tick ~70 and is refused from then on (the engine is full); 90 more
    # ticks at that load (the simulated cost is the same every tick) are what the admitted have to keep up with
    for tick in range(160):
        if tick >= 60 and tick % 5 == 0:  # a burst: someone asks every 5 ticks
            try:
                live.append(engine.open("duplex", sampling=GREEDY))
            except Refused as e:
                assert "deadline" in str(e) or "maximum" in str(e)
                refused += 1
        for cid in live:
            engine.push_audio(cid, speech(FRAME_S, seed=tick)[:320])
        start = clock.now
        engine.step()
        clock.now = max(clock.now, start + engine.cfg.tick_s)  # the next tick starts on time or late
    assert refused > 0, "the burst should have hit the frame budget"
    assert len(live) >= 3
    assert engine.stats.deadline_misses == 0
    assert all(c["deadline_misses"] == 0 for c in engine.snapshot().sessions)
    # with 12 rows max and 2 ms a step, at most ~4 duplex fit the 13.3 ms x 0.8 budget
    assert len(live) <= 5


def test_refuses_past_max_conversations(model, tok) -> None:
    engine = make(model, tok, max_conversations=2)
    engine.open("turn")
    engine.open("turn")
    with pytest.raises(Refused, match="maximum of 2"):
        engine.open("turn")
    assert engine.stats.refused == 1
    with pytest.raises(ValueError, match="mode"):
        engine.open("simplex")


def test_an_open_on_another_thread_never_takes_a_row_before_its_close_is_queued(model, tok) -> None:
    """A close and an open on two threads, the open's caller running just as the close queues its command: the open
    waits for the close to be queued and takes the freed row after it, so the engine opens it on a free row."""
    engine = make(model, tok, max_conversations=1)
    first = engine.open("duplex")
    engine.step()
    events, commands, lock = engine.event_queue(first), engine._commands, engine.registry._lock
    tries, outcome, held_by = threading.Event(), {}, []

    class Watched:  # the registry's lock, telling who holds it and when the other caller comes to take it
        def __enter__(self):
            if threading.current_thread() is other:
                tries.set()
            lock.acquire()
            held_by.append(threading.current_thread())

        def __exit__(self, *exc):
            held_by.pop()
            lock.release()

    def open_other() -> None:
        try:
            outcome["opened"] = engine.open("duplex")
        except Exception as e:
            outcome["raised"] = e

    other = threading.Thread(target=open_other)

    class Racing:  # the engine's command queue, where the other caller opens as the close is queued
        get_nowait = commands.get_nowait

        @staticmethod
        def put(command) -> None:
            if not other.is_alive() and not outcome:  # the close's command (the only one `close` queues)
                other.start()
                # until the other caller is stuck on the lock this thread holds, or has opened (or failed) without it
                this = threading.current_thread()
                stuck = lambda: tries.is_set() and held_by == [this]  # noqa: E731
                wait_until(lambda: stuck() or outcome, 30, "the other caller's open never ran")
                outcome["before the close was queued"] = dict(outcome)
            commands.put(command)

    engine.registry._lock, engine._commands = Watched(), Racing
    try:
        engine.close(first)
    finally:
        engine.registry._lock, engine._commands = lock, commands
    other.join(30)
    assert not other.is_alive(), "the other caller's open never returned"
    assert outcome["before the close was queued"] == {}, "the open did not wait for the close to be queued"
    assert "raised" not in outcome, f"the open was refused: {outcome['raised']!r}"
    engine.step()
    assert list(engine.sessions) == [outcome["opened"]], "the open applied before the close, on its row"
    assert list(events.queue)[-1] is None, "the first one's events ended"


def test_barge_in_keeps_only_played_frames(model, tok) -> None:
    engine = make(model, tok, "radix")
    engine.cfg.max_reply_frames = 60
    cid = engine.open("turn", sampling=SamplingParams(temperature=0.8, seed=1))
    wav = speech(0.4, seed=1)
    for a in range(0, len(wav), 1920):
        engine.push_audio(cid, wav[a : a + 1920])
        engine.step()
    engine.end_turn(cid)
    conv = engine.sessions[cid]
    while conv.emitted - (conv.turns[-1].reply_start or 10**9) < 12:
        engine.step()
    turn = conv.turns[-1]
    played = 7
    kept = conv.model[turn.reply_start : turn.reply_start + played].copy()
    assert any(isinstance(e, AudioEvent) for e in list(engine.event_queue(cid).queue))
    engine.interrupt(cid, played)
    engine._apply_commands()
    assert not any(isinstance(e, AudioEvent) and e.turn == turn.id for e in list(engine.event_queue(cid).queue))
    cut = turn.reply_start + played
    assert conv.phase is Phase.LISTEN and turn.reply_end == cut
    assert conv.computed <= cut and conv.user_frames == cut
    assert np.array_equal(conv.model[turn.reply_start : cut], kept)
    assert (conv.model[cut:] == -1).all()
    # the next turn's context is what the user heard, then the new speech
    wav2 = speech(0.3, seed=2)
    for a in range(0, len(wav2), 1920):
        engine.push_audio(cid, wav2[a : a + 1920])
        engine.step()
    key = conv.key(conv.computed)
    model_codebook0 = key[turn.reply_start : cut, engine.model.config.num_codebooks]
    assert np.array_equal(model_codebook0, kept[:, 0])
    engine.cache.check()


def test_turn_ids_through_barge_in(model, tok) -> None:
    engine = make(model, tok, "radix")
    engine.cfg.max_reply_frames = 40
    cid = engine.open("turn", sampling=SamplingParams(temperature=0.8, seed=3))
    seen: list[tuple[int, object]] = []
    for turn in range(3):
        wav = speech(0.3, seed=turn)
        for a in range(0, len(wav), 1920):
            engine.push_audio(cid, wav[a : a + 1920])
            engine.step()
        engine.end_turn(cid)
        for _ in range(15):
            engine.step()
        events = drain(engine, cid)
        seen += [(turn, e) for e in events]
        if turn < 2:
            engine.interrupt(cid, played_frames=3)  # the user talks over the reply
    audio = [(turn, e) for turn, e in seen if isinstance(e, AudioEvent)]
    assert audio and all(e.turn == turn for turn, e in audio)
    assert [t.id for t in engine.sessions[cid].turns] == [0, 1, 2]
    assert all("interrupted" in t.times for t in engine.sessions[cid].turns[:2])
    stages = engine.sessions[cid].turns[2].times
    order = ["end_of_turn", "reply_start", "prefill_done", "first_step", "first_audio_out"]
    assert [stages[k] for k in order] == sorted(stages[k] for k in order), stages
    assert all(isinstance(e, AudioEvent | MetaEvent) for _, e in seen)


@pytest.mark.parametrize("mode", ["naive", "paged", "exact", "radix"])
def test_close_at_any_point_frees_private_pages(model, tok, mode: str) -> None:
    rng = np.random.default_rng(0)
    engine = make(model, tok, mode, num_pages=600, max_conversations=6, max_context=256)
    prompt = tok.encode(speech(0.6, seed=7))[0]
    cids = []
    for i in range(6):
        cids.append(engine.open("turn" if i % 2 else "duplex", prompt=prompt if i % 3 == 0 else None))
    live = list(cids)
    for i in rng.permutation(len(cids)):
        for _ in range(int(rng.integers(0, 25))):
            for c in live:
                engine.push_audio(c, speech(0.08, seed=int(rng.integers(100)))[:1920])
            engine.step()
        if i % 2:
            engine.end_turn(cids[i])
        engine.step()
        engine.close(cids[i])
        engine._apply_commands()
        live.remove(cids[i])
        engine.cache.check()
        engine.pool.check()
        assert engine.cache.stats().private <= sum(len(c.own_pages) for c in engine.sessions.values())
    stats = engine.cache.stats()
    assert stats.private == 0 and stats.cached_locked == 0
    assert stats.free + stats.cached_evictable == engine.pool.num_usable
    with pytest.raises(KeyError):
        engine.push_audio("nobody", np.zeros(10, np.float32))
    assert torch.isfinite(engine.pool.k[0]).all()


def test_resume_and_regenerate_reuse_the_cache(model, tok) -> None:
    engine = make(model, tok, "radix")
    cid = engine.open("turn", sampling=GREEDY, session_id="alice")
    first = run_turns(engine, [cid], turns=1)[cid][0]
    computed = engine.sessions[cid].computed
    # regenerate: same greedy reply, and the user's turn is not computed again: the cut falls inside a page the
    # cache holds, and its steps before the cut are copied into a page of the conversation's own (copy-on-write)
    conv = engine.sessions[cid]
    cut = conv.turns[-1].reply_start - 1  # the step that predicts the reply's first frame is computed again
    assert cut % 16, "the test needs a cut inside a page"
    engine.regenerate(cid)
    engine._apply_commands()
    assert conv.computed == cut and engine.stats.copied_steps == cut % 16
    assert conv.pages[-1] in conv.own_pages and engine.pool.refcount(conv.pages[-1]) == 1
    before = engine.stats.ticks
    for _ in range(400):
        engine.step()
        if conv.phase is Phase.LISTEN and conv.turns[-1].reply_end is not None:
            break
    t = conv.turns[-1]
    assert np.array_equal(conv.model[t.reply_start : t.reply_end], first)
    assert engine.stats.ticks - before < 40
    # close, then resume by id: the context comes back and the cache serves it
    engine.close(cid, keep=True)
    hits = engine.cache.stats().hit_steps
    engine.open("turn", sampling=GREEDY, session_id="alice", resume=True)
    engine._apply_commands()
    resumed = engine.sessions["alice"]
    assert resumed.user_frames >= t.reply_end and len(resumed.turns) == 1
    assert engine.cache.stats().hit_steps - hits >= (computed // 16 - 1) * 16
    with pytest.raises(KeyError, match="resume"):
        engine.open("turn", session_id="bob", resume=True)
    engine.cache.check()


def test_threaded_engine_streams_in_real_time(model, tok) -> None:
    """The real loop: the engine ticks in its thread, a client streams audio in real time and reads audio back."""
    engine = make(model, tok, "radix")
    engine.start()
    try:
        cid = engine.open("duplex", sampling=GREEDY)
        events = engine.event_queue(cid)
        wav = speech(0.8, seed=4)
        for a in range(0, len(wav), 1920):
            engine.push_audio(cid, wav[a : a + 1920])
            time.sleep(0.08)
        frames = 0
        while frames < 40:  # however long a slow machine takes to catch up
            event = events.get(timeout=30)
            frames += len(event.pcm) // 320 if isinstance(event, AudioEvent) else 0
        engine.close(cid)
        while (event := events.get(timeout=30)) is not None:
            frames += len(event.pcm) // 320 if isinstance(event, AudioEvent) else 0
    finally:
        engine.stop()
    assert frames <= 60  # 0.8 s is 60 frames; the encoder's start-up look-ahead holds a few back


def test_calls_never_wait_for_a_tick(model, tok) -> None:
    """While a tick is stuck in its forward, every call from another thread returns, and the tick after applies
    them in order."""
    engine = make(model, tok, "radix")
    cid = engine.open("turn", sampling=GREEDY)
    engine.push_audio(cid, speech(0.4, seed=3))
    in_forward, release, forward = threading.Event(), threading.Event(), engine.runner.forward

    def stuck(batch):
        in_forward.set()
        assert release.wait(30), "the test never released the tick"
        return forward(batch)

    engine.runner.forward = stuck
    ticking = threading.Thread(target=engine.step)
    ticking.start()
    try:
        assert in_forward.wait(30)
        other = engine.open("turn", sampling=GREEDY)
        others_events = engine.event_queue(other)
        engine.push_audio(cid, speech(0.2, seed=4))
        engine.end_turn(cid)
        engine.interrupt(other, 0)
        engine.close(other)
        assert engine.snapshot().conversations == 0, "the snapshot is the last tick's, not live state"
        assert ticking.is_alive(), "the calls above returned only once the tick was over"
    finally:
        release.set()
        ticking.join()
    engine.runner.forward = forward
    engine.step()
    s = engine.sessions[cid]
    assert other not in engine.sessions and engine.event_queue(cid) is s.events
    assert list(others_events.queue) == [None], "the other's open and close were both applied, in order"
    assert s.phase is Phase.REPLY and s.turns[-1].reply_start is not None
    assert engine.snapshot().conversations == 1


def test_end_of_turn_starts_a_tick_at_once(model, tok) -> None:
    """The engine thread does not sleep out its tick when a turn ends: with 10 s ticks, the reply still starts
    within seconds of `end_turn` (it would wait for the next tick, 10 s later, otherwise)."""
    engine = make(model, tok, "radix", frames_per_tick=750)
    engine.start()
    try:
        cid = engine.open("turn", sampling=GREEDY)
        engine.push_audio(cid, speech(0.4, seed=3))
        engine.end_turn(cid)
        first = engine.event_queue(cid).get(timeout=5)  # queue.Empty here means the reply waited for the tick
        assert isinstance(first, AudioEvent) and first.turn == 0
    finally:
        engine.stop()  # (it wakes the loop: no wait for the rest of the 10 s tick)


def test_the_loop_does_not_sleep_through_input_after_ticks_back_to_back(model, tok) -> None:
    """While input waits, ticks run back to back; once caught up, the loop waits at most what is left of one tick
    slot. (It used to keep a schedule advancing a slot per tick, ran ahead of the clock during the run, then slept
    off the difference while frames arrived: two duplex conversations missed a third of their frames.)"""
    clock = SimClock()
    engine = make(model, tok, "radix", clock=clock)
    tick = engine.cfg.tick_s
    behind = iter([True] * 10)
    waits = []

    def step() -> None:
        clock.now += 0.6 * tick  # a tick takes 60 % of its slot

    def wait(delay: float) -> bool:
        waits.append(delay)
        clock.now += delay
        if len(waits) == 3:
            engine._stop.set()
        return False

    engine.step, engine._behind, engine._wake.wait = step, lambda: next(behind, False), wait
    engine._loop()
    assert waits == pytest.approx([0.4 * tick] * 3)


def test_a_turns_first_audio_leaves_in_the_round_it_is_complete(model, tok) -> None:
    """With 8 frames a tick, the reply's first frame is complete after its second step (delays [0, 1]): its audio
    is queued then, before the tick's later rounds run, not when the tick ends."""
    engine = make(model, tok, "radix", frames_per_tick=8)
    cid = engine.open("turn", sampling=GREEDY)
    engine.push_audio(cid, speech(0.4, seed=3))
    engine.end_turn(cid)
    q, forward, ticks, seen = engine.event_queue(cid), engine.runner.forward, 0, []

    def spy(batch):
        seen.append((ticks, q.qsize()))  # events queued when a round starts, by tick
        return forward(batch)

    engine.runner.forward = spy
    while q.empty():
        engine.step()
        ticks += 1
    first = q.queue[0]
    assert isinstance(first, AudioEvent) and first.turn == 0
    assert len(first.pcm) == 320, "the first audio should be the first frame alone"
    assert any(t == ticks - 1 and n > 0 for t, n in seen), "the first audio waited for the end of its tick"


def test_admission_counts_turn_conversations_and_an_idle_engine_admits(model, tok) -> None:
    """Turn-mode conversations count as real-time streams (they may all reply at once); an engine with nobody in it
    admits one whatever its cost model says, so a model soured by an overload cannot lock everyone out."""
    cfg = EngineConfig(num_pages=500, max_conversations=8, calibration_ticks=0)
    engine = Engine(model, tok, cfg)
    for streams in (1, 2, 4):  # what an overload taught it: a tick takes 10 tick budgets per stream
        for _ in range(20):
            engine.cost.observe(cfg.frames_per_tick, streams * cfg.frames_per_tick, 0, 10 * cfg.tick_s * streams)
    first = engine.open("turn")
    with pytest.raises(Refused, match="deadline"):
        engine.open("turn")
    with pytest.raises(Refused, match="deadline"):
        engine.open("duplex")
    engine.close(first)
    engine.close(engine.open("duplex"))


def test_end_of_turn_is_stamped_on_its_own_turn_when_the_audio_is_still_queued(model, tok) -> None:
    """A client that pushes a whole utterance and ends the turn before any tick: the stamp goes on that new turn,
    not on the one before it (whose reply is over)."""
    engine = Engine(model, tok, EngineConfig(num_pages=400, calibration_ticks=0, max_reply_frames=6))
    cid = engine.open("turn", sampling=GREEDY)
    ends = []
    for turn in range(2):
        engine.push_audio(cid, speech(0.4, seed=turn))
        ends.append(engine.clock())
        engine.end_turn(cid)
        for _ in range(40):
            engine.step()
        drain(engine, cid)
    turns = engine.sessions[cid].turns
    assert len(turns) == 2 and all(t.reply_end is not None for t in turns)
    for t, ended in zip(turns, ends, strict=True):
        assert ended <= t.times["end_of_turn"] <= t.times["reply_start"], t.times


def pages_short(engine: Engine, free: int) -> None:
    """Others hold the rest of the pool: `free` pages are left."""
    engine.cache.alloc(engine.pool.num_free - free)


@pytest.mark.parametrize("speaking", [True, False])
def test_out_of_pages_takes_a_conversation_between_turns_not_one_mid_utterance(model, tok, speaking: bool) -> None:
    """A newcomer short of pages takes those of a conversation whose turn is answered, but not those of a user who
    is still speaking (with nothing to compute until the next block): that user would have recomputed the whole
    conversation before their answer. Then the newcomer, opened last, waits instead (vLLM's order)."""
    engine = make(model, tok, "paged", admission_headroom=math.inf, clock=CallClock())
    first = engine.open("turn", sampling=GREEDY, admit=False)
    run_turns(engine, [first], turns=1)
    if speaking:
        engine.push_audio(first, speech(0.2, seed=5))  # a second turn begins; its frames are computed
        for _ in range(3):
            engine.step()
    conv = engine.sessions[first]
    assert conv.step_token(conv.computed) is None and conv.pages  # nothing to compute this tick, pages held
    pages_short(engine, free=1)
    prompt = tok.encode(speech(0.5, seed=99))[0]  # the newcomer needs 3 pages
    late = engine.open("turn", prompt=prompt, sampling=GREEDY, admit=False)
    engine.step()
    assert (engine.stats.preempted == 0) is speaking
    assert bool(conv.pages) is speaking
    assert (engine.sessions[late].computed == prompt.shape[1]) is not speaking


def test_the_newest_conversation_short_of_pages_keeps_them_and_waits_instead_of_preempting_itself(model, tok) -> None:
    """A newcomer computes a page of its prompt into the last free one, then needs more while the only other user
    is mid-utterance (not to be preempted for a prompt). It keeps the page and waits; it used to preempt itself and
    compute the same page again every other tick. Its user's speech arrives meanwhile; preempted then by the older
    one's reply, it still computes that speech (it is not idle) instead of waiting for more."""
    engine = make(model, tok, "paged", admission_headroom=math.inf, clock=CallClock())
    first = engine.open("turn", sampling=GREEDY, admit=False)
    run_turns(engine, [first], turns=1)
    engine.push_audio(first, speech(0.2, seed=5))  # a second turn begins
    for _ in range(3):
        engine.step()
    pages_short(engine, free=1)
    prompt = tok.encode(speech(0.5, seed=99))[0]  # 38 frames: 3 pages
    late = engine.open("turn", prompt=prompt, sampling=GREEDY, admit=False)
    engine._apply_commands()
    conv, prefilled = engine.sessions[late], engine.stats.prefill_steps
    for _ in range(6):
        engine.step()
    assert engine.stats.preempted == 0 and conv.computed == 16 and len(conv.pages) == 1
    assert engine.stats.prefill_steps == prefilled + 16  # computed once, not again and again
    engine.end_turn(first)  # its reply preempts the newcomer (newer) if it needs a page
    engine.push_audio(late, speech(0.2, seed=6))  # the newcomer's user speaks: it needs its K/V now
    for _ in range(200):
        engine.step()
        if conv.computed == conv.user_frames and engine.sessions[first].phase is Phase.LISTEN:
            break
    assert conv.computed == conv.user_frames > prompt.shape[1]
    assert engine.sessions[first].turns[-1].reply_end is not None
    assert engine.stats.preempted == 2  # the newcomer by the reply, then the answered one for the newcomer


def test_an_older_conversation_with_no_pages_takes_them_from_a_newer_one(model, tok) -> None:
    """First come, first served: the newer one holds the last free page (its prompt) and waits for more; the older
    one's user speaks, and it takes that page, though it holds none (both used to wait for ever)."""
    engine = make(model, tok, "paged", admission_headroom=math.inf, clock=CallClock())
    older = engine.open("turn", sampling=GREEDY, admit=False)
    pages_short(engine, free=1)
    newer = engine.open("turn", prompt=tok.encode(speech(0.5, seed=99))[0], sampling=GREEDY, admit=False)
    engine._apply_commands()
    o, n = engine.sessions[older], engine.sessions[newer]
    for _ in range(3):
        engine.step()
    assert n.computed == 16 and not o.pages
    engine.push_audio(older, speech(0.2, seed=5))
    for _ in range(5):
        engine.step()
    assert o.computed == o.user_frames > 0 and engine.stats.preempted == 1 and not n.pages


def test_a_reply_short_of_pages_takes_a_speakers_and_the_speaker_recomputes_when_they_speak_again(model, tok) -> None:
    """The newest conversation is replying and needs a page; the only other holds pages mid-utterance. The reply
    (someone is waiting on it) takes the speaker's pages rather than preempting itself tick after tick. The speaker,
    preempted with nothing new to compute, recomputes nothing until more of their speech arrives."""
    cfg = EngineConfig(
        cache_mode="paged", num_pages=400, max_reply_frames=40, calibration_ticks=0, admission_headroom=math.inf
    )
    engine = Engine(model, tok, cfg, clock=CallClock())
    speaker, replier = (engine.open("turn", sampling=GREEDY, admit=False) for _ in range(2))
    run_turns(engine, [speaker, replier], turns=1)
    engine.push_audio(speaker, speech(0.2, seed=5))
    engine.push_audio(replier, speech(0.2, seed=6))
    engine.step()
    engine.end_turn(replier)
    pages_short(engine, free=0)
    s, r = engine.sessions[speaker], engine.sessions[replier]
    for _ in range(200):
        engine.step()
        if r.phase is Phase.LISTEN:
            break
    assert r.turns[-1].reply_end - r.turns[-1].reply_start == 40  # 40 frames: it crossed at least 2 pages
    assert engine.stats.preempted == 1 and not s.pages and s.dormant
    assert s.computed == 0  # dormant: nothing recomputed into the pages the reply needed
    engine.push_audio(speaker, speech(0.1, seed=7))  # the speaker goes on: now it recomputes (the reply's pages)
    for _ in range(5):
        engine.step()
    assert not s.dormant and s.computed == s.user_frames


def test_naive_mode_refuses_at_open_what_its_reservations_cannot_hold(model, tok) -> None:
    """Naive mode reserves a whole context at open: admission counts it, so a conversation the pool cannot hold is
    refused by `open` itself (not failed later, inside a tick)."""
    one = make(model, tok, "naive", num_pages=40, max_context=512)  # 39 usable pages, 32 a conversation
    one.open("turn")
    with pytest.raises(Refused, match="no K/V memory"):
        one.open("turn")
    none = make(model, tok, "naive", num_pages=20, max_context=512)
    with pytest.raises(Refused, match="no K/V memory"):
        none.open("turn")


def test_a_session_whose_open_failed_is_told_and_cannot_crash_a_resume(model, tok) -> None:
    """An open that fails inside a tick (pages taken outside admission) ends its events with the reason; resuming it
    later is told the same way, and the engine goes on ticking (the resume used to raise inside `step`)."""
    engine = make(model, tok, "naive", num_pages=80, max_context=512)  # 79 usable pages: two of 32
    pages_short(engine, free=40)
    first = engine.open("turn", admit=False)
    late = engine.open("turn", admit=False)
    engine.step()
    events = drain(engine, late)
    assert events[-1] is None and "no K/V memory" in events[0].data["message"]
    engine.close(late, keep=True)
    engine.open("turn", session_id=late, resume=True, admit=False)
    engine.step()
    events = drain(engine, late)
    assert events[-1] is None and "nothing to resume" in events[0].data["message"]
    assert list(engine.sessions) == [first]
    engine.cache.check()
