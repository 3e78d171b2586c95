"""paged_kernels/ torch reference: paged attention equals dense attention computed one sequence at a time."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kernels import reference


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


def test_dispatch_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU, "auto" sends decode steps to the C++ kernel and extends to the reference, a mixed batch split between
    them; "torch" forces the reference for everything, in one call."""
    from paged_kernels import attention, cpu_attention

    with pytest.raises(ValueError, match="backend"):
        attention.set_backend("cuda-please")
    calls: list[str] = []
    for module, name in ((cpu_attention, "paged_decode"), (reference, "paged_attention")):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw)
        )
    monkeypatch.setattr(attention, "_backend", attention._backend)
    k_cache, v_cache, page_table, _ = build([(4, 1), (9, 1)], 4, 2, 8, seed=0)
    decode = (torch.randn(2, 4, 8), k_cache, v_cache, page_table, torch.tensor([0, 1, 2]), torch.tensor([5, 10]))
    mixed = (torch.randn(3, 4, 8), k_cache, v_cache, page_table, torch.tensor([0, 1, 3]), torch.tensor([5, 10]))
    wants = (("auto", ["paged_decode", "paged_decode", "paged_attention"]), ("torch", ["paged_attention"] * 2))
    for backend, want in wants:
        attention.set_backend(backend)
        calls.clear()
        attention.paged_attention(*decode)
        attention.paged_attention(*mixed)
        assert calls == want


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 60), st.sampled_from([1, 1, 2, 5, 30])), min_size=1, max_size=7),
    page_size=st.sampled_from([1, 16]),
    window=st.sampled_from([None, 7]),
)
def test_cpu_split_batch_equals_reference(seqs, page_size, window) -> None:
    """A CPU batch of decode steps and extends of any lengths, split into calls (`cpu_attention.groups`), gives what
    one reference call over the whole batch gives."""
    from paged_kernels import cpu_attention

    k_cache, v_cache, page_table, _ = build(seqs, page_size, 2, 8, seed=len(seqs))
    q = torch.randn(sum(n for _, n in seqs), 4, 8, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).int()
    seqlens_k = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    want = reference.paged_attention(q, k_cache, v_cache, page_table, cu, seqlens_k, True, window)
    got = cpu_attention.paged_attention(q, k_cache, v_cache, page_table, cu, seqlens_k, True, window, None)
    assert (got - want).abs().max() <= 1e-5


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 1, 2, 4, 5, 12, 64, 244, 256]), st.integers(1, 3000)), min_size=1))
def test_cpu_groups_keep_padding_small(seqs) -> None:
    """Every sequence in exactly one call; decode steps in one call of their own; no extend pays for another's
    shape beyond the padding limit (one reference call pads all of its sequences to the longest query and keys:
    16 decodes beside a 256-step prefill made that call 16x the prefill's work)."""
    from paged_kernels import cpu_attention

    q_lens, k_lens = [q for q, _ in seqs], [max(q, k) for q, k in seqs]
    parts = cpu_attention.groups(q_lens, k_lens)
    assert sorted(i for part in parts for i in part) == list(range(len(seqs)))
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    assert [p for p in parts if any(q_lens[i] == 1 for i in p)] == ([decodes] if decodes else [])
    for part in parts:
        if len(part) > 1 and q_lens[part[0]] > 1:
            padded = len(part) * max(q_lens[i] for i in part) * max(k_lens[i] for i in part)
            assert padded <= cpu_attention.PADDING_LIMIT * sum(q_lens[i] * k_lens[i] for i in part)


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    page_size=st.sampled_from([1, 3, 16]),
    heads=st.sampled_from([(4, 2), (2, 2), (8, 1), (6, 3), (8, 4)]),
    window=st.sampled_from([None, 1, 9]),
    threads=st.sampled_from([1, 2, 3, 5]),
)
def test_cpu_decode_kernel_equals_reference(lens, page_size, heads, window, threads) -> None:
    """The C++ decode kernel (CPU, fp32) against the torch reference; it must build on every machine CI uses. With
    more threads than sequences, a slot's KV heads are split between tasks, evenly or not."""
    from paged_kernels import cpu_attention

    assert cpu_attention.available(), "the C++ CPU decode kernel failed to build (see the warning)"
    hq, hkv = heads
    seqs = [(n - 1, 1) for n in lens]
    k_cache, v_cache, page_table, _ = build(seqs, page_size, hkv, 16, seed=sum(lens))
    q = torch.randn(len(seqs), hq, 16, generator=torch.Generator().manual_seed(3))
    cu = torch.arange(len(seqs) + 1, dtype=torch.int32)
    seqlens_k = torch.tensor(lens, dtype=torch.int32)
    assert cpu_attention.supports(q, k_cache, causal=True)
    assert not cpu_attention.supports(q, k_cache, causal=False)
    want = reference.paged_attention(q, k_cache, v_cache, page_table, cu, seqlens_k, True, window)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_attention.paged_decode(q, k_cache, v_cache, page_table, seqlens_k, window, None)
    finally:
        torch.set_num_threads(before)
    assert (got - want).abs().max() <= 1e-5


def test_reference_reuses_buffers_in_and_out_of_inference_mode() -> None:
    """The reused gather buffers must not leak inference tensors into autograd-mode calls (and back)."""
    k_cache, v_cache, page_table, _ = build([(7, 2)], 4, 2, 8, seed=1)
    args = (torch.randn(2, 4, 8), k_cache, v_cache, page_table, torch.tensor([0, 2]), torch.tensor([9]))
    with torch.inference_mode():
        a = reference.paged_attention(*args)
    b = reference.paged_attention(*args)
    with torch.inference_mode():
        c = reference.paged_attention(*args)
    assert torch.equal(a, b) and torch.equal(b, c)


def test_cpu_kernel_build_survives_a_stale_lock() -> None:
    """A build killed midway leaves torch's lock file behind; the next process must not wait on it forever."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from paged_kernels import cpu_attention

    assert cpu_attention.available()
    lock = Path(sys.prefix) / "s2s_extensions" / "cpu_paged_decode" / "lock"
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    code = "from paged_kernels import cpu_attention; assert cpu_attention.available()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert not lock.exists()
