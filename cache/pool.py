"""PagePool: the K/V storage of every layer, cut into pages of `page_size` steps, with a reference count per page."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch


class OutOfPages(RuntimeError):
    """Fewer free pages than asked for: the caller queues or refuses the work; nothing was allocated."""


class PagePool:
    """K and V per layer, each `[num_pages, page_size, kv_heads, head_dim]`, and who holds which page.

    Page 0 is padding for page tables: it is never allocated. A page is free when its reference count is 0; `alloc`
    hands out free pages with one reference (the caller's), `incref` adds a holder, `decref` drops one and returns the
    page to the free list at 0. Size it with exactly one of `num_pages` (page 0 included) or `budget_bytes`.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        page_size: int = 16,
        num_pages: int | None = None,
        budget_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if (num_pages is None) == (budget_bytes is None):
            raise ValueError("give exactly one of num_pages and budget_bytes")
        if min(num_layers, kv_heads, head_dim, page_size) < 1:
            raise ValueError("num_layers, kv_heads, head_dim and page_size must be positive")
        self.num_layers, self.kv_heads, self.head_dim, self.page_size = num_layers, kv_heads, head_dim, page_size
        self.dtype, self.device = dtype, torch.device(device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_page = 2 * num_layers * page_size * kv_heads * head_dim * itemsize
        if num_pages is None:
            num_pages = budget_bytes // self.bytes_per_page
        if num_pages < 2:
            raise ValueError(f"the pool needs at least 2 pages (page 0 is padding), got {num_pages}")
        self.num_pages = num_pages
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # a stack: alloc pops from the end, page 1 first

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    @property
    def num_usable(self) -> int:
        """Pages that can be allocated: all but page 0."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int]:
        """`n` free pages, each with one reference owned by the caller."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} of {self.num_usable} are free")
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add a holder to pages that are already held: a free page cannot be shared."""
        pages = list(pages)
        for p in pages:
            if not 0 < p < self.num_pages or self._refs[p] == 0:
                raise ValueError(f"incref of page {p}, which is {'free' if 0 < p < self.num_pages else 'not a page'}")
        for p in pages:
            self._refs[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference per listed page (a page may be listed as often as it is held); returns the freed pages."""
        counts = Counter(pages)
        for p, c in counts.items():
            if not 0 < p < self.num_pages or self._refs[p] < c:
                held = self._refs[p] if 0 < p < self.num_pages else "not a page"
                raise ValueError(f"decref of page {p} {c} time(s), but its reference count is {held}")
        freed = []
        for p, c in counts.items():
            self._refs[p] -= c
            if self._refs[p] == 0:
                freed.append(p)
        self._free.extend(freed)
        return freed

    def copy_steps(self, src: int, dst: int, steps: int) -> None:
        """Copy the K/V of the first `steps` steps of page `src` into page `dst`, every layer (copy-on-write of a
        page whose start someone else's K/V already holds)."""
        if not 0 < steps <= self.page_size:
            raise ValueError(f"a page holds 1 to {self.page_size} steps, not {steps}")
        for p in (src, dst):
            if not 0 < p < self.num_pages or self._refs[p] == 0:
                raise ValueError(f"copy of page {p}, which is {'free' if 0 < p < self.num_pages else 'not a page'}")
        for cache in (*self.k, *self.v):
            cache[dst, :steps] = cache[src, :steps]

    def check(self) -> None:
        """Free list and reference counts agree: a page is free exactly when nobody references it."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice on the free list"
        assert 0 not in free and self._refs[0] == 0, "page 0 (padding) was handed out"
        for p in range(1, self.num_pages):
            assert (p in free) == (self._refs[p] == 0), f"page {p}: refcount {self._refs[p]}, on free list {p in free}"
