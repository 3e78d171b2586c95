"""cache/: one random multi-turn workload through every mode: matched prefixes hold the K/V the conversation would
have computed itself, and radix reuses more than exact (the steps of partly matching pages, which it copies),
which reuses more than paged and naive (none)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kv_values import step_values

from cache import MODES, OutOfPages, PagePool, make_cache

LAYERS, HEADS, DIM, PAGE = 2, 2, 4, 4
MAX_STEPS = 160


def workload(seed: int = 0) -> list[list[np.ndarray]]:
    """Conversations as lists of turns (the key after each turn); they share one of three prompts, some of which
    share a prefix, and some conversations repeat an earlier one's first turn."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 3, size=(40, 4))]
    prompts.append(np.concatenate([prompts[0][:21], rng.integers(0, 3, size=(30, 4))]))
    prompts.append(rng.integers(0, 3, size=(37, 4)))
    convs = []
    for i in range(30):
        key = prompts[rng.integers(0, 3)]
        if i > 3 and rng.random() < 0.3:
            key = convs[rng.integers(0, i)][0]
        turns = [np.concatenate([key, rng.integers(0, 3, size=(rng.integers(0, 30), 4))])]
        for _ in range(rng.integers(0, 3)):
            turns.append(np.concatenate([turns[-1], rng.integers(0, 3, size=(rng.integers(1, 30), 4))]))
        convs.append(turns)
    return convs


def run(mode: str, usable: int):
    """Serve the workload with up to 4 conversations open at once; when pages run out, the oldest open conversation
    is closed first (the engine would queue). Returns the cache's stats."""
    pool = PagePool(LAYERS, HEADS, DIM, page_size=PAGE, num_pages=usable + 1)
    c = make_cache(mode, pool)
    open_convs = []

    def close(conv):
        c.release(conv["own"])
        c.unlock(conv["handle"])

    for turns in workload():
        if len(open_convs) == 4:
            close(open_convs.pop(0))
        key = turns[0]
        m = c.match(key)
        c.lock(m.handle)
        if m.partial:
            c.hold([m.partial[0]])  # as the engine does: kept alive while alloc evicts, until copied
        need = max(c.pages_on_open(MAX_STEPS), math.ceil(len(turns[-1]) / PAGE)) - len(m.pages)
        while True:
            try:
                own = c.alloc(need)
                break
            except OutOfPages:
                close(open_convs.pop(0))
        done = m.cached_steps
        if m.partial:  # the engine's copy-on-write of a partly matching page
            pool.copy_steps(m.partial[0], own[0], m.partial[1])
            c.release([m.partial[0]])
            c.record_hits(m.partial[1], m.partial[1])
            done += m.partial[1]
        conv = {"own": own, "table": m.pages + own, "handle": m.handle}
        values = step_values(key)
        for t in range(done):
            page, slot = conv["table"][t // PAGE], t % PAGE
            for layer in range(LAYERS):
                assert (pool.k[layer][page, slot] == values[t] + layer).all(), (mode, t)
                assert (pool.v[layer][page, slot] == -values[t] - layer).all(), (mode, t)
        for key in turns:
            values = step_values(key)
            for t in range(done, len(key)):
                page, slot = conv["table"][t // PAGE], t % PAGE
                for layer in range(LAYERS):
                    pool.k[layer][page, slot] = values[t] + layer
                    pool.v[layer][page, slot] = -values[t] - layer
            done = len(key)
            h = c.insert(key, conv["table"])
            c.lock(h)
            c.unlock(conv["handle"])
            conv["handle"] = h
            c.check()
        open_convs.append(conv)
    for conv in open_convs:
        close(conv)
    c.check()
    s = c.stats()
    assert s.evicted_live_pages == 0 and s.private == 0 and s.cached_locked == 0
    return s


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
