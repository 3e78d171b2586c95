"""Public attention functions over paged K/V, dispatched to Triton (CUDA) or torch (everywhere else).

`set_backend("triton" | "torch" | "auto")` or the environment variable `S2S_ATTENTION_BACKEND` forces one.
"auto" picks Triton for CUDA tensors; on CPU `paged_kernels/cpu_attention.py`: a batch split into decode steps (its C++
kernel) and groups of extends (the torch reference, which pads every sequence of a call to the longest). "torch" is
the reference alone. Forcing Triton on CPU tensors works only under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import os

import torch

from paged_kernels import cpu_attention, reference

_BACKENDS = ("auto", "triton", "torch")
_backend = os.environ.get("S2S_ATTENTION_BACKEND", "auto")
if _backend not in _BACKENDS:
    raise ValueError(f"S2S_ATTENTION_BACKEND must be one of {_BACKENDS}, got {_backend!r}")


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"attention backend must be one of {_BACKENDS}, got {name!r}")
    _backend = name


def _use_triton(t: torch.Tensor) -> bool:
    return _backend == "triton" or (_backend == "auto" and t.is_cuda)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new keys/values `[N, kv_heads, head_dim]` into their slots of one layer's page pool."""
    if _use_triton(k):
        from paged_kernels import triton_attention  # (imported where it runs: Triton's import is slow, and GPU-only)

        triton_attention.store_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping)


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
    """Attention of flattened queries over paged keys; decode (1 query a sequence) and extend alike.

    Layouts are in `paged_kernels/reference.py`. Returns `[N, q_heads, head_dim]` in q's dtype.
    """
    if _use_triton(q):
        from paged_kernels import triton_attention as impl  # (as in `store_kv`)
    elif _backend == "auto" and q.device.type == "cpu":
        return cpu_attention.paged_attention(
            q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, causal, sliding_window, scale
        )
    else:
        impl = reference
    return impl.paged_attention(
        q,
        k_cache,
        v_cache,
        page_table,
        cu_seqlens_q,
        seqlens_k,
        causal=causal,
        sliding_window=sliding_window,
        scale=scale,
    )
