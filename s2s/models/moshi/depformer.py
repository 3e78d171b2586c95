"""Depformer: Moshi's small transformer across a step's codebooks, batched across every conversation of a round.

Within one 80 ms step it reads the temporal transformer's output and the step's tokens one after another (the text
token, then each audio codebook) and predicts the next codebook; codebook k has its own input projection, attention
and feed-forward weights (Kyutai's `weights_per_step`), stacked here as `[dep_q, ...]` tensors, and no positional
embedding. Its K/V lives for one step: `[layers, rows, dep_q, heads, head_dim]` buffers filled codebook by codebook.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from s2s.models.backbone import RMSNorm
from s2s.models.moshi.config import MoshiConfig


def _per_step(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[N, k, in]` through each codebook's own weight `[k, out, in]` -> `[N, k, out]`."""
    return torch.einsum("nki,koi->nko", x, weight)


class DepformerLayer(nn.Module):
    def __init__(self, cfg: MoshiConfig):
        super().__init__()
        d, f, q = cfg.depformer_dim, cfg.depformer_ffn_hidden, cfg.dep_q
        self.heads = cfg.depformer_num_heads
        self.in_proj = nn.Parameter(torch.empty(q, 3 * d, d))
        self.out_proj = nn.Parameter(torch.empty(q, d, d))
        self.gate_in = nn.Parameter(torch.empty(q, 2 * f, d))
        self.gate_out = nn.Parameter(torch.empty(q, d, f))
        self.norm1 = RMSNorm(d, cfg.norm_eps)
        self.norm2 = RMSNorm(d, cfg.norm_eps)

    def _ffn(self, x: torch.Tensor, gate_in: torch.Tensor, gate_out: torch.Tensor, project) -> torch.Tensor:
        hidden = project(self.norm2(x), gate_in)
        gate, up = hidden.unflatten(-1, (2, -1)).unbind(-2)
        return x + project(F.silu(gate) * up, gate_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every codebook at once (teacher forcing): x `[N, dep_q, D]`, causal across the codebooks."""
        n, q, d = x.shape
        qkv = _per_step(self.norm1(x), self.in_proj).view(n, q, 3, self.heads, d // self.heads)
        queries, keys, values = (t.transpose(1, 2) for t in qkv.unbind(2))
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        x = x + _per_step(out.transpose(1, 2).reshape(n, q, d), self.out_proj)
        return self._ffn(x, self.gate_in, self.gate_out, _per_step)

    def step(self, x: torch.Tensor, k: int, cache: torch.Tensor) -> torch.Tensor:
        """Codebook k of every row: x `[N, D]`; `cache` `[2, N, dep_q, heads, head_dim]` holds codebooks 0..k-1's
        K/V and gets codebook k's."""
        n, d = x.shape
        q, key, value = F.linear(self.norm1(x), self.in_proj[k]).view(n, 3, self.heads, d // self.heads).unbind(1)
        cache[0, :, k], cache[1, :, k] = key, value
        keys, values = cache[0, :, : k + 1], cache[1, :, : k + 1]  # [N, k + 1, heads, hd]
        scores = torch.einsum("nhd,nkhd->nhk", q, keys) * (d // self.heads) ** -0.5
        out = torch.einsum("nhk,nkhd->nhd", scores.softmax(-1), values).reshape(n, d)
        x = x + F.linear(out, self.out_proj[k])
        return self._ffn(x, self.gate_in[k], self.gate_out[k], F.linear)


class Depformer(nn.Module):
    def __init__(self, cfg: MoshiConfig):
        super().__init__()
        self.config = cfg
        q, d = cfg.dep_q, cfg.depformer_dim
        self.inputs = nn.Parameter(torch.empty(q, d, cfg.dim))  # Kyutai's depformer_in, one per codebook
        self.text_emb = nn.Parameter(torch.empty(cfg.text_card + 1, d))
        self.audio_emb = nn.Parameter(torch.empty(max(q - 1, 0), cfg.card + 1, d))  # codebook k's input: k - 1
        self.layers = nn.ModuleList(DepformerLayer(cfg) for _ in range(cfg.depformer_num_layers))
        self.heads = nn.Parameter(torch.empty(q, cfg.card, d))  # Kyutai's linears

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: the temporal output `[N, dim]` and each row's step tokens `[N, dep_q]` (the text, then
        audio codebooks 0..dep_q-2: what each codebook reads) -> logits `[N, dep_q, card]`."""
        q = self.config.dep_q
        embedded = [self.text_emb[tokens[:, 0]]] + [self.audio_emb[k - 1][tokens[:, k]] for k in range(1, q)]
        x = _per_step(hidden[:, None, :].expand(-1, q, -1), self.inputs) + torch.stack(embedded, 1)
        for layer in self.layers:
            x = layer(x)
        return _per_step(x, self.heads)

    def step(self, hidden: torch.Tensor, k: int, previous: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        """Codebook k's logits `[N, card]` from the temporal output `[N, dim]` and the token before it `[N]` (the text
        token for k = 0); `cache`: one `[2, N, dep_q, heads, head_dim]` buffer per layer (`new_cache`)."""
        table = self.text_emb if k == 0 else self.audio_emb[k - 1]
        x = F.linear(hidden, self.inputs[k]) + table[previous]
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer.step(x, k, layer_cache)
        return F.linear(x, self.heads[k])

    def new_cache(self, rows: int) -> list[torch.Tensor]:
        cfg, param = self.config, self.inputs
        shape = (2, rows, cfg.dep_q, cfg.depformer_num_heads, cfg.depformer_dim // cfg.depformer_num_heads)
        return [torch.empty(shape, dtype=param.dtype, device=param.device) for _ in self.layers]
