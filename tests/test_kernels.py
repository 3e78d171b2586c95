"""kernels/ torch reference: paged attention equals dense attention computed one sequence at a time."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import reference


def dense_attention(q, k, v, q_pos, causal, window):
    """q [n, Hq, D] at positions q_pos, k/v [L, Hkv, D] at positions 0..L-1."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    kp = torch.arange(k.shape[0])
    mask = torch.ones(len(q_pos), k.shape[0], dtype=torch.bool)
    if causal:
        mask &= kp[None] <= q_pos[:, None]
    if window is not None:
        mask &= kp[None] > q_pos[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def build(seqs, page_size, kv_heads, dim, seed):
    """seqs: list of (cached, new). Returns everything paged_attention needs plus dense K/V per sequence."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 1 + sum(-(-(c + n) // page_size) for c, n in seqs) + 3
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=g)  # garbage everywhere first
    v_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=g)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    tables, dense = [], []
    for c, n in seqs:
        pages = [perm.pop() for _ in range(-(-(c + n) // page_size))]
        tables.append(pages)
        k = torch.randn(c + n, kv_heads, dim, generator=g)
        v = torch.randn(c + n, kv_heads, dim, generator=g)
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(c + n)])
        reference.store_kv(k, v, k_cache, v_cache, slots)
        dense.append((k, v))
    width = max(len(t) for t in tables)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, page_table, dense


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 3, 16]),
    heads=st.sampled_from([(4, 2), (2, 2), (4, 1)]),
    causal=st.booleans(),
    window=st.sampled_from([None, 1, 5, 17]),
)
def test_paged_attention_equals_dense(seqs, page_size, heads, causal, window) -> None:
    hq, hkv = heads
    dim = 8
    k_cache, v_cache, page_table, dense = build(seqs, page_size, hkv, dim, seed=len(seqs) + page_size)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(n for _, n in seqs), hq, dim, generator=g)
    cu = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).int()
    seqlens_k = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    out = reference.paged_attention(q, k_cache, v_cache, page_table, cu, seqlens_k, causal, window)
    for s, (c, n) in enumerate(seqs):
        q_pos = torch.arange(c, c + n)
        want = dense_attention(q[cu[s] : cu[s + 1]], *dense[s], q_pos, causal, window)
        assert (out[cu[s] : cu[s + 1]] - want).abs().max() <= 1e-5


def test_store_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros(3, 2, 1, 4)
    v_cache = torch.zeros(3, 2, 1, 4)
    k = torch.arange(12.0).view(3, 1, 4)
    reference.store_kv(k, -k, k_cache, v_cache, torch.tensor([5, -1, 2]))
    assert torch.equal(k_cache.view(6, 1, 4)[5], k[0]) and torch.equal(k_cache.view(6, 1, 4)[2], k[2])
    assert torch.equal(v_cache.view(6, 1, 4)[5], -k[0])
    assert k_cache.view(6, 1, 4)[[0, 1, 3, 4]].abs().sum() == 0


def test_dispatch_flag() -> None:
    from kernels import attention

    with pytest.raises(ValueError, match="backend"):
        attention.set_backend("cuda-please")
    attention.set_backend("torch")
    assert not attention._use_triton(torch.zeros(1))
    attention.set_backend("auto")
    assert not attention._use_triton(torch.zeros(1))  # CPU tensors take the torch path
