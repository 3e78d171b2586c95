"""Attention over paged K/V: Triton on CUDA, a torch reference elsewhere."""

from kernels.attention import paged_attention, set_backend, store_kv

__all__ = ["paged_attention", "set_backend", "store_kv"]
