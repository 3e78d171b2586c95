"""bench/soak: the plans, the microphone, the sampler's rows and the targets, and the clients, the probe and the
page check against a real tiny server for a few seconds (no timing asserted)."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
from test_server import run_with_server
from tests_support import until

from bench.common import scrape
from bench.soak.client import Event, Events, Microphone, SoakClient
from bench.soak.load import at_baseline, pages, probe, settle
from bench.soak.plans import QUICK_MIX, Mix, Plan, Turn, make_plan
from bench.soak.report import log_errors, targets
from bench.soak.sampler import interval_row
from bench.soak_bench import trimmed
from server.moshi.protocol import BLOCK
from speech.sample import speech


def test_plans_are_seeded_deal_modes_in_their_shares_and_stay_under_the_idle_timeout() -> None:
    mix = Mix(voices=("alice", "bob"))
    assert make_plan(np.random.default_rng(5), mix, 4, 7) == make_plan(np.random.default_rng(5), mix, 4, 7)
    rng = np.random.default_rng(0)
    plans = [make_plan(rng, mix, 4, i) for i in range(200)]
    assert Counter(p.mode for p in plans) == {"turn": 100, "duplex": 100} and plans[0].mode == "turn"
    assert {p.voice for p in plans} == {None, "alice", "bob"} and {p.leave for p in plans} == {"close", "abort"}
    assert all(p.silent_s < 60 for p in plans) and any(p.silent_before is not None for p in plans)
    assert all(p.turns[-1].barge_in_s is None for p in plans)
    assert any(t.barge_in_s is not None for p in plans for t in p.turns)
    assert all(p.turns[p.silent_before - 1].barge_in_s is None for p in plans if p.silent_before)  # not in one
    assert all(p.mute == (p.mode == "turn") for p in plans)  # duplex streams its silence
    assert all(not p.leave_mid_reply for p in plans if p.mode == "duplex")
    assert "voice=alice" in next(p for p in plans if p.voice == "alice").query()


def test_the_microphone_sends_speech_then_pads_its_last_block_then_silence() -> None:
    async def main() -> None:
        mic = Microphone(lambda message: None)
        said = asyncio.ensure_future(mic.say(np.ones(BLOCK + 10, dtype=np.float32)))
        await asyncio.sleep(0)
        first, done = mic.next_block()
        assert len(first) == BLOCK and first.all() and done is None
        last, done = mic.next_block()
        assert len(last) == BLOCK and last[:10].all() and not last[10:].any() and done is not None
        done.set_result(1.0)
        assert await said == 1.0
        silence, done = mic.next_block()
        assert not silence.any() and done is None

    asyncio.run(main())


def _metrics(free: int, evictable: int, locked: int, private: int, **counters: float) -> dict[str, float]:
    counts = (free, evictable, locked, private)
    m = {f's2s_kv_pages{{state="{s}"}}': float(n) for s, n in zip(PAGE_STATES, counts, strict=True)}
    return {"s2s_conversations": 2.0, **m, **counters}


PAGE_STATES = ("free", "cached_evictable", "cached_locked", "private")


def test_an_interval_row_takes_deltas_pages_and_the_clients_events() -> None:
    prev = _metrics(100, 0, 0, 0, s2s_ticks_total=10, s2s_busy_seconds_total=0.1, s2s_deadline_misses_total=3)
    m = _metrics(90, 4, 3, 3, s2s_ticks_total=30, s2s_busy_seconds_total=0.5, s2s_deadline_misses_total=5)
    m |= {'s2s_tick_seconds_bucket{le="0.02"}': 20.0, 's2s_tick_seconds_bucket{le="+Inf"}': 20.0}  # 20 ticks, <= 20 ms
    events = [Event(1.0, "latency", 0.1, "turn"), Event(1.5, "latency", 0.3, "turn"), Event(2.0, "refused", "x")]
    events += [Event(2.0, "left", "abort"), Event(2.0, "left", "close"), Event(2.0, "left", "close")]
    row = interval_row(12.0, 5.0, m, prev, 700_000_000, events, live=2)
    assert row["pages_free"] == 90 and row["pages_cached_locked"] == 3 and row["pages_private"] == 3
    assert row["ticks"] == 20 and row["tick_ms_mean"] == pytest.approx(20.0) and row["tick_ms_p95"] == pytest.approx(19)
    assert row["deadline_misses"] == 2 and row["rss_mb"] == 700 and row["conversations"] == 2
    assert row["turns"] == 2 and row["first_audio_ms_p50"] == pytest.approx(200)
    assert row["refused"] == 1 and row["left_abort"] == 1 and row["left_close"] == 2 and row["error"] == 0
    empty = interval_row(17.0, 5.0, m, m, 0, [], live=0)
    assert np.isnan(empty["tick_ms_mean"]) and np.isnan(empty["first_audio_ms_p95"]) and empty["turns"] == 0
    assert at_baseline(_metrics(90, 10, 0, 0), 100) and not at_baseline(m, 100)


def test_targets_are_met_or_not_as_the_numbers_say() -> None:
    base = _metrics(60, 40, 0, 0, s2s_kv_checks_total=3, s2s_kv_check_failures_total=0)
    waves = [
        {"t_s": 100.0, "rss_mb": 1000.0, "at_baseline": True, "conversations": 0, "metrics": base},
        {"t_s": 400.0, "rss_mb": 1010.0, "at_baseline": True, "conversations": 0, "metrics": base},
        {"t_s": 700.0, "rss_mb": 1040.0, "at_baseline": True, "conversations": 0, "metrics": base},
    ]
    events = [Event(10.0 + t, "latency", 0.1) for t in range(0, 50, 5)]
    events += [Event(10.0 + t, "latency", 0.105) for t in range(650, 700, 5)]
    met = {r["target"].split(",")[0]: r["met"] for r in targets(waves, events, 10.0, 700, 300, 60, 0, 100, [])}
    assert met == {
        "RSS growth after warm-up (idle RSS between waves)": "yes",  # 1010 -> 1040: 3 %
        "pages back to baseline between waves": "yes",
        "deadline misses (admitted conversations)": "yes",
        "p95 first audio": "yes",
        "no leaked page (all clients gone)": "yes",
        "no error in the server log": "yes",
    }
    failed_check = _metrics(60, 39, 0, 1, s2s_kv_checks_total=3, s2s_kv_check_failures_total=1)
    waves[-1] = {**waves[-1], "rss_mb": 1070.0, "at_baseline": False, "metrics": failed_check}
    errors = log_errors("serving\nTraceback (most recent call last):\nValueError: x\nfine\n")
    assert errors == ["Traceback (most recent call last):", "ValueError: x"]
    late = events[:10] + [Event(e.t, "latency", 0.2) for e in events[10:]]
    rows = targets(waves, late, 10.0, 700, 300, 60, 3, 100, errors)
    assert [r["met"] for r in rows] == ["NO"] * 6


FULL = "refused: the engine holds its maximum of 3 conversations"


@pytest.mark.paced  # a server at real time: alone and last (tests/conftest.py)
def test_clients_the_probe_and_the_page_check_against_a_server(parts) -> None:
    clip = trimmed(speech()[0], 1.2)
    turn = Plan("turn", None, 1, (Turn(0, 0.2, barge_in_s=0.05), Turn(0, 0.5)), 1, 0.4, True, "abort", False)
    duplex = Plan("duplex", None, 2, (Turn(0, 0.1),), 0, 0.3, False, "close", False)
    endless = Plan("duplex", None, 3, (Turn(0, 0.1),) * 50, None, 0.0, False, "abort", False)

    async def body(url: str, server) -> None:
        events, leave = Events(), asyncio.Event()
        clients = [SoakClient(url, p, [clip], events, reply_timeout_s=10) for p in (turn, duplex, endless)]
        tasks = [asyncio.create_task(c.run(leave)) for c in clients]
        await asyncio.wait(tasks[:2])
        leave.set()  # the endless one leaves now
        assert await asyncio.gather(*tasks) == ["left", "left", "left"]
        kinds = Counter(e.kind for e in events)
        assert kinds["opened"] == 3 and kinds["latency"] == 2 and kinds["barge_in"] == 1 and kinds["silent"] == 2
        assert not {"error", "dropped", "failed", "client_bug", "no_reply", "refused"} & set(kinds)
        assert sorted(e.value for e in events if e.kind == "left") == ["abort", "abort", "close"]
        assert all(e.value > 0 for e in events if e.kind == "audio_s")
        m = await asyncio.to_thread(scrape, url)
        usable = sum(pages(m).values())
        _, m = await settle(url, usable, 10.0)
        assert m["s2s_conversations"] == 0 and at_baseline(m, usable)
        assert await probe(url, settle_s=0.1) == (3, FULL)
        _, m = await settle(url, usable, 10.0)
        held, leave = Events(), asyncio.Event()  # three clients fill the engine; a fourth is refused, with the reason
        holders = [asyncio.create_task(SoakClient(url, endless, [clip], held).run(leave)) for _ in range(3)]
        await until(
            lambda: sum(e.kind == "opened" for e in held) == 3 or any(t.done() for t in holders),
            10,
            lambda: f"the three did not open: {list(held)}",
        )
        fourth = await SoakClient(url, duplex, [clip], held).run(leave)
        leave.set()
        assert await asyncio.gather(*holders) == ["left"] * 3 and fourth == "refused"
        assert [e.value for e in held if e.kind in ("refused", "failed", "error")] == [FULL], held
        _, m = await settle(url, usable, 10.0)
        assert at_baseline(m, usable)

    run_with_server(parts, body, max_conversations=3, admission_headroom=100.0)  # refused at the count alone


def test_the_quick_mix_is_shorter() -> None:
    assert QUICK_MIX.turns[1] < Mix().turns[1] and QUICK_MIX.silent_s[1] < Mix().silent_s[1]
