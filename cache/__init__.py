"""cache: the page pool and the prefix caches (naive, paged, exact-hash, radix) the engine allocates K/V through."""

from cache.base import CacheStats, Handle, MatchResult, PrefixCache
from cache.exact import ExactCache
from cache.naive import NaiveCache
from cache.paged import PagedCache
from cache.pool import OutOfPages, PagePool
from cache.radix import RadixCache

MODES: dict[str, type[PrefixCache]] = {
    "naive": NaiveCache,
    "paged": PagedCache,
    "exact": ExactCache,
    "radix": RadixCache,
}


def make_cache(mode: str, pool: PagePool, **kw) -> PrefixCache:
    """The cache for `mode`, one of naive, paged, exact, radix, over `pool`."""
    if mode not in MODES:
        raise ValueError(f"unknown cache mode {mode!r}; choose one of {', '.join(MODES)}")
    return MODES[mode](pool, **kw)


__all__ = [
    "MODES",
    "CacheStats",
    "ExactCache",
    "Handle",
    "MatchResult",
    "NaiveCache",
    "OutOfPages",
    "PagePool",
    "PagedCache",
    "PrefixCache",
    "RadixCache",
    "make_cache",
]
