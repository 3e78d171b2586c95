"""Triton kernels over paged K/V: `store_kv` and one flash-attention kernel for decode and extend batches alike.

Semantics and layouts are those of `paged_kernels/reference.py`.

`paged_attention` design:
- A program owns BLOCK_Q query tokens of one sequence times the GROUP query heads that share one kv head. Its
  BLOCK_M rows are (token, head) pairs, token-major, so every K/V tile read from the cache serves the whole GQA
  group, and a decode step (one token) still fills GROUP rows of the tile.
- The grid is (N // BLOCK_Q + S, kv_heads) over a flat list of query blocks, so launching needs no host sync on
  `cu_seqlens_q`: sequence s owns blocks [cu[s] // BLOCK_Q + s, cu[s + 1] // BLOCK_Q + s + 1), at least
  cdiv(q_len, BLOCK_Q) of them, and a program finds its sequence by binary search over `cu_seqlens_q`; blocks
  past a sequence's queries exit at once (the layout vLLM's unified attention uses).
- Keys are visited BLOCK_N at a time, from the first key the block's first query can see (sliding window: earlier
  blocks are never read) to the last one its last query can see (causal); each key's page id comes from
  `page_table`, so any page size works. Online softmax in base 2 with fp32 accumulators.
Only shapes, dtypes and strides are checked: checking values (page ids, slots, lengths) would need a host sync.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The interpreter multiplies bf16 as raw uint16 bits, so under it bf16 products are taken in fp32 instead.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_FLOAT_TYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_INDEX_TYPES = (torch.int32, torch.int64)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
        dst = slot * stride_cs + heads * stride_ch + dims
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_seq(cu_seqlens_q_ptr, num_seqs, block_idx, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first query block, cu_seqlens_q[s] // BLOCK_Q + s, is <= block_idx."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Triton compiles a variant per integer argument equal to 1 or divisible by 16: the sequence count and the page
# table's width vary in service, and a variant built mid-service stalls a tick for seconds.
@triton.jit(do_not_specialize=["num_seqs", "stride_pt"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    page_table_ptr,
    cu_seqlens_q_ptr,
    seqlens_k_ptr,
    num_seqs,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_pt,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(cu_seqlens_q_ptr, num_seqs, block_idx, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_block_start = (block_idx - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_block_start < q_len:
        seqlen = tl.load(seqlens_k_ptr + seq)
        first_pos = seqlen - q_len  # position of the sequence's first query

        rows = tl.arange(0, BLOCK_M)
        q_idx = q_block_start + rows // GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        q_pos = first_pos + q_idx
        heads = kv_head * GROUP + rows % GROUP
        tokens = (q_start + q_idx).to(tl.int64)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)

        # The keys some query of this block can see.
        last_q = tl.minimum(q_block_start + BLOCK_Q, q_len) - 1
        if CAUSAL:
            kv_end = first_pos + last_q + 1
        else:
            kv_end = seqlen
        if WINDOW > 0:
            kv_start = tl.maximum(first_pos + q_block_start - WINDOW + 1, 0)
        else:
            kv_start = 0

        page_row = page_table_ptr + seq.to(tl.int64) * stride_pt
        head_off = kv_head * stride_ch
        # m starts finite so a row whose keys in a tile are all masked gets alpha = 1 and p = 0, never NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(kv_start, kv_end, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            k_ok = k_pos < kv_end
            page = tl.load(page_row + k_pos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
            kv_off = page * stride_cp + (k_pos % PAGE_SIZE) * stride_cs + head_off
            k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None], mask=k_ok[None, :] & dim_ok[:, None], other=0.0)
            s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale_log2
            visible = k_ok[None, :]
            if CAUSAL:
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
            acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

        # Every real row sees at least its own key; the guard only keeps padding rows finite.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _require(k_cache.dim() == 4, f"k_cache must be [num_pages, page_size, kv_heads, head_dim], got {k_cache.shape}")
    _require(v_cache.shape == k_cache.shape, f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    _require(v_cache.dtype == k_cache.dtype, f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    _require(k_cache.dtype in _FLOAT_TYPES, f"cache dtype must be one of {list(_FLOAT_TYPES)}, got {k_cache.dtype}")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous")


def _check_devices(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    _require(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `k`, `v` `[N, kv_heads, head_dim]` into slot `slot_mapping[i]` of the caches; negative slots are skipped.

    Slots must be < num_pages * page_size (not checked). k and v may be strided views (e.g. slices of a fused
    projection) as long as head_dim is contiguous; they are cast to the cache dtype.
    """
    _check_cache(k_cache, v_cache)
    _, _, kv_heads, head_dim = k_cache.shape
    for name, t in (("k", k), ("v", v)):
        _require(t.dim() == 3 and t.shape[1:] == (kv_heads, head_dim), f"{name} must be [N, {kv_heads}, {head_dim}]")
        _require(t.dtype in _FLOAT_TYPES, f"{name} dtype must be one of {list(_FLOAT_TYPES)}, got {t.dtype}")
        _require(t.stride(-1) == 1, f"{name} must be contiguous in head_dim")
    _require(v.shape[0] == k.shape[0], f"k has {k.shape[0]} tokens, v has {v.shape[0]}")
    _require(
        slot_mapping.shape == (k.shape[0],) and slot_mapping.dtype in _INDEX_TYPES,
        f"slot_mapping must be int32/int64 [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}",
    )
    _require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    _check_devices(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    causal: bool = True,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of the flattened queries `q` `[N, q_heads, head_dim]` over paged keys; returns q's shape and dtype.

    Decode (one query a sequence), extend over a cached prefix and mixed batches all take this one kernel. Values
    are trusted: page ids in range, 0 <= q_len <= seqlens_k, cu_seqlens_q[0] == 0 and non-decreasing.
    """
    _check_cache(k_cache, v_cache)
    _, page_size, kv_heads, head_dim = k_cache.shape
    _require(q.dim() == 3, f"q must be [N, q_heads, head_dim], got {tuple(q.shape)}")
    num_tokens, q_heads, _ = q.shape
    _require(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    _require(q_heads % kv_heads == 0, f"q_heads {q_heads} must be a multiple of kv_heads {kv_heads}")
    _require(q.dtype in _FLOAT_TYPES, f"q dtype must be one of {list(_FLOAT_TYPES)}, got {q.dtype}")
    _require(q.stride(-1) == 1, "q must be contiguous in head_dim")
    _require(page_table.dim() == 2, f"page_table must be [S, max_pages], got {tuple(page_table.shape)}")
    num_seqs = page_table.shape[0]
    for name, t, shape in (
        ("page_table", page_table, tuple(page_table.shape)),
        ("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,)),
        ("seqlens_k", seqlens_k, (num_seqs,)),
    ):
        _require(
            tuple(t.shape) == shape and t.dtype in _INDEX_TYPES,
            f"{name} must be int32/int64 {list(shape)}, got {t.dtype} {list(t.shape)}",
        )
        _require(t.is_contiguous(), f"{name} must be contiguous")
    _require(sliding_window is None or sliding_window >= 1, f"sliding_window must be >= 1, got {sliding_window}")
    _check_devices(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = q_heads // kv_heads
    # Rows per program: enough for the average sequence's (token, head) rows, 16 at least for tl.dot, 64 at most
    # (more only when one token's group needs it).
    rows = triton.cdiv(num_tokens, num_seqs) * group
    block_m = max(min(triton.next_power_of_2(rows), 64), 16, triton.next_power_of_2(group))
    block_q = block_m // group
    block_d = max(triton.next_power_of_2(head_dim), 16)
    dot_dtype = _FLOAT_TYPES[q.dtype]
    if _INTERPRET and dot_dtype == tl.bfloat16:
        dot_dtype = tl.float32
    if scale is None:
        scale = head_dim**-0.5
    grid = (num_tokens // block_q + num_seqs, kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        cu_seqlens_q,
        seqlens_k,
        num_seqs,
        scale * 1.4426950408889634,  # log2(e): the kernel works in base 2
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_table.stride(0),
        HEAD_DIM=head_dim,
        GROUP=group,
        PAGE_SIZE=page_size,
        CAUSAL=causal,
        WINDOW=sliding_window or 0,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=64 if block_d <= 128 else 32,
        BLOCK_D=block_d,
        num_warps=4 if block_m * block_d <= 64 * 128 else 8,
    )
    return out
