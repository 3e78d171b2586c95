"""cache/: random open, extend, match, insert, lock, unlock, slide, evict and close against a brute-force model.

The model is a dict from each cached page-aligned prefix (a tuple of page tokens) to its page. It learns what eviction
took from the pool (a page evict freed, or that alloc handed out, left the cache) and checks that this was allowed:
no locked prefix, and for radix only whole subtrees. Every conversation follows the ownership rules of cache/base.py;
after every step the pool's reference counts must equal the model's count of holders, page for page.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_values import step_values

from cache import Handle, OutOfPages, PagePool, make_cache
from cache.base import page_tokens


@dataclass(eq=False)
class Conv:
    key: np.ndarray
    table: list[int]  # page table; 0 where a page fell out of the window
    own: list[int]  # pages allocated by this conversation that it still references
    handle: Handle
    locked: list[int]  # the pages its lock covers


class CacheMachine(RuleBasedStateMachine):
    mode = "radix"

    def __init__(self):
        super().__init__()
        self.cache = None

    @initialize(
        page_size=st.sampled_from([1, 4, 16]),
        width=st.integers(2, 4),
        usable=st.integers(4, 24),
        seed=st.integers(0, 2**16),
    )
    def setup(self, page_size: int, width: int, usable: int, seed: int):
        self.ps, self.width = page_size, width
        self.max_steps = 3 * page_size + page_size // 2 + 1
        self.pool = PagePool(1, 1, 1, page_size=page_size, num_pages=usable + 1)
        self.cache = make_cache(self.mode, self.pool)
        rng = np.random.default_rng(seed)
        self.bases = [rng.integers(0, 3, size=(self.max_steps, width))]
        for _ in range(2):  # each base shares a random-length prefix with the one before
            base = self.bases[-1].copy()
            cut = rng.integers(0, self.max_steps)
            base[cut:] = rng.integers(0, 3, size=(self.max_steps - cut, width))
            self.bases.append(base)
        self.cached: dict[tuple[bytes, ...], int] = {}
        self.convs: list[Conv] = []

    # -- helpers

    def draw_key(self, data) -> np.ndarray:
        pages = data.draw(st.sampled_from([1, 2, 3, 0]), label="full pages")
        n = min(pages * self.ps + data.draw(st.integers(0, self.ps - 1), label="more steps"), self.max_steps)
        sources = self.bases + [c.key for c in self.convs]  # a live conversation's key: a likely hit
        source = sources[data.draw(st.integers(0, len(sources) - 1), label="prefix of")]
        key = np.concatenate([source[:n], self.bases[0][len(source) : n]])
        if n and data.draw(st.integers(0, 3), label="change one code") == 0:
            key[data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, self.width - 1))] += 1
        return key

    def prefixes(self, key: np.ndarray, pages: int) -> list[tuple[bytes, ...]]:
        tokens = page_tokens(key, self.ps, pages)
        return [tuple(tokens[:j]) for j in range(1, pages + 1)]

    def expected_match(self, key: np.ndarray) -> list[int]:
        if self.mode not in ("exact", "radix"):
            return []
        limit = max(len(key) - 1, 0) // self.ps  # never the last step: its logits have to be computed
        pages = []
        for pre in self.prefixes(key, limit):
            if pre not in self.cached:
                break
            pages.append(self.cached[pre])
        return pages

    def check_match(self, key: np.ndarray, m) -> None:
        want = self.expected_match(key)
        assert m.pages == want and m.cached_steps == len(want) * self.ps == m.handle.steps, (m, want)
        values = step_values(key)
        for t in range(m.cached_steps):
            assert self.pool.k[0][m.pages[t // self.ps], t % self.ps, 0, 0] == values[t], "matched K differs"
            assert self.pool.v[0][m.pages[t // self.ps], t % self.ps, 0, 0] == -values[t], "matched V differs"
        if m.partial is None:
            return
        page, n = m.partial
        assert self.mode == "radix" and 0 < n < self.ps and m.cached_steps + n < len(key), m.partial
        assert page in self.cached.values(), "a partial page the cache does not hold"
        for t in range(n):
            assert self.pool.k[0][page, t, 0, 0] == values[m.cached_steps + t], "partial page's K differs"

    def write(self, conv: Conv, start: int) -> None:
        values = step_values(conv.key)
        for t in range(start, len(conv.key)):
            page = conv.table[t // self.ps]
            assert page in conv.own, "writing into a page the conversation does not own"
            self.pool.k[0][page, t % self.ps] = values[t]
            self.pool.v[0][page, t % self.ps] = -values[t]

    def forget_evicted(self, taken: list[int] = ()) -> int:
        """Drop from the model the prefixes whose page left the cache (freed, or handed out by alloc)."""
        gone = {pre for pre, p in self.cached.items() if self.pool.refcount(p) == 0 or p in taken}
        for conv in self.convs:
            locked = set(self.prefixes(conv.key, conv.handle.steps // self.ps))
            assert not gone & locked, "a locked prefix was evicted"
        if self.mode == "radix":
            assert all(pre[:-1] not in gone for pre in set(self.cached) - gone), "radix evicted a non-leaf"
        for pre in gone:
            del self.cached[pre]
        return len(gone)

    def alloc(self, n: int) -> list[int] | None:
        s = self.cache.stats()
        try:
            pages = self.cache.alloc(n)
        except OutOfPages:
            assert n > s.free + s.cached_evictable, "OutOfPages although evicting would have made room"
            assert self.cache.stats() == s, "a refused alloc changed the cache"
            return None
        assert n <= s.free + s.cached_evictable, "allocated more than was free or evictable"
        self.forget_evicted(pages)
        return pages

    def insert(self, conv: Conv) -> None:
        handle = self.cache.insert(conv.key, conv.table)
        covered = 0
        if self.mode in ("exact", "radix"):
            for j, pre in enumerate(self.prefixes(conv.key, len(conv.key) // self.ps), start=1):
                if pre not in self.cached:
                    if conv.table[j - 1] == 0:
                        break
                    self.cached[pre] = conv.table[j - 1]
                covered = j
        assert handle.steps == covered * self.ps, (handle.steps, covered)
        self.cache.lock(handle)
        self.cache.unlock(conv.handle)
        conv.handle = handle
        conv.locked = [self.cached[pre] for pre in self.prefixes(conv.key, covered)]

    def pick(self, data) -> Conv:
        return self.convs[data.draw(st.integers(0, len(self.convs) - 1), label="conversation")]

    # -- rules

    @rule(data=st.data())
    def open(self, data):
        key = self.draw_key(data)
        m = self.cache.match(key)
        self.check_match(key, m)
        self.cache.lock(m.handle)
        need = max(self.cache.pages_on_open(self.max_steps), math.ceil(len(key) / self.ps)) - len(m.pages)
        own = self.alloc(need)
        if own is None:
            self.cache.unlock(m.handle)
            return
        conv = Conv(key, m.pages + own, own, m.handle, list(m.pages))
        self.convs.append(conv)
        self.write(conv, m.cached_steps)
        if data.draw(st.booleans(), label="insert after prefill"):
            self.insert(conv)

    @rule(data=st.data())
    def probe(self, data):
        key = self.draw_key(data)
        self.check_match(key, self.cache.match(key))

    @precondition(lambda self: self.convs)
    @rule(data=st.data())
    def extend(self, data):
        conv = self.pick(data)
        old = len(conv.key)
        n = data.draw(st.integers(1, 2 * self.ps), label="new steps")
        if old + n > self.max_steps:
            return
        base = self.bases[data.draw(st.integers(0, len(self.bases) - 1), label="base")]
        need = math.ceil((old + n) / self.ps) - len(conv.table)
        if need > 0:
            own = self.alloc(need)
            if own is None:
                return
            conv.table += own
            conv.own += own
        conv.key = np.concatenate([conv.key, base[old : old + n]])
        self.write(conv, old)

    @precondition(lambda self: self.convs)
    @rule(data=st.data())
    def insert_chunk(self, data):
        self.insert(self.pick(data))

    @precondition(lambda self: self.convs)
    @rule(data=st.data())
    def slide(self, data):
        """The window moved past full pages: they are given back (own ones released, matched ones just dropped)."""
        conv = self.pick(data)
        if len(conv.key) < self.ps:
            return
        k = data.draw(st.integers(1, len(conv.key) // self.ps), label="pages out of the window")
        gone = [p for p in conv.table[:k] if p in conv.own]
        self.cache.release(gone)
        conv.own = [p for p in conv.own if p not in gone]
        conv.table[:k] = [0] * len(conv.table[:k])

    @precondition(lambda self: self.convs)
    @rule(data=st.data())
    def close(self, data):
        conv = self.pick(data)
        if data.draw(st.booleans(), label="insert at close"):
            self.insert(conv)
        values = step_values(conv.key)
        for t in range(len(conv.key)):
            if conv.table[t // self.ps]:
                assert self.pool.k[0][conv.table[t // self.ps], t % self.ps, 0, 0] == values[t], "K overwritten"
        self.convs.remove(conv)
        if data.draw(st.booleans(), label="unlock first"):
            # between the two, its inserted pages are unlocked but still its own: eviction must leave them alone
            self.cache.unlock(conv.handle)
            n = data.draw(st.integers(0, 8), label="evict in between")
            s = self.cache.stats()
            freed = self.cache.evict(n)
            assert freed <= min(n, s.cached_evictable) and self.forget_evicted() == freed
            self.cache.release(conv.own)
        else:
            self.cache.release(conv.own)
            self.cache.unlock(conv.handle)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int):
        s = self.cache.stats()
        freed = self.cache.evict(n)
        assert freed == min(n, s.cached_evictable), (freed, n, s)
        assert self.forget_evicted() == freed

    # -- after every step

    @invariant()
    def consistent(self):
        if self.cache is None:
            return
        self.cache.check()
        s = self.cache.stats()
        assert s.evicted_live_pages == 0
        assert len(set(self.cached.values())) == len(self.cached), "a page caches two prefixes"
        holders = Counter(self.cached.values())
        for conv in self.convs:
            holders.update(conv.own)
            if self.mode == "exact":
                holders.update(conv.locked)
        for p in range(1, self.pool.num_pages):
            assert self.pool.refcount(p) == holders[p], (p, self.pool.refcount(p), holders[p])
        assert s.cached_evictable + s.cached_locked == len(self.cached)
        if self.mode == "radix":
            assert all(pre[:-1] in self.cached for pre in self.cached if len(pre) > 1), "a radix prefix lost its parent"
            locked = set().union(*(self.prefixes(c.key, c.handle.steps // self.ps) for c in self.convs))
            assert s.cached_locked == len(locked)
        if self.mode == "exact":
            assert s.cached_locked == sum(1 for p in self.cached.values() if holders[p] > 1)


def machine(mode: str, examples: int):
    cls = type(f"{mode.capitalize()}Machine", (CacheMachine,), {"mode": mode})
    cls.TestCase.settings = settings(max_examples=examples, stateful_step_count=40, deadline=None)
    return cls.TestCase


TestRadix = machine("radix", 300)
TestExact = machine("exact", 300)
TestPaged = machine("paged", 40)
TestNaive = machine("naive", 40)
