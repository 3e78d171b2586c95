"""NaiveCache: a conversation reserves pages for its whole context when it opens; no reuse."""

from __future__ import annotations

import math

from cache.paged import PagedCache


class NaiveCache(PagedCache):
    """Paged without on-demand growth: the engine allocates `pages_on_open(max_steps)` pages up front."""

    def pages_on_open(self, max_steps: int) -> int:
        return math.ceil(max_steps / self.page_size)
