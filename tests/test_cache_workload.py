"""cache/ through the engine's KVManager: one random multi-turn workload in every mode. Matched prefixes hold the K/V
the session would have computed itself, and radix reuses more than exact (the steps of partly matching pages, which
it copies), which reuses more than paged and naive (none)."""

from __future__ import annotations

import numpy as np
import pytest
from kv_values import step_values

from cache import MODES, OutOfPages, PagePool
from s2s.engine.metrics import EngineStats
from s2s.engine.session import Session
from s2s.models.config import ModelConfig
from s2s.runner.sampling import SamplingParams
from s2s.scheduling.context import ContextBound
from s2s.scheduling.kv_manager import KVManager
from s2s.scheduling.scheduler import Work

LAYERS, HEADS, DIM, PAGE = 2, 2, 4, 4
MAX_STEPS = 160
BOUND = ContextBound(PAGE, window_pages=MAX_STEPS // PAGE, rewind_pages=0)  # no conversation here outgrows it
CFG = ModelConfig.preset("tiny", num_codebooks=2)


def workload(seed: int = 0) -> list[tuple[np.ndarray, list[np.ndarray]]]:
    """Sessions as (voice prompt, the user's turns), codes `[K, n]`; they share one of three prompts, some of which
    share a prefix, and some sessions repeat an earlier one's first turn."""
    rng = np.random.default_rng(seed)

    def codes(n: int) -> np.ndarray:
        return rng.integers(0, 3, size=(2, n))

    prompts = [codes(40)]
    prompts.append(np.concatenate([prompts[0][:, :21], codes(30)], axis=1))
    prompts.append(codes(37))
    sessions = []
    for i in range(30):
        prompt = prompts[rng.integers(0, 3)]
        turns = [codes(int(rng.integers(1, 30))) for _ in range(rng.integers(1, 4))]
        if i > 3 and rng.random() < 0.3:
            prompt, first = sessions[rng.integers(0, i)]
            turns[0] = first[0]
        sessions.append((prompt, turns))
    return sessions


def compute(kv: KVManager, s: Session, open_sessions: list[Session]) -> None:
    """What the engine's forward does to the pool: every known step's K/V into the session's pages, then insert.
    Short of pages, the oldest open session is preempted (and, here, done with)."""
    tokens = s.ready_steps(MAX_STEPS)
    oldest = lambda s, busy: next((o for o in open_sessions if o is not s and o.pages), None)  # noqa: E731
    (work,) = kv.reserve([Work(s, tokens, False)], oldest)
    open_sessions[:] = [o for o in open_sessions if o.pages or o is s]
    values = step_values(s.key(s.computed + len(work.tokens)))
    for t in range(s.computed, s.computed + len(work.tokens)):
        page, slot = s.pages[t // PAGE], t % PAGE
        for layer in range(LAYERS):
            kv.pool.k[layer][page, slot] = values[t] + layer
            kv.pool.v[layer][page, slot] = -values[t] - layer
    s.computed += len(work.tokens)
    kv.insert(s, lock=True)
    kv.cache.check()


def close(kv: KVManager, s: Session) -> None:
    kv.insert(s, lock=False)
    kv.detach(s)


def run(mode: str, usable: int):
    """Serve the workload with up to 4 sessions open at once; returns the cache's stats."""
    pool = PagePool(LAYERS, HEADS, DIM, page_size=PAGE, num_pages=usable + 1)
    sessions = workload()
    kv = KVManager(pool, mode, BOUND, EngineStats(), rows=len(sessions))
    open_sessions: list[Session] = []
    for i, (prompt, turns) in enumerate(sessions):
        if len(open_sessions) == 4:
            close(kv, open_sessions.pop(0))
        s = Session(f"s{i}", "turn", CFG, SamplingParams(seed=0), row=i, now=0.0, frame_size=320, bound=BOUND)
        s.set_prompt(prompt)
        while True:
            try:
                kv.attach(s)  # naive reserves its pages here
                break
            except OutOfPages:
                close(kv, open_sessions.pop(0))
        values = step_values(s.key(s.computed))
        for t in range(s.computed):  # what the cache gave back is what the session would have computed
            page, slot = s.pages[t // PAGE], t % PAGE
            for layer in range(LAYERS):
                assert (pool.k[layer][page, slot] == values[t] + layer).all(), (mode, t)
                assert (pool.v[layer][page, slot] == -values[t] - layer).all(), (mode, t)
        open_sessions.append(s)
        for turn in turns:
            s.add_user_frames(turn)
            compute(kv, s, open_sessions)
            for o in open_sessions:  # `KVManager.tables` mirrors each session's page list
                assert kv.tables.array[o.row, : kv.tables.lengths[o.row]].tolist() == o.pages
    for s in open_sessions:
        close(kv, s)
    kv.cache.check()
    stats = kv.cache.stats()
    assert stats.evicted_live_pages == 0 and stats.private == 0 and stats.cached_locked == 0
    return stats


def test_every_mode_same_kv_and_reuse_order():
    """A pool large enough that nothing is evicted (naive's reservations fit too): reuse differs only by design."""
    hits = {mode: run(mode, usable=600).hit_steps for mode in MODES}
    assert hits["radix"] > hits["exact"] > hits["paged"] == hits["naive"] == 0, hits


@pytest.mark.parametrize("mode", list(MODES))
def test_same_kv_under_pressure(mode):
    """A pool that forces eviction: matched pages still hold the K/V of their prefix."""
    s = run(mode, usable=60)
    if mode in ("exact", "radix"):
        assert s.hit_steps > 0 and s.evicted_pages > 0, s
