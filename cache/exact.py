"""ExactCache: vLLM's automatic prefix caching over step tokens.

Each full page is named by a hash chain, blake2b(parent page's hash + this page's step tokens), so a page is reused
only when everything before it is equal too. The table is shared across every conversation. A cached page that
nobody but the cache references sits in a free LRU queue (a conversation's pages enter it tail first when released,
so its tail goes before its prefix); `evict` reclaims from the queue's old end and forgets the page's hash. Only
full pages are matched.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from cache.base import Handle, MatchResult, PrefixCache, as_key, page_tokens
from cache.pool import PagePool

ROOT_HASH = b""


def chain_hash(parent: bytes, tokens: bytes) -> bytes:
    return hashlib.blake2b(parent + tokens, digest_size=16).digest()


class ExactCache(PrefixCache):
    def __init__(self, pool: PagePool):
        super().__init__(pool)
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._free_queue: OrderedDict[int, None] = OrderedDict()  # cached pages only the cache references, LRU first

    def _match(self, key: np.ndarray) -> MatchResult:
        chain, h = [], ROOT_HASH
        for tokens in page_tokens(key, self.page_size, len(key) // self.page_size):
            h = chain_hash(h, tokens)
            page = self._page_of.get(h)
            if page is None:
                break
            chain.append((h, page))
        steps = len(chain) * self.page_size
        return MatchResult(steps, [p for _, p in chain], Handle(tuple(chain), steps))

    def insert(self, key: Any, pages: list[int]) -> Handle:
        key = as_key(key)
        n = self._full_pages(key, pages)
        chain, new, h = [], {}, ROOT_HASH
        for i, tokens in enumerate(page_tokens(key, self.page_size, n)):
            h = chain_hash(h, tokens)
            page = self._page_of.get(h)
            if page is None:
                page = pages[i]
                if page == 0:
                    break
                if page in self._hash_of or page in new:
                    raise ValueError(f"page {page} already caches another prefix; a page holds the K/V of one prefix")
                if not 0 < page < self.pool.num_pages or self.pool.refcount(page) == 0:
                    raise ValueError(f"page {page} is not held by the caller")
                new[page] = h
            chain.append((h, page))
        self.pool.incref(list(new))
        for page, h in new.items():
            self._page_of[h] = page
            self._hash_of[page] = h
        for _, page in chain:
            if page in self._free_queue:
                self._free_queue.move_to_end(page)
        return Handle(tuple(chain), len(chain) * self.page_size)

    def evict(self, num_pages: int) -> int:
        dropped = []
        while len(dropped) < num_pages and self._free_queue:
            page, _ = self._free_queue.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
            dropped.append(page)
        return self._record_eviction(dropped)

    def release(self, pages: list[int]) -> None:
        self.pool.decref(pages)
        for p in reversed(pages):
            if p in self._hash_of and self.pool.refcount(p) == 1:
                self._free_queue[p] = None

    def hold(self, pages: list[int]) -> None:
        super().hold(pages)
        for p in pages:
            self._free_queue.pop(p, None)

    def _lock(self, handle: Handle) -> None:
        if any(self._page_of.get(h) != p for h, p in handle.target):
            raise ValueError("the handle's prefix was evicted since match/insert returned it: lock right away")
        pages = [p for _, p in handle.target]
        self.pool.incref(pages)
        for p in pages:
            self._free_queue.pop(p, None)

    def _unlock(self, handle: Handle) -> None:
        self.release([p for _, p in handle.target])

    def _cached_counts(self) -> tuple[int, int]:
        return len(self._free_queue), len(self._hash_of) - len(self._free_queue)

    def _cached_pages(self) -> Iterable[int]:
        return self._hash_of.keys()

    def check(self) -> None:
        super().check()
        assert len(self._page_of) == len(self._hash_of), "hash table and page map differ"
        assert all(self._hash_of.get(p) == h for h, p in self._page_of.items()), "hash table and page map differ"
        for p in self._hash_of:
            assert (p in self._free_queue) == (self.pool.refcount(p) == 1), f"page {p} and the free queue"
        assert all(p in self._hash_of for p in self._free_queue), "an uncached page in the free queue"
