"""S2SModel: summed per-codebook embeddings of both streams, a Llama backbone, and K output heads.

The backbone's parameter names and math are transformers' `LlamaModel` (without `embed_tokens`), so a LlamaModel
loads its state dict and a Llama checkpoint can initialise it. Two paths share the weights:
- `Backbone.forward(inputs_embeds)`: full causal attention without a cache (the reference);
- `Backbone.forward_paged(x, batch, k_caches, v_caches)`: a flattened batch of sequences that decode or extend on top
  of K/V held in pages (`s2s.batch.PagedBatch`), through `kernels.store_kv` and `kernels.paged_attention`.
  With `batch_invariant=True` the matmuls and attention go through `kernels.batch_invariant`: each step's K/V and
  hidden state are then the same bits whatever batch, chunk or position in the batch it was computed in.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kernels import batch_invariant as invariant
from kernels import paged_attention, store_kv
from s2s.batch import PagedBatch
from s2s.config import ModelConfig

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weight) -> x @ weight.T


def _linear(batch_invariant: bool) -> Linear:
    return invariant.linear if batch_invariant else F.linear


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
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
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

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, linear: Linear = F.linear):
        shape = x.shape[:-1]
        q = apply_rotary(linear(x, self.q_proj.weight).view(*shape, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(linear(x, self.k_proj.weight).view(*shape, self.kv_heads, self.head_dim), cos, sin)
        v = linear(x, self.v_proj.weight).view(*shape, self.kv_heads, self.head_dim)
        return q, k, v

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
        linear = _linear(batch_invariant)
        q, k, v = self._qkv(x, cos, sin, linear)
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
        return linear(out.reshape(x.shape[0], -1), self.o_proj.weight)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, linear: Linear = F.linear) -> torch.Tensor:
        hidden = F.silu(linear(x, self.gate_proj.weight)) * linear(x, self.up_proj.weight)
        return linear(hidden, self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _mlp_block(self, x: torch.Tensor, linear: Linear = F.linear) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x), linear)


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
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        for layer, k, v in zip(self.layers, k_caches, v_caches, strict=True):
            x = x + layer.self_attn.forward_paged(layer.input_layernorm(x), cos, sin, batch, k, v, batch_invariant)
            x = layer._mlp_block(x, _linear(batch_invariant))
        return self.norm(x)


@dataclass
class StepOutput:
    logits: torch.Tensor  # [S, K, vocab] for each sequence's last new step: the model stream's next step


class S2SModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # one table per (stream, codebook): user codebooks first, then the model's; looked up as one flat table
        self.embeddings = nn.Parameter(torch.empty(cfg.step_width, cfg.vocab_size, cfg.hidden_size))
        self.backbone = Backbone(cfg)
        self.heads = nn.Parameter(torch.empty(cfg.num_codebooks, cfg.vocab_size, cfg.hidden_size))
        offsets = torch.arange(cfg.step_width) * cfg.vocab_size
        self.register_buffer("_offsets", offsets, persistent=False)

    @classmethod
    def from_seed(cls, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu") -> S2SModel:
        """Random weights from `seed` (Llama's init: normal(0, 0.02), norms at one): every path works offline."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(cfg)
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    nn.init.ones_(p)
                else:
                    nn.init.normal_(p, std=0.02)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Step tokens `[..., 2K]` -> the sum of their 2K embeddings `[..., H]`."""
        cfg = self.config
        if tokens.shape[-1] != cfg.step_width:
            raise ValueError(f"step tokens must have {cfg.step_width} codes, got {tokens.shape[-1]}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
            raise ValueError(f"step tokens must lie in [0, {cfg.vocab_size})")
        return self.embed_checked(tokens)

    def embed_checked(self, tokens: torch.Tensor) -> torch.Tensor:
        """`embed` for ids the caller has already range-checked: no check on the device, so no host sync (what a
        CUDA graph can hold; `DecodeGraphs` checks on the host before copying ids in)."""
        cfg = self.config
        flat = (tokens.long() + self._offsets).reshape(-1, cfg.step_width)
        out = F.embedding_bag(flat, self.embeddings.view(-1, cfg.hidden_size), mode="sum")
        return out.view(*tokens.shape[:-1], cfg.hidden_size)

    def logits(self, hidden: torch.Tensor, linear: Linear = F.linear) -> torch.Tensor:
        """Hidden `[..., H]` -> `[..., K, vocab]`."""
        flat = linear(hidden, self.heads.view(-1, self.config.hidden_size))
        return flat.view(*hidden.shape[:-1], *self.heads.shape[:2])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Reference, no cache: step tokens `[B, T, 2K]` -> logits `[B, T, K, vocab]` for each next step."""
        return self.logits(self.backbone(self.embed(tokens)))

    def forward_paged(
        self,
        tokens: torch.Tensor,
        batch: PagedBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        batch_invariant: bool = False,
    ) -> StepOutput:
        """Flattened step tokens `[N, 2K]` of a PagedBatch -> next-step logits of each sequence.

        `batch_invariant=True` (CPU, fp32): the K/V each step stores and the logits of each sequence's last step
        are bitwise the same whatever else is in the batch, the step's position in it, and the chunks its sequence
        was computed in (one step at a time, one chunk, several), at a fixed thread count. Slower; see
        `kernels/batch_invariant.py`.
        """
        if tokens.shape[0] != batch.positions.shape[0]:
            raise ValueError(f"{tokens.shape[0]} tokens for a batch of {batch.positions.shape[0]}")
        hidden = self.backbone.forward_paged(self.embed(tokens), batch, k_caches, v_caches, batch_invariant)
        last = hidden[batch.cu_seqlens_q[1:].long() - 1]
        return StepOutput(self.logits(last, _linear(batch_invariant)))

    # ---- weights on disk ---------------------------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.config.save(folder)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(folder / "model.safetensors"))

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path | None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        config: ModelConfig | None = None,
    ) -> S2SModel:
        """Load `config.json` + `model.safetensors`; with `folder=None`, seeded weights for `config` (or `small`)."""
        if folder is None:
            return cls.from_seed(config or ModelConfig.preset("small"), seed, dtype, device)
        cfg = ModelConfig.load(folder)
        model = cls(cfg)
        path = Path(folder) / "model.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} holds no model.safetensors")
        _load_checked(model, load_file(str(path)), str(path))
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def load_backbone(self, folder: str | Path) -> None:
        """Initialise the backbone from a Hugging Face Llama folder (LlamaModel or LlamaForCausalLM, safetensors)."""
        folder = Path(folder)
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{folder} holds no config.json")
        theirs = json.loads(cfg_path.read_text())
        theirs.setdefault("num_key_value_heads", theirs.get("num_attention_heads"))
        if not theirs.get("head_dim"):
            theirs["head_dim"] = theirs.get("hidden_size", 0) // max(1, theirs.get("num_attention_heads") or 1)
        ours = self.config
        fields = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
        )
        wrong = [
            f"{f}: checkpoint {theirs.get(f)} vs model {getattr(ours, f)}"
            for f in fields
            if theirs.get(f) != getattr(ours, f)
        ]
        if wrong:
            raise ValueError(f"Llama checkpoint in {folder} does not fit this model: " + "; ".join(wrong))
        state = {}
        for file in _safetensors_files(folder):
            for key, value in load_file(str(file)).items():
                key = key.removeprefix("model.")
                if key.startswith(("layers.", "norm.")):
                    state[key] = value
        _load_checked(self.backbone, state, str(folder))
        # the checkpoint's RoPE base and norm epsilon come with its weights
        rope = theirs.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or theirs.get("rope_scaling"):
            raise ValueError(f"Llama checkpoint in {folder} uses RoPE scaling, which this model does not implement")
        self.config.rope_theta = float(rope.get("rope_theta", theirs.get("rope_theta", self.config.rope_theta)))
        self.config.rms_norm_eps = float(theirs.get("rms_norm_eps", self.config.rms_norm_eps))
        for m in self.backbone.modules():
            if isinstance(m, RMSNorm):
                m.eps = self.config.rms_norm_eps
        self.backbone.rotary = Rotary(self.config.head_dim, self.config.rope_theta).to(self.embeddings.device)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{folder} holds no model.safetensors (only safetensors checkpoints are read)")


def _load_checked(module: nn.Module, state: dict, where: str) -> None:
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"checkpoint {where} does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}, shapes {shapes[:5]}"
        )
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
