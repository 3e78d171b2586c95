"""The interface every cache mode gives the engine, its result types, and the ownership rules.

Who holds a reference on a page (the pool counts them):
- `alloc(n)` gives the caller one reference per page: its own pages. It gives them back with `release(pages)`, when the
  conversation closes or when pages fall out of its sliding window.
- `match(key)` adds nothing. The caller puts the matched pages in its page table and calls `lock(handle)` right away
  (before anything else can evict): the lock is what keeps them alive for it. The caller does not incref or release
  matched pages; it drops them with `unlock(handle)`. (radix: `lock_ref` on the node and its ancestors; exact: the lock
  holds a pool reference on each page of the chain, so they leave the free LRU queue.)
- `insert(key, pages)` caches the full pages of `key`: where the cache has no page for a prefix yet, it takes its own
  reference on the caller's page; where it has one, it keeps its own and leaves the caller's duplicate alone (the
  caller still holds it and releases it as usual). Returns a handle for what the cache now holds of `key`; the caller
  locks it and unlocks its previous handle.
- `hold(pages)` takes a reference on pages the caller does not own, to copy from them (`MatchResult.partial`, or a
  rewind into a cached page: copy-on-write, since nobody writes into a page the cache holds); `release` drops it.
- Eviction takes only pages that nobody but the cache references, outside locks.

A conversation's life: `m = match(key); lock(m.handle); own = alloc(...)`, page table `m.pages + own`; after a chunk
`h = insert(key, table); lock(h); unlock(previous)`; at close `release(own); unlock(h)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache.pool import OutOfPages, PagePool


@dataclass(eq=False)
class Handle:
    """A prefix the cache holds, as returned by `match` and `insert`: `steps` steps from position 0."""

    target: Any  # the mode's own reference to the prefix: a radix node, an exact hash chain, None for no reuse
    steps: int
    locks: int = 0


@dataclass
class MatchResult:
    cached_steps: int
    pages: list[int]
    handle: Handle
    # (page, n): a cached page whose first n steps (0 < n < page_size) continue the match past `cached_steps`. The
    # caller may copy them into a page of its own (`PagePool.copy_steps`) instead of computing them, right away:
    # the page is not locked. Radix only: a hash chain names whole pages, a tree can compare the steps of one.
    partial: tuple[int, int] | None = None


@dataclass
class CacheStats:
    """Counters since the cache was made, and where every usable page is now.

    `free + cached_evictable + cached_locked + private == pool.num_usable`. Cached pages are the ones the cache
    references; `cached_locked` are those a live conversation protects (radix: in a node with `lock_ref > 0`; exact:
    referenced by a caller, by lock or as its own page), `cached_evictable` the rest. `private` pages are referenced
    by callers only. `evicted_live_pages` counts evicted pages some caller still referenced: 0 by construction.
    """

    hit_steps: int = 0
    missed_steps: int = 0
    evicted_pages: int = 0
    evicted_live_pages: int = 0
    free: int = 0
    cached_evictable: int = 0
    cached_locked: int = 0
    private: int = 0


def as_key(key: Any) -> np.ndarray:
    """A key as a `[steps, width]` int64 array; two steps are equal only if their whole rows are."""
    a = np.asarray(key)
    if a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"a key is a [steps, width] array of step tokens with width >= 1, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise ValueError(f"step tokens must be integers, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def page_tokens(key: np.ndarray, page_size: int, num_pages: int) -> list[bytes]:
    """The step tokens of each of the first `num_pages` pages of `key`, as bytes (equal bytes = equal pages)."""
    rows = key[: num_pages * page_size].reshape(num_pages, page_size * key.shape[1])
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).ravel().tolist()


class PrefixCache(ABC):
    """One cache mode over a PagePool; see the module docstring for who references what."""

    shares_prefixes = True  # False where `match` never gives anything back (the engine then skips re-matching)

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self._hit_steps = self._missed_steps = self._evicted_pages = self._evicted_live_pages = 0

    def match(self, key: Any, record: bool = True) -> MatchResult:
        """The longest cached prefix of `key` in full pages, never its last step (whose logits the caller has to
        compute: a conversation given all of its known steps would have nothing to predict from); adds no reference
        (lock the handle to keep it). `record=False` leaves the hit and miss counters alone (a re-match; see
        `record_hits`)."""
        key = as_key(key)
        result = self._match(key[: len(key) - 1])
        if record:
            self._record_match(len(key), result.cached_steps)
        return result

    def record_hits(self, gained: int, from_missed: int) -> None:
        """The cache gave a conversation `gained` more steps than its match counted (a later re-match, or a partial
        page copied), `from_missed` of which were counted as missed: they are hits now."""
        self._hit_steps += gained
        self._missed_steps -= from_missed

    @abstractmethod
    def _match(self, key: np.ndarray) -> MatchResult:
        """The longest cached prefix of all of `key` (`match` has dropped the last step)."""

    @abstractmethod
    def insert(self, key: Any, pages: list[int]) -> Handle:
        """Cache the full pages of `key`, whose K/V the caller holds in `pages` (`len(pages) >= len(key) // page_size`).

        A 0 in `pages` marks a page the caller gave back (sliding window): insert stops before it unless the cache
        already holds that page. The handle covers what the cache holds of `key` afterwards (`handle.steps`).
        """

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` cached pages that nobody else references, least recently used first; returns how
        many were freed."""

    @abstractmethod
    def _lock(self, handle: Handle) -> None: ...

    @abstractmethod
    def _unlock(self, handle: Handle) -> None: ...

    @abstractmethod
    def _cached_counts(self) -> tuple[int, int]:
        """(cached_evictable, cached_locked) pages, as kept up to date by the mode."""

    @abstractmethod
    def _cached_pages(self) -> Iterable[int]:
        """Every page the cache references, once each."""

    def lock(self, handle: Handle) -> None:
        """Protect the handle's prefix from eviction (and keep its pages alive for the caller) until `unlock`."""
        self._lock(handle)
        handle.locks += 1

    def unlock(self, handle: Handle) -> None:
        if handle.locks == 0:
            raise ValueError("unlock of a handle that is not locked")
        handle.locks -= 1
        self._unlock(handle)

    def alloc(self, n: int) -> list[int]:
        """`n` pages owned by the caller, evicting cached pages if the free ones are too few.

        Raises OutOfPages, evicting nothing, when even evicting everything evictable would not be enough.
        """
        short = n - self.pool.num_free
        if short > 0:
            evictable, locked = self._cached_counts()
            if short > evictable:
                raise OutOfPages(
                    f"need {n} pages: {self.pool.num_free} free and {evictable} evictable; live conversations hold "
                    f"the other {self.pool.num_usable - self.pool.num_free - evictable} ({locked} of them cached)"
                )
            self.evict(short)
        return self.pool.alloc(n)

    def release(self, pages: list[int]) -> None:
        """The caller drops its references on its own pages (not on matched ones: those go with `unlock`)."""
        self.pool.decref(pages)

    def hold(self, pages: list[int]) -> None:
        """A reference on pages the caller does not own, kept from eviction until it copies what it needs from them
        (`MatchResult.partial`, a rewind into a cached page); dropped with `release`."""
        self.pool.incref(pages)

    def forget_past(self, handle: Handle, keep: Handle) -> None:
        """Uncache what `handle` holds past `keep` (a prefix of it), as far as nobody locks it or shares it: a
        conversation whose head has left its window keeps no use for it. Modes that can evict any page on its own
        (exact: a hash chain's pages are reclaimed in LRU order, whatever their place) leave it to eviction."""
        return None

    def pages_on_open(self, max_steps: int) -> int:
        """Pages a conversation reserves when it opens; modes that allocate on demand reserve none."""
        return 0

    def stats(self) -> CacheStats:
        evictable, locked = self._cached_counts()
        free = self.pool.num_free
        return CacheStats(
            hit_steps=self._hit_steps,
            missed_steps=self._missed_steps,
            evicted_pages=self._evicted_pages,
            evicted_live_pages=self._evicted_live_pages,
            free=free,
            cached_evictable=evictable,
            cached_locked=locked,
            private=self.pool.num_usable - free - evictable - locked,
        )

    def check(self) -> None:
        """Integrity: the pool is consistent and every usable page is in exactly one of the four states, counted
        from scratch (the mode's `check` adds its structure and recounts evictable and locked)."""
        self.pool.check()
        evictable, locked = self._cached_counts()
        cached = set(self._cached_pages())
        assert min(evictable, locked) >= 0 and len(cached) == evictable + locked, (len(cached), evictable, locked)
        assert all(self.pool.refcount(p) > 0 for p in cached), "the cache references a free page"
        private = sum(1 for p in range(1, self.pool.num_pages) if self.pool.refcount(p) and p not in cached)
        assert self.pool.num_free + evictable + locked + private == self.pool.num_usable

    def _record_match(self, key_steps: int, cached_steps: int) -> None:
        self._hit_steps += cached_steps
        self._missed_steps += key_steps - cached_steps

    def _record_eviction(self, dropped: list[int]) -> int:
        """Drop the cache's reference on `dropped`; returns how many pages that freed."""
        freed = self.pool.decref(dropped)
        self._evicted_pages += len(dropped)
        self._evicted_live_pages += len(dropped) - len(freed)
        return len(freed)

    def _full_pages(self, key: np.ndarray, pages: list[int]) -> int:
        """How many full pages `key` has, checking that `pages` covers them."""
        n = len(key) // self.page_size
        if len(pages) < n:
            raise ValueError(f"a key of {len(key)} steps needs {n} full pages, got {len(pages)} page ids")
        return n
