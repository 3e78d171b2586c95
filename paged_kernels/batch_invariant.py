"""Batch-invariant CPU kernels: a row's result depends on that row alone, never on the rows computed beside it.

What varies with the batch (measured, torch 2.13 CPU with MKL, 1 and 2 threads, the `tiny` and `small` shapes):
- A linear layer. MKL's sgemm sums a row of `x @ W.T` in an order that depends on M, the number of rows: rows of
  M = 1 to 3 differ from M >= 4 (83-91 % of outputs, by up to 4e-7 of their size), and on 2 threads some rows of
  M = 5 to 11 differ too. So a decode step (M = the number of sequences) and the same step inside a prefill chunk
  (M = the chunk) store different K/V. Here every matmul runs on tiles of exactly `TILE` rows (zero-padded): every
  row goes through one and the same MKL call shape, whatever M is. SGLang's deterministic mode and vLLM's
  batch-invariant kernels fix the reduction order the same way.
- Attention. The C++ decode kernel and the reference's padded matmuls (prefill) sum in different orders. Here every
  query is a decode step of its own (`PagedBatch.per_query`): the C++ kernel reads its keys in order with an online
  softmax, one thread for each (query, KV head), whatever else is in the call.
Row-wise reductions and elementwise ops (RMSNorm, SiLU, RoPE's cos/sin, softmax, `embedding_bag`) gave the same
bits for a row at every M tried (1 to 257), so they run as usual.

Cost on `small`, one thread: a lone decode step 2.4x the normal path's time (its one row padded to 16), 4 about
1.5x, 16 or more about 1.1x; prefill chunks 1.1x (64 steps) to 1.3x (256 steps at 512 of context), the attention
of long chunks being a scalar loop rather than matmuls.
"""

from __future__ import annotations

import torch

from paged_kernels import cpu_attention

# Rows per matmul call. 16 fp32 rows of any width start each tile on a 64-byte boundary, as the first one is: MKL's
# results may depend on the alignment of its operands.
TILE = 16


def check(x: torch.Tensor) -> None:
    """Raise unless these kernels can run on `x`: fp32 on the CPU, with the C++ decode kernel built."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        raise NotImplementedError(f"the batch-invariant forward is CPU fp32 only for now, got {x.dtype} on {x.device}")
    if not cpu_attention.available():
        raise RuntimeError("the batch-invariant forward needs the C++ CPU decode kernel, which did not build here")


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for x `[N, in]`, computed `TILE` rows per call."""
    n = x.shape[0]
    rows = -(-n // TILE) * TILE
    padded = x.new_zeros(rows, x.shape[1])
    padded[:n] = x
    out = x.new_empty(rows, weight.shape[0])
    for i in range(0, rows, TILE):
        torch.mm(padded[i : i + TILE], weight.t(), out=out[i : i + TILE])
    return out[:n]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    causal: bool = True,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`paged_kernels.paged_attention` for a batch in decode form (one query a sequence, `PagedBatch.per_query`)."""
    if not causal or q.shape[0] != len(seqlens_k) or len(cu_seqlens_q) != len(seqlens_k) + 1:
        raise ValueError("batch-invariant attention takes causal decode batches: one query a sequence")
    return cpu_attention.paged_decode(q, k_cache, v_cache, page_table, seqlens_k, sliding_window, None)
