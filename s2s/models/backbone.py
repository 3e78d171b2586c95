"""Backbone: transformers' `LlamaModel` (without `embed_tokens`): same parameter names and math, so a LlamaModel loads
its state dict and a Llama checkpoint can initialise it. Two paths share the weights:
- `Backbone.forward(inputs_embeds)`: full causal attention without a cache (the reference);
- `Backbone.forward_paged(x, batch, k_caches, v_caches)`: a flattened batch of sequences that decode or extend on top
  of K/V held in pages (`s2s.batch.PagedBatch`), through `paged_kernels.store_kv` and `paged_kernels.paged_attention`.
  With `batch_invariant=True` the matmuls and attention go through `paged_kernels.batch_invariant`: each step's K/V and
  hidden state are then the same bits whatever batch, chunk or position in the batch it was computed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paged_kernels import batch_invariant as invariant
from paged_kernels import paged_attention, store_kv
from s2s.models import compact
from s2s.models.config import ModelConfig
from s2s.runner.batch import PagedBatch

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weight) -> x @ weight.T


Linears = Callable[..., tuple[torch.Tensor, ...]]  # (x, *weights) -> x @ weight.T for each weight


def linear_for(batch_invariant: bool) -> Linear:
    """The paged forward's matmul: batch-invariant tiles, or a weight's nonzero block (`s2s/models/compact.py`)."""
    return invariant.linear if batch_invariant else compact.linear


def linears_for(batch_invariant: bool) -> Linears:
    """`linear_for`'s, for weights that read one input: as one product of their nonzero block when not invariant."""
    return _invariant_linears if batch_invariant else compact.linears


def _dense_linears(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(F.linear(x, w) for w in weights)


def _invariant_linears(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(invariant.linear(x, w) for w in weights)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """RoPE as Llama applies it (rotate-half convention), looked up by absolute position."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The frequencies in float32, as Llama's and Kyutai's are, made where they are used: not a buffer, which a
        model cast to bf16 would round (0.4 %: radians off by the tens at step 3,000). Held as float64, made once a
        device (outside inference mode, so that training may use them too): four ops a round otherwise."""
        if (cached := self._inv_freq.get(device)) is None:
            with torch.inference_mode(False):
                exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
                cached = self._inv_freq[device] = (1.0 / (self.theta**exponent)).double()
        return cached

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Angles in float64, reduced mod 2 pi: exact to float32 at any position (an hour is 270,000 steps, where a
        float32 product would be off by 0.02 rad)."""
        freqs = (positions.double()[..., None] * self.inv_freq(positions.device)).remainder(2 * math.pi).float()
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[..., heads, dim]`, cos/sin `[..., dim]` broadcast over heads."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, linears: Linears = _dense_linears):
        shape = x.shape[:-1]
        q, k, v = linears(x, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        q = apply_rotary(q.view(*shape, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(*shape, self.kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(*shape, self.kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Reference: x `[B, T, H]`, full causal attention (within the sliding window) over itself."""
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, cos, sin))
        steps = x.shape[1]
        pos = torch.arange(steps, device=x.device)
        mask = pos[None, :] <= pos[:, None]
        if self.window is not None:
            mask &= pos[None, :] > pos[:, None] - self.window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))

    def forward_paged(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PagedBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """x `[N, H]`: store this batch's K/V in its slots, then attend over each sequence's pages. With
        `batch_invariant`, `batch` must be in decode form (`PagedBatch.per_query`)."""
        linears = linears_for(batch_invariant)
        q, k, v = self._qkv(x, cos, sin, linears)
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        attend = invariant.paged_attention if batch_invariant else paged_attention
        out = attend(
            q,
            k_cache,
            v_cache,
            batch.page_table,
            batch.cu_seqlens_q,
            batch.seqlens_k,
            causal=True,
            sliding_window=self.window,
        )
        return linears(out.reshape(x.shape[0], -1), self.o_proj.weight)[0]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, linears: Linears = _dense_linears) -> torch.Tensor:
        gate, up = linears(x, self.gate_proj.weight, self.up_proj.weight)
        return linears(F.silu(gate) * up, self.down_proj.weight)[0]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _mlp_block(self, x: torch.Tensor, linears: Linears = _dense_linears) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x), linears)


class Backbone(nn.Module):
    """Llama decoder stack; `state_dict()` keys are LlamaModel's minus `embed_tokens.weight`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """`[B, T, H]` -> hidden `[B, T, H]`, full causal attention, no cache."""
        x = inputs_embeds
        cos, sin = self.rotary.cos_sin(torch.arange(x.shape[1], device=x.device), x.dtype)
        for layer in self.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin)
            x = layer._mlp_block(x)
        return self.norm(x)

    def forward_paged(
        self,
        x: torch.Tensor,
        batch: PagedBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """`[N, H]` new steps of a flattened batch -> hidden `[N, H]`, K/V read and written through pages."""
        if len(k_caches) != len(self.layers) or len(v_caches) != len(self.layers):
            raise ValueError(f"need K and V caches for {len(self.layers)} layers")
        if batch_invariant:
            invariant.check(x)
            batch = batch.per_query()
        cos, sin = self.rotary.cos_sin(batch.rope_positions, x.dtype)
        for layer, k, v in zip(self.layers, k_caches, v_caches, strict=True):
            x = x + layer.self_attn.forward_paged(layer.input_layernorm(x), cos, sin, batch, k, v, batch_invariant)
            x = layer._mlp_block(x, linears_for(batch_invariant))
        return self.norm(x)
