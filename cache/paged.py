"""PagedCache: pages on demand, no reuse; nothing is ever cached (the baseline for the reusing modes)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from cache.base import Handle, MatchResult, PrefixCache, as_key


class PagedCache(PrefixCache):
    """Every conversation computes its whole key; its pages are its own and freed at close. Handles cover 0 steps."""

    shares_prefixes = False

    def _match(self, key: np.ndarray) -> MatchResult:
        return MatchResult(0, [], Handle(None, 0))

    def insert(self, key: Any, pages: list[int]) -> Handle:
        self._full_pages(as_key(key), pages)
        return Handle(None, 0)

    def evict(self, num_pages: int) -> int:
        return 0

    def _lock(self, handle: Handle) -> None:
        pass

    def _unlock(self, handle: Handle) -> None:
        pass

    def _cached_counts(self) -> tuple[int, int]:
        return 0, 0

    def _cached_pages(self) -> Iterable[int]:
        return ()
