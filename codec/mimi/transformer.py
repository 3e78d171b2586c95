"""Mimi's transformers (one after the encoder, one before the decoder): pre-norm layers (LayerNorm), causal
self-attention over the last `context` steps with interleaved RoPE, a GELU feed-forward, layer scale, and linear
projections in and out when the model width differs from SEANet's. Parameter names follow Kyutai's
`ProjectedTransformer` (`encoder_transformer.transformer.layers.0.self_attn.in_projs.0.weight`, ...).

As a streaming step, each row carries its own position and, per layer, the keys and values of its last
`context - 1` steps: exactly what the offline model's attention window reaches back to, so any chunking gives the
offline result (up to rounding). (Kyutai's own streaming keeps a ring of `context` entries, which a chunk of T steps
overwrites before its first queries have seen the T - 1 oldest: past `context` steps, its chunked output drifts
slightly from its offline one. This one follows the offline model.)"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from codec.mimi.config import MimiConfig
from codec.stream_layers import State

_MAX_STEPS = 256  # steps a call attends over at once: a longer input runs in pieces (bounded attention memory)


class _LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))


class _Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.in_projs = nn.ModuleList([nn.Linear(dim, 3 * dim, bias=False)])
        self.out_projs = nn.ModuleList([nn.Linear(dim, dim, bias=False)])


class _Layer(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = _Attention(d)
        self.norm1 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.norm2 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.linear1 = nn.Linear(d, cfg.dim_feedforward, bias=False)
        self.linear2 = nn.Linear(cfg.dim_feedforward, d, bias=False)
        if cfg.layer_scale is None:
            self.layer_scale_1 = self.layer_scale_2 = None
        else:
            self.layer_scale_1 = _LayerScale(d, cfg.layer_scale)
            self.layer_scale_2 = _LayerScale(d, cfg.layer_scale)


class _Transformer(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(cfg) for _ in range(cfg.num_layers)])


class ProjectedTransformer(nn.Module):
    """Latents `[B, dimension, T]` -> `[B, dimension, T]` (Kyutai's conv layout)."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.cfg = cfg
        self.input_proj = nn.Linear(cfg.dimension, cfg.d_model, bias=False) if cfg.d_model != cfg.dimension else None
        self.transformer = _Transformer(cfg)
        out = nn.Identity() if cfg.d_model == cfg.dimension else nn.Linear(cfg.d_model, cfg.dimension, bias=False)
        self.output_projs = nn.ModuleList([out])

    def step(self) -> TransformerStep:
        return TransformerStep(self)


class TransformerStep:
    """`step(x [B, C, T], state) -> (y [B, C, T], new_state)`, state `(position [B], ((keys, values) per layer))`.

    Each layer's keys (after RoPE) and values of a row's last `context - 1` steps are a ring `[B, heads,
    context - 1, head_dim]`: position p in slot p mod (context - 1). A chunk's queries attend to the ring as it was
    and to the chunk's own steps, then the chunk's steps are written into the ring in place (the state it is given is
    its to change, and it returns the same tensors): no copy of the cache a step. Rows may be at different
    positions; slots a row has not filled yet are masked out."""

    def __init__(self, m: ProjectedTransformer):
        cfg = m.cfg
        self.heads, self.head_dim = cfg.num_heads, cfg.d_model // cfg.num_heads
        self.context, self.window = cfg.context, cfg.context - 1
        self.input_proj = None if m.input_proj is None else m.input_proj.weight
        out = m.output_projs[0]
        self.output_proj = out.weight if isinstance(out, nn.Linear) else None
        self.layers = [
            (
                layer.self_attn.in_projs[0].weight,
                layer.self_attn.out_projs[0].weight,
                layer.norm1,
                layer.norm2,
                layer.linear1.weight,
                layer.linear2.weight,
                None if layer.layer_scale_1 is None else layer.layer_scale_1.scale,
                None if layer.layer_scale_2 is None else layer.layer_scale_2.scale,
            )
            for layer in m.transformer.layers
        ]
        device = m.transformer.layers[0].linear1.weight.device
        half = torch.arange(self.head_dim // 2, device=device, dtype=torch.float32)
        self.freqs = torch.exp(half * (-math.log(cfg.max_period) * 2 / self.head_dim))  # as Kyutai's apply_rope
        self.slots = torch.arange(self.window, device=device)

    def initial_state(self, batch: int, like: torch.Tensor) -> State:
        shape = (batch, self.heads, self.window, self.head_dim)
        caches = tuple((like.new_zeros(shape), like.new_zeros(shape)) for _ in self.layers)
        return torch.zeros(batch, dtype=torch.long, device=like.device), caches

    def __call__(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        if state is None:
            state = self.initial_state(x.shape[0], x)
        h = x.transpose(1, 2)  # [B, T, C]
        if self.input_proj is not None:
            h = F.linear(h, self.input_proj)
        pieces = []
        for start in range(0, h.shape[1], _MAX_STEPS):
            y, state = self._run(h[:, start : start + _MAX_STEPS], state)
            pieces.append(y)
        h = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        if self.output_proj is not None:
            h = F.linear(h, self.output_proj)
        return h.transpose(1, 2), state

    def _run(self, h: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        pos, caches = state
        steps = h.shape[1]
        where = self._where(pos, steps)
        for (w_in, w_out, norm1, norm2, w1, w2, scale1, scale2), cache in zip(self.layers, caches, strict=True):
            a = self._attend(
                F.layer_norm(h, norm1.normalized_shape, norm1.weight, norm1.bias, norm1.eps), w_in, cache, where
            )
            a = F.linear(a, w_out)
            h = h + (a if scale1 is None else scale1 * a)
            f = F.layer_norm(h, norm2.normalized_shape, norm2.weight, norm2.bias, norm2.eps)
            f = F.linear(F.gelu(F.linear(f, w1)), w2)
            h = h + (f if scale2 is None else scale2 * f)
        return h, (pos + steps, caches)

    def _where(self, pos: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a chunk of `steps` at each row's `pos`: the attention mask `[B, 1, T, window + T]` (ring slots, then
        the chunk), RoPE's cos and sin `[B, T, 1, 1, head_dim / 2]`, and the ring slots `[B, n]` the chunk's last
        n = min(T, window) steps go to."""
        t = torch.arange(steps, device=pos.device)
        age = torch.remainder(pos[:, None] - 1 - self.slots, max(self.window, 1))  # steps since the slot's entry
        filled = (pos[:, None] - 1 - age >= 0)[:, None, :]  # [B, 1, window]
        in_reach = (t[:, None] + 1 + age[:, None, :]) < self.context  # [B, T, window]
        causal = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < self.context)  # [T, T]
        mask = torch.cat([filled & in_reach, causal.expand(pos.shape[0], -1, -1)], dim=-1)[:, None]
        angle = self.freqs * (pos.float()[:, None] + t.float())[:, :, None, None, None]  # as Kyutai's apply_rope
        written = min(steps, self.window)
        slots = torch.remainder(pos[:, None] + t[steps - written :], max(self.window, 1))
        return mask, torch.cos(angle), torch.sin(angle), slots

    def _attend(
        self,
        h: torch.Tensor,
        w_in: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        where: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        mask, cos, sin, slots = where
        batch, steps = h.shape[:2]
        qkv = F.linear(h, w_in).view(batch, steps, 3, self.heads, self.head_dim)
        qk = qkv[:, :, :2].unflatten(-1, (self.head_dim // 2, 2))  # RoPE's interleaved (real, imaginary) pairs
        re, im = qk[..., 0], qk[..., 1]
        qk = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)  # [B, T, 2, H, D]
        q, k = qk.permute(2, 0, 3, 1, 4)  # [B, H, T, D] each
        v = qkv[:, :, 2].transpose(1, 2)
        k_ring, v_ring = cache
        scores = torch.cat([q @ k_ring.transpose(-1, -2), q @ k.transpose(-1, -2)], dim=-1) / math.sqrt(self.head_dim)
        weights = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
        out = weights[..., : self.window] @ v_ring + weights[..., self.window :] @ v
        if self.window:
            index = slots[:, None, :, None].expand(-1, self.heads, -1, self.head_dim)
            k_ring.scatter_(2, index, k[:, :, steps - slots.shape[1] :])
            v_ring.scatter_(2, index, v[:, :, steps - slots.shape[1] :])
        return out.transpose(1, 2).reshape(batch, steps, -1)
