"""Attention over paged K/V on CPU: decode steps in C++, extends through the torch reference in padded groups.

Decode: the torch reference must copy every sequence's pages into one block before a matmul can read them: per
step that moves the whole cache twice more than the attention itself reads it. The C++ kernel (built once with
torch's inline extension loader) reads each key and value once, in place, with an online softmax: one OpenMP task
per sequence, on as many threads as torch uses (torch's own `at::parallel_for` measured 1.7x slower here for this
loop). A task reads a slot's KV heads one after another, a run of memory, and a page's slots in order: read a head
at a time, the keys of a head lie a slot's width apart, and from memory (8 sequences of 1,100 steps) that took
2.3-2.9x as long. Only with more threads than sequences are a slot's heads split between tasks. fp32 only;
otherwise decode goes to the reference too.

Extend (more than one query a sequence: prefill) goes to the reference, whose matmuls are far faster than a scalar
loop for long chunks. But one reference call pads every sequence to the longest query and the longest keys: a tick
of 16 decode steps and one 256-step prefill at 1,000 steps of context took 1.09 s as one call against 70 ms split,
and a 244-step and a 12-step chunk together 1.9x one 256-step chunk (`s2s bench attention`, small preset, one
thread). So a batch is split (`groups`): its decode steps in one call, its extends in groups whose padding stays
small.
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from pathlib import Path

import torch

from paged_kernels import reference

PADDING_LIMIT = 1.25  # an extend group's padded attention work over its useful work (`groups`)

_SOURCE = r"""
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor page_table,
                           torch::Tensor seqlens_k, int64_t window, double scale, int64_t threads) {
    const int64_t S = q.size(0), HQ = q.size(1), D = q.size(2);
    const int64_t PS = k_cache.size(1), HKV = k_cache.size(2), G = HQ / HKV;
    const int64_t page_stride = k_cache.stride(0), slot_stride = k_cache.stride(1), head_stride = k_cache.stride(2);
    auto out = torch::empty_like(q);
    if (S == 0) return out;
    // KV heads a task: all of a slot's, unless there are more threads than sequences
    const int64_t blocks = std::min<int64_t>(HKV, std::max<int64_t>(1, (threads + S - 1) / S));
    const float* qp = q.data_ptr<float>();
    const float* kp = k_cache.data_ptr<float>();
    const float* vp = v_cache.data_ptr<float>();
    const int32_t* table = page_table.data_ptr<int32_t>();
    const int64_t table_width = page_table.size(1);
    const int64_t* lens = seqlens_k.data_ptr<int64_t>();
    float* op = out.data_ptr<float>();
    const float sc = static_cast<float>(scale);

#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(threads)
    for (int64_t s = 0; s < S; ++s) {
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t h0 = b * HKV / blocks, h1 = (b + 1) * HKV / blocks;
            const int64_t len = lens[s];
            const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
            std::vector<float> acc(HQ * D, 0.f), m(HQ, -std::numeric_limits<float>::infinity()), l(HQ, 0.f);
            const float* qs = qp + s * HQ * D;
            for (int64_t j = start; j < len; ++j) {
                const int64_t slot = table[s * table_width + j / PS] * page_stride + (j % PS) * slot_stride;
                for (int64_t h = h0; h < h1; ++h) {  // a slot's heads in a row: one run of memory, not a hop each
                    const float* kj = kp + slot + h * head_stride;
                    const float* vj = vp + slot + h * head_stride;
                    for (int64_t hq = h * G; hq < (h + 1) * G; ++hq) {
                        const float* qg = qs + hq * D;
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kj[d];
                        dot *= sc;
                        float* a = acc.data() + hq * D;
                        if (dot > m[hq]) {
                            const float c = std::exp(m[hq] - dot);
                            l[hq] = l[hq] * c + 1.f;
                            m[hq] = dot;
#pragma omp simd
                            for (int64_t d = 0; d < D; ++d) a[d] = a[d] * c + vj[d];
                        } else {
                            const float p = std::exp(dot - m[hq]);
                            l[hq] += p;
#pragma omp simd
                            for (int64_t d = 0; d < D; ++d) a[d] += p * vj[d];
                        }
                    }
                }
            }
            for (int64_t hq = h0 * G; hq < h1 * G; ++hq) {
                float* o = op + (s * HQ + hq) * D;
                const float inv = l[hq] > 0.f ? 1.f / l[hq] : 0.f;
                for (int64_t d = 0; d < D; ++d) o[d] = acc[hq * D + d] * inv;
            }
        }
    }
    return out;
}
"""


@functools.cache
def _extension():
    """Compile (first use on a machine, ~1 min; cached by torch afterwards) or None if that is impossible here."""
    try:
        from torch.utils.cpp_extension import load_inline

        # Build per environment (checkouts with different include paths would rebuild each other's cache), and
        # clear a lock a killed build left behind: torch would wait on it forever, and no build takes 10 minutes.
        build = Path(sys.prefix) / "s2s_extensions" / "cpu_paged_decode"
        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > 600:
            lock.unlink(missing_ok=True)
        return load_inline(
            name="s2s_cpu_paged_decode_omp",
            build_directory=str(build),
            cpp_sources=_SOURCE,
            functions=["paged_decode"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no ninja, no headers: the torch reference still works
        warnings.warn(f"C++ CPU decode attention unavailable, using the torch reference: {e}", stacklevel=2)
        return None


def available() -> bool:
    return _extension() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor, causal: bool) -> bool:
    """Whether the C++ kernel takes these decode queries (one per sequence): causal, fp32, on the CPU."""
    return (
        causal
        and q.device.type == "cpu"
        and q.dtype == k_cache.dtype == torch.float32
        and q.shape[1] % k_cache.shape[2] == 0
        and available()
    )


def groups(q_lens: list[int], k_lens: list[int]) -> list[list[int]]:
    """The sequences of a batch, split into one reference (or C++) call each: every decode step together (the
    C++ kernel does not pad; the reference pads their keys only), then the extends, longest query first, each
    joining the current group while the group's padded work (sequences x longest query x longest keys) stays within
    `PADDING_LIMIT` of its useful work (the sum of queries x keys), else opening the next. Grouping, rather than a
    call per extend, keeps a call's fixed cost off the many short chunks of streamed speech that arrive together."""
    out = [[i for i, n in enumerate(q_lens) if n == 1]]
    group: list[int] = []
    useful = longest_k = 0
    for i in sorted((i for i, n in enumerate(q_lens) if n > 1), key=lambda i: -q_lens[i]):
        work, k = q_lens[i] * k_lens[i], max(longest_k, k_lens[i])
        if group and (len(group) + 1) * q_lens[group[0]] * k > PADDING_LIMIT * (useful + work):
            out.append(group)
            group, useful, k = [], 0, k_lens[i]
        group.append(i)
        useful, longest_k = useful + work, k
    out.append(group)
    return [g for g in out if g]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    causal: bool,
    sliding_window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """`paged_kernels.paged_attention` for CPU tensors: the batch in `groups`, each through the C++ decode kernel where
    it `supports` them and the torch reference otherwise. Layouts as in paged_kernels/reference.py."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    parts = groups(q_lens, seqlens_k.tolist())
    if len(parts) == 1:
        return _call(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, causal, sliding_window, scale)
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for part in parts:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in part])
        seqs = torch.tensor(part)
        cu = torch.tensor([0] + [q_lens[i] for i in part]).cumsum(0).to(cu_seqlens_q.dtype)
        out[rows] = _call(
            q[rows], k_cache, v_cache, page_table[seqs], cu, seqlens_k[seqs], causal, sliding_window, scale
        )
    return out


def _call(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, causal, sliding_window, scale) -> torch.Tensor:
    if q.shape[0] == len(seqlens_k) and supports(q, k_cache, causal):  # one query a sequence: decode
        return paged_decode(q, k_cache, v_cache, page_table, seqlens_k, sliding_window, scale)
    return reference.paged_attention(
        q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, causal, sliding_window, scale
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    sliding_window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """q `[S, q_heads, dim]`, one query per sequence at position seqlens_k - 1; layouts as in
    paged_kernels/reference.py."""
    ext = _extension()
    assert ext is not None, "call supports() first"
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("K and V caches must share strides with a contiguous head_dim")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ext.paged_decode(
        q.contiguous(),
        k_cache,
        v_cache,
        page_table.to(torch.int32).contiguous(),
        seqlens_k.long().contiguous(),
        sliding_window or 0,
        scale,
        torch.get_num_threads(),
    )
