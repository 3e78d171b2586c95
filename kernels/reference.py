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

import torch
import torch.nn.functional as F


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
    num_seqs = seqlens_k.shape[0]
    page_size = k_cache.shape[1]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    max_q = int(q_lens.max())
    max_k = int(seqlens_k.max())
    pages = page_table[:, : -(-max_k // page_size)].long()
    # [S, pages * page_size, kv_heads, dim] -> [S, kv_heads, max_k, dim]
    keys = k_cache[pages].flatten(1, 2)[:, :max_k].transpose(1, 2)
    values = v_cache[pages].flatten(1, 2)[:, :max_k].transpose(1, 2)

    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens)
    index_in_seq = torch.arange(q.shape[0], device=q.device) - cu_seqlens_q[:-1].long()[seq_of_token]
    padded = q.new_zeros(num_seqs, max_q, *q.shape[1:])
    padded[seq_of_token, index_in_seq] = q

    key_pos = torch.arange(max_k, device=q.device)
    q_pos = (seqlens_k.long() - q_lens)[:, None] + torch.arange(max_q, device=q.device)  # [S, max_q]
    mask = key_pos[None, None, :] < seqlens_k.long()[:, None, None]
    if causal:
        mask = mask & (key_pos[None, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        mask = mask & (key_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
    # Slots no query reads (past the sequence, before the window, pages already handed back) may hold anything,
    # NaN included, and 0 * NaN is NaN: zero them so that masked garbage never reaches the output.
    unread = ~mask.any(1)  # [S, max_k]
    keys = keys.masked_fill(unread[:, None, :, None], 0)
    values = values.masked_fill(unread[:, None, :, None], 0)
    mask = mask | (torch.arange(max_q, device=q.device)[None, :, None] >= q_lens[:, None, None])  # padding rows

    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[seq_of_token, index_in_seq]
