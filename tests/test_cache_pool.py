"""cache.PagePool: sizing, storage layout, reference counts, page 0, and running out."""

from __future__ import annotations

import pytest
import torch

from cache import OutOfPages, PagePool


def test_storage_layout_and_sizing():
    pool = PagePool(num_layers=3, kv_heads=2, head_dim=8, page_size=4, num_pages=10, dtype=torch.float16)
    assert len(pool.k) == len(pool.v) == 3
    assert pool.k_cache(1) is pool.k[1] and pool.v_cache(2) is pool.v[2]
    assert pool.k[0].shape == (10, 4, 2, 8) and pool.k[0].dtype == torch.float16
    assert pool.bytes_per_page == 2 * 3 * 4 * 2 * 8 * 2
    assert pool.num_usable == 9 and pool.num_free == 9
    by_budget = PagePool(3, 2, 8, page_size=4, budget_bytes=10 * pool.bytes_per_page + 5, dtype=torch.float16)
    assert by_budget.num_pages == 10


@pytest.mark.parametrize(
    "kw",
    [{}, {"num_pages": 4, "budget_bytes": 1 << 20}, {"num_pages": 1}, {"budget_bytes": 10}],
    ids=["neither", "both", "only page 0", "budget below 2 pages"],
)
def test_bad_sizes(kw):
    with pytest.raises(ValueError):
        PagePool(1, 1, 4, **kw)


def test_refcounts_and_page_zero():
    pool = PagePool(1, 1, 1, page_size=2, num_pages=5)
    pages = pool.alloc(4)
    assert sorted(pages) == [1, 2, 3, 4], "page 0 is padding and never allocated"
    assert all(pool.refcount(p) == 1 for p in pages)
    pool.incref([pages[0], pages[0]])
    assert pool.decref([pages[0], pages[1]]) == [pages[1]]
    assert pool.decref([pages[0], pages[0]]) == [pages[0]]
    assert pool.num_free == 2
    pool.check()
    with pytest.raises(ValueError, match="decref of page"):
        pool.decref([pages[0]])  # already free
    with pytest.raises(ValueError, match="incref of page"):
        pool.incref([pages[1]])  # a free page cannot be shared
    with pytest.raises(ValueError):
        pool.incref([0])
    with pytest.raises(ValueError):
        pool.decref([pages[2], pages[2]])  # held once, dropped twice: nothing changes
    assert pool.refcount(pages[2]) == 1
    pool.check()


def test_out_of_pages_hands_out_nothing():
    pool = PagePool(1, 1, 1, page_size=2, num_pages=4)
    held = pool.alloc(2)
    with pytest.raises(OutOfPages, match="need 2 pages, 1 of 3 are free"):
        pool.alloc(2)
    assert pool.num_free == 1
    (last,) = pool.alloc(1)
    assert last not in held
    pool.check()
