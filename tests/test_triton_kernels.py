"""paged_kernels/triton_attention.py equals paged_kernels/reference.py; paged_kernels/attention.py dispatches to the
chosen backend.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set in conftest.py), so shapes stay small. Every attention
check runs the kernel on caches whose slots no query may read are NaN: a kernel that reads a key block outside the
sliding window, past a sequence's end or through an unused page_table entry returns NaN there.
"""

from __future__ import annotations

import pytest
import torch

from paged_kernels import attention, reference, triton_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_batch(
    q_lens: list[int],
    k_lens: list[int],
    page_size: int,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random caches, shuffled pages, random junk in unused page_table entries, and queries for one batch."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-k // page_size) for k in k_lens]
    num_pages = sum(counts) + 2  # two pages no sequence owns
    perm = torch.randperm(num_pages, generator=g)
    page_table = torch.randint(0, num_pages, (len(k_lens), max(counts) + 1), generator=g, dtype=torch.int32)
    first = 0
    for s, count in enumerate(counts):
        page_table[s, :count] = perm[first : first + count]
        first += count

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    cu_seqlens_q = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    batch = {
        "q": randn(sum(q_lens), q_heads, head_dim),
        "k_cache": randn(num_pages, page_size, kv_heads, head_dim),
        "v_cache": randn(num_pages, page_size, kv_heads, head_dim),
        "page_table": page_table,
        "cu_seqlens_q": cu_seqlens_q,
        "seqlens_k": torch.tensor(k_lens, dtype=torch.int32),
    }
    return {name: t.to(DEVICE) for name, t in batch.items()}


def poison_invisible(batch: dict[str, torch.Tensor], window: int | None) -> dict[str, torch.Tensor]:
    """A copy of the batch whose cache slots no query can see (under any causal setting) hold NaN."""
    page_size = batch["k_cache"].shape[1]
    visible = torch.zeros(batch["k_cache"].shape[:2], dtype=torch.bool)
    page_table = batch["page_table"].tolist()
    q_lens = batch["cu_seqlens_q"].diff().tolist()
    for s, (q_len, k_len) in enumerate(zip(q_lens, batch["seqlens_k"].tolist(), strict=True)):
        if q_len == 0:
            continue
        first = 0 if window is None else max(0, k_len - q_len - window + 1)
        for pos in range(first, k_len):
            visible[page_table[s][pos // page_size], pos % page_size] = True
    poisoned = dict(batch)
    for name in ("k_cache", "v_cache"):
        poisoned[name] = batch[name].masked_fill(~visible[..., None, None].to(DEVICE), float("nan"))
    return poisoned


def check(
    batch: dict[str, torch.Tensor], causal: bool = True, window: int | None = None, scale: float | None = None
) -> None:
    want = reference.paged_attention(**batch, causal=causal, sliding_window=window, scale=scale)
    got = triton_attention.paged_attention(
        **poison_invisible(batch, window), causal=causal, sliding_window=window, scale=scale
    )
    assert got.dtype == batch["q"].dtype and got.shape == batch["q"].shape
    tol = TOL[batch["q"].dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16])


@DTYPES
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_batch(dtype: torch.dtype, page_size: int) -> None:
    check(make_batch([1] * 5, [1, 16, 17, 40, 130], page_size, dtype=dtype))


@DTYPES
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_extend_over_cached_prefix(dtype: torch.dtype, page_size: int) -> None:
    # prefixes 0, 5, 23, 61; the 70-token chunk spans several query blocks
    check(make_batch([9, 3, 70, 17], [9, 8, 93, 78], page_size, dtype=dtype, seed=1))


@DTYPES
def test_mixed_decode_and_extend(dtype: torch.dtype) -> None:
    # includes a sequence with no queries this step
    check(make_batch([1, 12, 0, 1, 40], [30, 12, 5, 77, 59], 16, dtype=dtype, seed=2))


def test_batch_without_queries() -> None:
    check(make_batch([0, 0], [3, 5], 16))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 16])
def test_causal_and_sliding_window(causal: bool, window: int | None) -> None:
    # long enough that whole key blocks fall outside the window (and are NaN-poisoned)
    check(make_batch([1, 40, 3, 1], [150, 140, 90, 2], 3, seed=3), causal=causal, window=window)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"),
    [(4, 4, 16), (4, 1, 64), (6, 2, 24), (8, 2, 128), (2, 2, 8)],
)
def test_heads_and_head_dims(q_heads: int, kv_heads: int, head_dim: int) -> None:
    batch = make_batch([1, 7, 20], [5, 30, 20], 16, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, seed=4)
    check(batch)


def test_bf16_and_custom_scale() -> None:
    check(make_batch([1, 12, 1], [33, 20, 1], 16, dtype=torch.bfloat16, seed=5), scale=0.3)


def test_strided_q_and_mixed_cache_dtype() -> None:
    batch = make_batch([2, 9], [20, 9], 16, seed=6)
    fused = torch.randn(11, 4 * 32 + 64, device=DEVICE)  # q taken from a fused qkv projection
    batch["q"] = fused[:, : 4 * 32].view(11, 4, 32)
    batch["k_cache"], batch["v_cache"] = batch["k_cache"].half(), batch["v_cache"].half()
    check(batch)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_store_kv(cache_dtype: torch.dtype, page_size: int) -> None:
    g = torch.Generator().manual_seed(7)
    num_pages, kv_heads, head_dim, n = 12, 3, 24, 9
    fused = torch.randn(n, 2 * kv_heads * head_dim + 8, generator=g).to(DEVICE)  # strided k and v views
    k = fused[:, : kv_heads * head_dim].view(n, kv_heads, head_dim)
    v = fused[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(n, kv_heads, head_dim)
    slots = torch.randperm(num_pages * page_size, generator=g)[:n]
    slots[[0, 4, 8]] = -1
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(cache_dtype).to(DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, want_k, want_v, slots.to(DEVICE))
    triton_attention.store_kv(k, v, k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_argument_checks() -> None:
    b = make_batch([1, 2], [4, 5], 16)
    bad = [
        ({"q": b["q"][:, :3]}, "multiple of kv_heads"),
        ({"q": b["q"][..., :16]}, "head_dim"),
        ({"q": b["q"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous in head_dim"),
        ({"q": b["q"].to(torch.float64)}, "q dtype"),
        ({"v_cache": b["v_cache"].half()}, "v_cache dtype"),
        ({"v_cache": b["v_cache"][:1]}, "v_cache shape"),
        ({"k_cache": b["k_cache"][0]}, "k_cache must be"),
        ({"cu_seqlens_q": b["cu_seqlens_q"][:2]}, "cu_seqlens_q"),
        ({"seqlens_k": b["seqlens_k"].float()}, "seqlens_k"),
        ({"page_table": b["page_table"].t().contiguous().t()}, "page_table must be contiguous"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            triton_attention.paged_attention(**{**b, **change})
    with pytest.raises(ValueError, match="sliding_window"):
        triton_attention.paged_attention(**b, sliding_window=0)
    k = torch.zeros(3, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_attention.store_kv(k, k, b["k_cache"], b["v_cache"], torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="k must be"):
        triton_attention.store_kv(k[:, :1], k, b["k_cache"], b["v_cache"], torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("triton", "triton"), ("torch", "torch"), ("auto", "triton" if DEVICE == "cuda" else "torch")],
)
def test_dispatch(monkeypatch: pytest.MonkeyPatch, backend: str, expected: str) -> None:
    calls: list[str] = []

    def spy(module: object, name: str, tag: str) -> None:
        real = getattr(module, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            calls.append(f"{tag}.{name}")
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module, tag in ((triton_attention, "triton"), (reference, "torch")):
        spy(module, "store_kv", tag)
        spy(module, "paged_attention", tag)
    monkeypatch.setattr(attention, "_backend", attention._backend)  # restored after the test
    attention.set_backend(backend)

    b = make_batch([1, 5], [9, 5], 3, seed=8)
    want = reference.paged_attention(**b, sliding_window=4, scale=0.5)
    calls.clear()
    k = torch.randn(6, 2, 32, device=DEVICE)
    attention.store_kv(k, -k, b["k_cache"], b["v_cache"], torch.full((6,), -1, device=DEVICE))
    got = attention.paged_attention(**b, sliding_window=4, scale=0.5)
    assert calls == [f"{expected}.store_kv", f"{expected}.paged_attention"]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_set_backend_rejects_unknown_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_backend", attention._backend)
    with pytest.raises(ValueError, match="attention backend"):
        attention.set_backend("cuda")
