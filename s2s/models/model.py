"""S2SModel: summed per-codebook embeddings of both streams, a Llama backbone (`s2s/models/backbone.py`), and K output
heads; its weights saved, loaded and checked (`save_pretrained`, `from_pretrained`, `load_backbone`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from s2s.models.backbone import Backbone, Linear, RMSNorm, Rotary, linear_for
from s2s.models.config import ModelConfig
from s2s.models.paged_step import PagedStep
from s2s.runner.sampling import RandomStream, SamplingParams, sample

if TYPE_CHECKING:
    from s2s.runner.sampling_graphs import SamplingGraphs  # (imports the runner, which imports this)


class S2SModel(PagedStep, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.text_pieces = None  # (no text stream: the model interface's)
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

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Step tokens `[..., 2K]` -> the sum of their 2K embeddings `[..., H]` (`positions`: as `embed_checked`)."""
        cfg = self.config
        if tokens.shape[-1] != cfg.step_width:
            raise ValueError(f"step tokens must have {cfg.step_width} codes, got {tokens.shape[-1]}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
            raise ValueError(f"step tokens must lie in [0, {cfg.vocab_size})")
        return self.embed_checked(tokens)

    def embed_checked(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`embed` for ids the caller has already range-checked: no check on the device, so no host sync (what a
        CUDA graph can hold; `DecodeGraphs` checks on the host before copying ids in). A step's embedding does not
        depend on its position here (`positions`: the model interface's, which Moshi's reads)."""
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

    def step_state(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """The last hidden states `[S, H]` -> what `head` samples from: the logits `[S, K, vocab]`."""
        return self.logits(hidden, linear_for(batch_invariant))

    def head(self, state: torch.Tensor, params: list[SamplingParams], streams: list[RandomStream]) -> torch.Tensor:
        """The next step's codes `[S, K]`: each codebook sampled from its logits, never the delay padding."""
        return sample(state, params, streams, self.config.pad_id)

    def head_graphs(self, max_batch: int, device: torch.device) -> SamplingGraphs:
        """`head` as CUDA graphs per batch bucket."""
        from s2s.runner.sampling_graphs import SamplingGraphs

        cfg = self.config
        return SamplingGraphs(max_batch, cfg.num_codebooks, cfg.vocab_size, cfg.pad_id, device)

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
        self.backbone.rotary = Rotary(self.config.head_dim, self.config.rope_theta)


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
