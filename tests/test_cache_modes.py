"""cache/: each mode's contract, eviction order, sliding windows, bad input, and regressions other engines shipped."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest

import cache.radix
from cache import MODES, ExactCache, NaiveCache, OutOfPages, PagedCache, PagePool, RadixCache, make_cache

REUSING = ["exact", "radix"]


def tokens(steps: int, seed: int = 0, width: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, size=(steps, width))


def new_cache(mode: str, usable: int = 32, page_size: int = 4):
    return make_cache(mode, PagePool(1, 1, 1, page_size=page_size, num_pages=usable + 1))


class Conv:
    """A conversation following cache/base.py's rules: lock what it matched, own what it allocated."""

    def __init__(self, c, key: np.ndarray):
        self.c, self.key = c, key
        m = c.match(key)
        c.lock(m.handle)
        self.handle, self.matched = m.handle, m.cached_steps
        self.own = c.alloc(math.ceil(len(key) / c.page_size) - len(m.pages))
        self.table = m.pages + self.own

    def insert(self):
        h = self.c.insert(self.key, self.table)
        self.c.lock(h)
        self.c.unlock(self.handle)
        self.handle = h

    def close(self):
        self.c.release(self.own)
        self.c.unlock(self.handle)


def test_make_cache():
    pool = PagePool(1, 1, 1, num_pages=4)
    assert {m: type(make_cache(m, pool)) for m in MODES} == {
        "naive": NaiveCache,
        "paged": PagedCache,
        "exact": ExactCache,
        "radix": RadixCache,
    }
    with pytest.raises(ValueError, match="unknown cache mode 'lru'"):
        make_cache("lru", pool)


@pytest.mark.parametrize("mode", list(MODES))
def test_bad_input(mode):
    c = new_cache(mode)
    for bad in (np.zeros(8, dtype=int), np.zeros((2, 2, 2), dtype=int), np.zeros((4, 0), dtype=int)):
        with pytest.raises(ValueError, match=r"\[steps, width\]"):
            c.match(bad)
    with pytest.raises(ValueError, match="integers"):
        c.match(np.zeros((4, 2)))
    with pytest.raises(ValueError, match="needs 2 full pages, got 1"):
        c.insert(tokens(9), c.alloc(1))
    m = c.match(tokens(8))
    c.lock(m.handle)
    c.unlock(m.handle)
    with pytest.raises(ValueError, match="not locked"):
        c.unlock(m.handle)
    c.check()


def test_pages_on_open():
    assert new_cache("naive").pages_on_open(33) == 9
    assert all(new_cache(m).pages_on_open(33) == 0 for m in ("paged", "exact", "radix"))


@pytest.mark.parametrize("mode", ["naive", "paged"])
def test_no_reuse(mode):
    c = new_cache(mode)
    a = Conv(c, tokens(12))
    a.insert()
    b = Conv(c, tokens(12))
    assert b.matched == 0 and not set(a.table) & set(b.table)
    a.close()
    b.close()
    assert c.stats().free == c.pool.num_usable and c.stats().hit_steps == 0 and c.stats().missed_steps == 24
    c.check()


@pytest.mark.parametrize("mode", REUSING)
def test_a_match_leaves_the_last_step_to_compute(mode):
    """Its logits are what the conversation predicts from: a radix match of a whole page-aligned key once left a
    duplex conversation nothing to compute, and it never spoke."""
    c = new_cache(mode)
    key = tokens(8)
    a = Conv(c, key)
    a.insert()
    assert a.handle.steps == 8, "insert caches every full page"
    m = c.match(key)
    assert m.cached_steps == 4, "a key of exactly 2 pages matches 1: its last step is recomputed"
    assert m.partial == ((a.table[1], 3) if mode == "radix" else None), "radix offers the 3 steps before it"
    assert c.match(tokens(9)).cached_steps == 8
    assert c.match(tokens(7)).cached_steps == 4
    a.close()
    c.check()


@pytest.mark.parametrize("mode", REUSING)
def test_a_held_page_is_not_evicted_until_released(mode):
    c = new_cache(mode)
    a = Conv(c, tokens(12))
    a.insert()
    a.close()
    c.hold([a.table[1]])  # about to be copied from
    c.evict(3)
    assert c.pool.refcount(a.table[1]) == 2 and c.stats().evicted_live_pages == 0, "a held page was evicted"
    c.check()
    c.release([a.table[1]])
    c.evict(3)
    assert c.pool.refcount(a.table[1]) == 0 and c.stats().free == c.pool.num_usable
    c.check()


def test_radix_offers_the_steps_of_a_partly_matching_page():
    c = new_cache("radix")
    a = Conv(c, tokens(12))
    a.insert()
    other = tokens(12)
    other[6, 1] += 1  # page 2 differs from its third step on
    assert c.match(other).partial == (a.table[1], 2)
    other[4, 0] += 1  # ... and from its first: nothing to offer
    assert c.match(other).partial is None
    short = tokens(7)  # a key that ends inside page 2: its first 2 steps (the last step is left to compute)
    m = c.match(short)
    assert (m.cached_steps, m.partial) == (4, (a.table[1], 2))
    a.close()
    c.check()
    with pytest.raises(ValueError, match="1 to 4 steps"):
        c.pool.copy_steps(a.table[0], a.table[1], 5)


@pytest.mark.parametrize("mode", REUSING)
def test_one_code_differs_no_shared_page(mode):
    c = new_cache(mode)
    a = Conv(c, tokens(17))
    a.insert()
    other = tokens(17)
    other[9, 3] += 1  # one code of one step in page 2
    m = c.match(other)
    assert m.cached_steps == 8 and m.pages == a.table[:2]
    a.close()


@pytest.mark.parametrize("mode", REUSING)
def test_stale_handle_cannot_be_locked(mode):
    c = new_cache(mode)
    a = Conv(c, tokens(9))
    a.insert()
    a.close()
    m = c.match(tokens(9))
    assert m.cached_steps == 8
    c.evict(10)
    with pytest.raises(ValueError, match="evicted"):
        c.lock(m.handle)
    c.check()


def test_radix_evicts_least_recently_used_leaf_tail_first():
    c = new_cache("radix")
    convs = [Conv(c, tokens(8, seed=s)) for s in range(3)]
    for conv in convs:
        conv.insert()
        conv.close()
    c.match(tokens(9, seed=0))  # conversation 0 is now the most recent (a probe one step longer matches all 8)
    assert c.evict(1) == 1
    assert c.evict(2) == 2  # (probing with match in between would make the probed prefix the most recent)
    assert c.match(tokens(9, seed=1)).cached_steps == 0, "the LRU leaf goes first, tail page first"
    assert c.match(tokens(9, seed=2)).cached_steps == 4
    assert c.match(tokens(9, seed=0)).cached_steps == 8
    c.check()


def test_radix_evicts_a_parent_once_its_children_are_gone():
    c = new_cache("radix")
    shared = tokens(8, seed=9)
    for s in range(2):
        conv = Conv(c, np.concatenate([shared, tokens(4, seed=s)]))
        conv.insert()
        conv.close()
    assert c.stats().cached_evictable == 4
    assert c.evict(3) == 3
    assert c.match(shared).cached_steps == 4
    assert c.evict(5) == 1
    assert c.stats().cached_evictable == 0
    c.check()


def test_exact_free_queue_releases_tail_first_and_lru():
    c = new_cache("exact")
    a, b = Conv(c, tokens(13, seed=0)), Conv(c, tokens(13, seed=1))
    for conv in (a, b):
        conv.insert()
    a.close()
    b.close()
    assert c.stats().cached_evictable == 6
    assert c.evict(1) == 1
    assert c.match(tokens(13, seed=0)).cached_steps == 8, "a conversation's tail leaves the queue first"
    assert c.evict(2) == 2
    assert c.match(tokens(13, seed=0)).cached_steps == 0
    assert c.match(tokens(13, seed=1)).cached_steps == 12, "the later released conversation is more recent"
    c.check()


@pytest.mark.parametrize("mode", REUSING)
def test_locked_prefix_survives_pressure_from_other_conversations(mode):
    c = new_cache(mode, usable=8)
    live = Conv(c, tokens(12, seed=0))
    live.insert()
    live.c.release(live.own)  # even with its own references gone, the lock protects the prefix
    live.own = []
    for s in range(1, 6):
        burst = Conv(c, tokens(12, seed=s))
        burst.insert()
        burst.close()
    m = c.match(tokens(13, seed=0))
    assert m.cached_steps == 12 and m.pages == live.table
    s = c.stats()
    assert (s.free, s.cached_evictable, s.cached_locked) == (0, 5, 3)
    with pytest.raises(OutOfPages, match="need 6 pages: 0 free and 5 evictable; live conversations hold the other 3"):
        c.alloc(6)
    assert c.stats() == s, "a refused alloc evicts nothing"
    live.close()
    assert len(c.alloc(6)) == 6
    assert c.stats().evicted_live_pages == 0
    c.check()


@pytest.mark.parametrize("mode", REUSING)
def test_eviction_skips_pages_a_caller_still_references(mode):
    c = new_cache(mode)
    own = c.alloc(2)
    c.insert(tokens(8), own)  # inserted but never locked: the caller's references must still protect the pages
    assert c.evict(10) == 0
    assert [c.pool.refcount(p) for p in own] == [2, 2]
    c.release(own)
    assert c.evict(10) == 2
    assert c.stats().evicted_live_pages == 0 and c.stats().free == c.pool.num_usable
    c.check()


@pytest.mark.parametrize("mode", REUSING)
def test_sliding_window(mode):
    """Pages out of the window go back with release: freed if private, kept if the cache holds them too."""
    c = new_cache(mode)
    conv = Conv(c, tokens(22))
    conv.key = conv.key[:16]  # the cache gets the first 4 pages; pages 4 and 5 stay private
    conv.insert()
    conv.key = tokens(22)
    gone = conv.own[:5]
    c.release(gone)
    conv.own = conv.own[5:]
    conv.table[:5] = [0] * 5
    assert [c.pool.refcount(p) > 0 for p in gone] == [True] * 4 + [False], "cached pages stay, the private one goes"
    assert c.match(tokens(17)).pages == gone[:4]
    conv.insert()  # the cache already holds the given-back prefix; page 4 is gone, so insert stops there
    assert conv.handle.steps == 16
    conv.close()
    assert c.stats().cached_evictable == 4 and c.stats().private == 0
    c.check()


@pytest.mark.parametrize("mode", REUSING)
def test_insert_stops_at_a_given_back_page(mode):
    c = new_cache(mode)
    own = c.alloc(3)
    h = c.insert(tokens(12), [own[0], 0, own[2]])
    assert h.steps == 4 and c.match(tokens(13)).cached_steps == 4
    c.release(own)
    c.check()


@pytest.mark.parametrize("mode", REUSING)
def test_duplicate_prefix_keeps_the_live_requests_pages(mode):
    """mini-sglang #142: inserting a prefix that is already cached must not free the caller's duplicate pages, which
    its page table still points to."""
    c = new_cache(mode, usable=10)
    key = tokens(12)
    a, b = Conv(c, key), Conv(c, key)  # both computed the same prefix before either inserted
    for conv, value in ((a, 1.0), (b, 2.0)):
        for p in conv.table:
            c.pool.k[0][p] = value
    a.insert()
    b.insert()
    assert b.handle.steps == 12 and c.match(tokens(13)).pages == a.table, "the cache keeps its own pages"
    assert all(c.pool.refcount(p) == 1 for p in b.table), "b's duplicates are b's alone, and not freed"
    a.close()
    filler = c.alloc(c.stats().free + c.stats().cached_evictable)  # evicts everything it can
    assert not set(filler) & set(b.table)
    assert all((c.pool.k[0][p] == 2.0).all() for p in b.table), "b's K/V is intact"
    b.close()
    c.release(filler)
    s = c.stats()
    assert (s.free, s.cached_evictable, s.evicted_live_pages) == (7, 3, 0), "b's duplicates went back, none leaked"
    c.check()


@pytest.mark.parametrize("mode", REUSING)
def test_shared_pages_are_counted_once(mode):
    """sglang #35270: pages shared by several conversations, or handed to insert under a second key, must not be
    counted twice: evictable + locked + free + private stays the pool size and evict frees what evictable says."""
    c = new_cache(mode, usable=12)
    first = Conv(c, tokens(9))
    first.insert()
    sharers = [Conv(c, tokens(9)) for _ in range(3)]
    assert all(s.table[:2] == first.table[:2] for s in sharers)
    s = c.stats()
    assert (s.cached_locked, s.cached_evictable, s.private) == (2, 0, 4)
    changed = tokens(9)
    changed[6, 0] += 1  # the same pages under a second key, as a rewritten page would be
    with pytest.raises(ValueError, match="already caches another prefix"):
        c.insert(changed, first.table)
    assert c.stats() == s, "a refused insert changes nothing"
    for conv in [first, *sharers]:
        conv.close()
    s = c.stats()
    assert (s.cached_evictable, s.cached_locked, s.free) == (2, 0, 10)
    assert c.evict(100) == 2
    c.check()


def test_radix_eviction_heap_is_not_rebuilt(monkeypatch):
    """sglang-omni #1723: evict must pop from a heap kept across calls, not re-heapify every leaf on each call."""
    c = new_cache("radix", usable=600)
    for s in range(300):
        conv = Conv(c, tokens(8, seed=s))
        conv.insert()
        conv.close()
    calls = {"heappush": 0, "heapify": 0}

    class Spy:
        def __getattr__(self, name):
            fn = getattr(heapq, name)

            def counted(*args):
                if name in calls:
                    calls[name] += 1
                return fn(*args)

            return counted

    monkeypatch.setattr(cache.radix, "heapq", Spy())
    for _ in range(20):
        assert c.evict(1) == 1
    assert calls["heapify"] == 0
    assert calls["heappush"] <= 20, "one re-push per partly evicted leaf"
    assert len(c._heap) <= 300
    c.check()
