"""Torch reference for attention over paged K/V: batched gathers and one SDPA call, no Python loop over tokens.

Layouts (shared with the Triton kernels):
- `k_cache`, `v_cache`: `[num_pages, page_size, kv_heads, head_dim]` for one layer.
- `slot_mapping`: `[N]` int, `page * page_size + offset` where token i's K/V goes; negative slots are skipped.
- `q`: `[N, q_heads, head_dim]`, the queries of S sequences flattened; `cu_seqlens_q`: `[S + 1]` offsets into it.
- `page_table`: `[S, max_pages]` int, the pages of each sequence in order (unused entries may hold any valid page).
- `seqlens_k`: `[S]` int, keys of each sequence including this call's new ones (already stored). Query i of a
  sequence with `q_len` queries sits at position `seqlens_k - q_len + i`.
- causal: a query sees keys at positions <= its own; `sliding_window=W`: and > its own - W (the last W steps).
"""

from __future__ import annotations

import threading

import torch

_workspace = threading.local()


def _scratch(name: str, pages: int, page_size: int, dim: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable [pages, page_size, dim] buffer per thread: a fresh multi-MB tensor every call costs more in page
    faults (the allocator returns large blocks to the OS) than the gather that fills it."""
    key = (name, like.dtype, like.device, torch.is_inference_mode_enabled())  # inference tensors stay apart
    buffers = getattr(_workspace, "buffers", None)
    if buffers is None:
        buffers = _workspace.buffers = {}
    size = pages * page_size * dim
    buf = buffers.get(key)
    if buf is None or buf.numel() < size:
        buf = buffers[key] = torch.empty(size, dtype=like.dtype, device=like.device)
    return buf[:size].view(pages, page_size, dim)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


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
    """Per KV head: gather that head's slice of each sequence's pages into one contiguous block, then two batched
    matmuls over [S, queries x group, keys]. Masked slots get probability 0; pages must hold finite values (the pool
    starts zeroed and the model writes finite K/V), since 0 * NaN would still be NaN.
    """
    num_seqs = seqlens_k.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return torch.empty_like(q)
    num_pages, page_size, kv_heads, dim = k_cache.shape
    q_heads = q.shape[1]
    group = q_heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    max_q = int(q_lens.max())
    max_k = int(seqlens_k.max())
    pages = page_table[:, : -(-max_k // page_size)].reshape(-1).long()
    decode = max_q == 1
    if decode:
        padded = q.view(num_seqs, 1, q_heads, dim)
    else:
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens)
        index_in_seq = torch.arange(q.shape[0], device=q.device) - cu_seqlens_q[:-1].long()[seq_of_token]
        padded = q.new_zeros(num_seqs, max_q, q_heads, dim)
        padded[seq_of_token, index_in_seq] = q

    key_pos = torch.arange(max_k, device=q.device)
    q_pos = (seqlens_k.long() - q_lens)[:, None] + torch.arange(max_q, device=q.device)  # [S, max_q]
    visible = key_pos[None, None, :] < seqlens_k.long()[:, None, None]
    if causal:
        visible = visible & (key_pos[None, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        visible = visible & (key_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
    # [S, max_q * group, max_k], rows ordered (query, group) as q_h below
    hidden = ~visible.expand(num_seqs, max_q, max_k).repeat_interleave(group, dim=1)

    out = torch.empty(num_seqs, max_q, kv_heads, group, dim, dtype=torch.float32, device=q.device)
    for h in range(kv_heads):
        # this head's slice of each page, gathered into one contiguous [S, keys, dim] block
        keys = torch.index_select(k_cache[:, :, h], 0, pages, out=_scratch("k", len(pages), page_size, dim, k_cache))
        values = torch.index_select(v_cache[:, :, h], 0, pages, out=_scratch("v", len(pages), page_size, dim, v_cache))
        keys = keys.view(num_seqs, -1, dim)[:, :max_k].float()
        values = values.view(num_seqs, -1, dim)[:, :max_k].float()
        q_h = padded[:, :, h * group : (h + 1) * group].reshape(num_seqs, max_q * group, dim).float()
        scores = torch.bmm(q_h, keys.transpose(1, 2)) * scale
        probs = scores.masked_fill_(hidden, float("-inf")).softmax(-1).nan_to_num_(0.0)  # all-hidden pad rows -> 0
        out[:, :, h] = torch.bmm(probs, values).view(num_seqs, max_q, group, dim)
    out = out.view(num_seqs, max_q, q_heads, dim).to(q.dtype)
    return out[:, 0] if decode else out[seq_of_token, index_in_seq]
