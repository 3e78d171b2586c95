"""Attention over paged K/V: Triton on CUDA, C++ and torch on CPU; `batch_invariant`: its batch-invariant kernels."""

from paged_kernels.attention import paged_attention, set_backend, store_kv

__all__ = ["paged_attention", "set_backend", "store_kv"]
