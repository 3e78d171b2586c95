"""Kyutai's `LMModel` state dict -> `MoshiLM`'s: every tensor named, checked for shape, and placed.

What changes on the way: the attention's packed `in_projs.*` become q, k and v, with each head's q and k rows
reordered from Kyutai's interleaved RoPE pairs (dims 2i, 2i + 1) to the rotate-half pairs (i, i + D/2) of `Backbone`;
the gated feed-forward's `linear_in` splits into gate and up; norms' `alpha` `[1, 1, D]` become weights `[D]`; and
the depformer's per-codebook modules stack into `[dep_q, ...]` tensors. A missing, unexpected or misshapen tensor
is an error that names the file and the tensor.
"""

from __future__ import annotations

import torch

from s2s.models.moshi.model import MoshiLM


def _interleaved_to_half(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows `[heads * hd, in]` of q or k: within each head, dims (0, 1, 2, 3, ...) -> (0, 2, ..., 1, 3, ...)."""
    hd = weight.shape[0] // heads
    order = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    return weight.view(heads, hd, -1)[:, order].reshape(weight.shape)


class _Reader:
    """Takes tensors out of a state dict by name, checking each one's shape; `leftover` names what was not taken."""

    def __init__(self, state: dict[str, torch.Tensor], where: str):
        self.state, self.where, self.taken = state, where, set()

    def __call__(self, name: str, shape: tuple[int, ...], *aliases: str) -> torch.Tensor:
        for key in (name, *aliases):
            if key in self.state:
                tensor = self.state[key]
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"{self.where}: tensor {key} has shape {tuple(tensor.shape)}, expected {shape}")
                self.taken.add(key)
                return tensor
        raise ValueError(f"{self.where}: tensor {name} is missing")

    def leftover(self) -> list[str]:
        return sorted(set(self.state) - self.taken)


def load_kyutai_state(model: MoshiLM, state: dict[str, torch.Tensor], where: str) -> None:
    """Fill `model` from Kyutai's `LMModel.state_dict()` keys (`where`: the file, for errors)."""
    cfg, read = model.moshi, _Reader(state, where)
    dim, dep_dim, ff, dep_ff = cfg.dim, cfg.depformer_dim, cfg.ffn_hidden, cfg.depformer_ffn_hidden
    ours: dict[str, torch.Tensor] = {}
    ours["embeddings"] = torch.cat(
        [read("text_emb.weight", (cfg.text_card + 1, dim))]
        + [read(f"emb.{j}.weight", (cfg.card + 1, dim)) for j in range(cfg.n_q)]
    )
    ours["text_head"] = read("text_linear.weight", (cfg.text_card, dim))
    for i in range(cfg.num_layers):
        theirs, mine = f"transformer.layers.{i}.", f"backbone.layers.{i}."
        qkv = read(theirs + "self_attn.in_projs.0.weight", (3 * dim, dim), theirs + "self_attn.in_proj_weight")
        q, k, v = qkv.chunk(3)
        ours[mine + "self_attn.q_proj.weight"] = _interleaved_to_half(q, cfg.num_heads)
        ours[mine + "self_attn.k_proj.weight"] = _interleaved_to_half(k, cfg.num_heads)
        ours[mine + "self_attn.v_proj.weight"] = v
        ours[mine + "self_attn.o_proj.weight"] = read(
            theirs + "self_attn.out_projs.0.weight", (dim, dim), theirs + "self_attn.out_proj.weight"
        )
        ours[mine + "input_layernorm.weight"] = read(theirs + "norm1.alpha", (1, 1, dim)).reshape(dim)
        ours[mine + "post_attention_layernorm.weight"] = read(theirs + "norm2.alpha", (1, 1, dim)).reshape(dim)
        gate, up = read(theirs + "gating.linear_in.weight", (2 * ff, dim)).chunk(2)
        ours[mine + "mlp.gate_proj.weight"], ours[mine + "mlp.up_proj.weight"] = gate, up
        ours[mine + "mlp.down_proj.weight"] = read(theirs + "gating.linear_out.weight", (dim, ff))
    ours["backbone.norm.weight"] = read("out_norm.alpha", (1, 1, dim)).reshape(dim)

    q = cfg.dep_q
    ours["depformer.inputs"] = torch.stack([read(f"depformer_in.{k}.weight", (dep_dim, dim)) for k in range(q)])
    ours["depformer.text_emb"] = read("depformer_text_emb.weight", (cfg.text_card + 1, dep_dim))
    audio = [read(f"depformer_emb.{k}.weight", (cfg.card + 1, dep_dim)) for k in range(q - 1)]
    ours["depformer.audio_emb"] = torch.stack(audio) if audio else torch.empty(0, cfg.card + 1, dep_dim)
    ours["depformer.heads"] = torch.stack([read(f"linears.{k}.weight", (cfg.card, dep_dim)) for k in range(q)])
    for i in range(cfg.depformer_num_layers):
        theirs, mine = f"depformer.layers.{i}.", f"depformer.layers.{i}."

        def per_step(name: str, shape: tuple[int, ...], theirs: str = theirs) -> torch.Tensor:
            return torch.stack([read(theirs + name.format(k=k), shape) for k in range(q)])

        ours[mine + "in_proj"] = per_step("self_attn.in_projs.{k}.weight", (3 * dep_dim, dep_dim))
        ours[mine + "out_proj"] = per_step("self_attn.out_projs.{k}.weight", (dep_dim, dep_dim))
        ours[mine + "gate_in"] = per_step("gating.{k}.linear_in.weight", (2 * dep_ff, dep_dim))
        ours[mine + "gate_out"] = per_step("gating.{k}.linear_out.weight", (dep_dim, dep_ff))
        ours[mine + "norm1.weight"] = read(theirs + "norm1.alpha", (1, 1, dep_dim)).reshape(dep_dim)
        ours[mine + "norm2.weight"] = read(theirs + "norm2.alpha", (1, 1, dep_dim)).reshape(dep_dim)
    if leftover := read.leftover():
        raise ValueError(f"{where}: tensors this Moshi configuration has no place for: {leftover[:8]}")
    own = model.state_dict()
    model.load_state_dict({name: tensor.to(own[name].dtype) for name, tensor in ours.items()})
