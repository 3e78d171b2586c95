"""Mimi's architecture as one flat record, read from Kyutai's config dict (`moshi.models.loaders._mimi_config`, the
defaults here) or from a transformers `MimiConfig` (config.json); a field either reference sets that this code does
not implement is a ValueError, not silently ignored."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Fields that must hold the one value implemented here (Mimi's), as {name: (value, the reference's default)}.
_SEANET_FIXED = {
    "causal": (True, False),
    "activation": ("ELU", "ELU"),
    "norm": ("none", "none"),
    "final_activation": (None, None),
    "trim_right_ratio": (1.0, 1.0),
}
_TRANSFORMER_FIXED = {
    "causal": (True, False),
    "conv_layout": (True, False),
    "gating": ("none", "none"),
    "norm": ("layer_norm", "layer_norm"),
    "positional_embedding": ("rope", "sin"),
    "kv_repeat": (1, 1),
    "weights_per_step": (0, 0),
    "cross_attention": (False, False),
    "skip_self_attn": (False, False),
    "quantize": (False, False),
}
_HF_FIXED = {
    "use_causal_conv": (True, True),
    "trim_right_ratio": (1.0, 1.0),
    "hidden_act": ("gelu", "gelu"),
    "attention_bias": (False, False),
}
# Fields that change nothing here (training only, or unused by Mimi's choices), or that must equal another one.
_IGNORED = {
    "seanet": ("disable_norm_outer_blocks", "norm_params", "channels", "activation_params"),
    "quantizer": (
        "input_dimension",
        "output_dimension",
        "q_dropout",
        "no_quantization_rate",
        "decay",
        "threshold_usage_ratio",
        "replaced_usage_ratio",
    ),
    "transformer": ("input_dimension", "output_dimensions", "checkpointing", "betas", "positional_scale"),
}


@dataclass(frozen=True)
class MimiConfig:
    sample_rate: int = 24000
    channels: int = 1
    frame_rate: float = 12.5
    # SEANet encoder and decoder
    dimension: int = 512
    n_filters: int = 64
    ratios: tuple[int, ...] = (8, 6, 5, 4)  # the decoder's order; the encoder runs them reversed
    n_residual_layers: int = 1
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_base: int = 2
    compress: int = 2
    true_skip: bool = True
    pad_mode: str = "constant"
    elu_alpha: float = 1.0
    # split residual vector quantizer
    codebook_dim: int = 256
    n_q: int = 32
    n_q_semantic: int = 1
    bins: int = 2048
    # the transformers after the encoder and before the decoder
    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 8
    dim_feedforward: int = 2048
    context: int = 250
    max_period: float = 10000.0
    layer_scale: float | None = 0.01
    norm_eps: float = 1e-5
    upsample_groups: int | None = None  # None: channel-wise (Kyutai's `upsample_channel_wise_bug`)

    def __post_init__(self) -> None:
        problems = []
        if self.channels != 1:
            problems.append(f"channels {self.channels} (mono only)")
        if self.pad_mode not in ("constant", "replicate"):
            problems.append(f"pad_mode {self.pad_mode!r}")
        if self.sample_rate % self.hop_length:
            problems.append(f"sample_rate {self.sample_rate} not a multiple of the hop {self.hop_length}")
        stride = self.encoder_frame_rate / self.frame_rate
        if stride != int(stride) or stride < 1:
            problems.append(f"frame_rate {self.frame_rate}: not the encoder's {self.encoder_frame_rate} / an integer")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            problems.append(f"d_model {self.d_model} for {self.num_heads} heads (RoPE needs an even head size)")
        if not 1 <= self.n_q_semantic < self.n_q:
            problems.append(f"n_q {self.n_q} with {self.n_q_semantic} semantic")
        if self.context < 1:
            problems.append(f"context {self.context}")
        if problems:
            raise ValueError(f"unsupported Mimi configuration: {'; '.join(problems)}")

    @property
    def hop_length(self) -> int:
        return math.prod(self.ratios)

    @property
    def encoder_frame_rate(self) -> float:
        return self.sample_rate / self.hop_length

    @property
    def downsample_stride(self) -> int:
        """The learnt resampling's factor between the transformers' rate and the codes' (1: no resampling)."""
        return int(self.encoder_frame_rate / self.frame_rate)

    @property
    def frame_size(self) -> int:
        return self.hop_length * self.downsample_stride

    # ---- Kyutai's config dict ------------------------------------------------------------------------------------

    @classmethod
    def from_kyutai(cls, cfg: dict[str, Any] | None = None) -> MimiConfig:
        """From Kyutai's Mimi config dict (as `get_mimi` takes it); None: Kyutai's defaults."""
        if cfg is None:
            return cls()
        try:
            seanet, quant, tr = dict(cfg["seanet"]), dict(cfg["quantizer"]), dict(cfg["transformer"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"a Kyutai Mimi config needs 'seanet', 'quantizer' and 'transformer' dicts: {e}") from e
        bad = _check_fixed("seanet", seanet, _SEANET_FIXED) + _check_fixed("transformer", tr, _TRANSFORMER_FIXED)
        dim = seanet.get("dimension", 128)
        if quant.get("input_dimension", dim) != dim or quant.get("output_dimension", dim) != dim:
            bad.append("quantizer input/output_dimension differ from seanet dimension")
        if tr.get("input_dimension", tr.get("d_model")) != dim or list(tr.get("output_dimensions", [dim])) != [dim]:
            bad.append("transformer input_dimension/output_dimensions differ from seanet dimension")
        if seanet.get("channels", 1) != cfg.get("channels", 1):
            bad.append("seanet channels differ from channels")
        unknown = sorted(set(cfg) - {"sample_rate", "channels", "frame_rate", "seanet", "quantizer", "transformer"})
        if unknown:
            bad.append(f"unknown fields {unknown}")
        if bad:
            raise ValueError(f"unsupported Mimi configuration: {'; '.join(bad)}")
        alpha = float(seanet.get("activation_params", {}).get("alpha", 1.0))
        fields = {
            "sample_rate": cfg.get("sample_rate", 24000),
            "channels": cfg.get("channels", 1),
            "frame_rate": cfg.get("frame_rate", 12.5),
            "elu_alpha": alpha,
            **_take(
                seanet,
                "seanet",
                dimension=("dimension", 128),
                n_filters=("n_filters", 32),
                ratios=("ratios", [8, 5, 4, 2]),
                n_residual_layers=("n_residual_layers", 3),
                kernel_size=("kernel_size", 7),
                last_kernel_size=("last_kernel_size", 7),
                residual_kernel_size=("residual_kernel_size", 3),
                dilation_base=("dilation_base", 2),
                compress=("compress", 2),
                true_skip=("true_skip", True),
                pad_mode=("pad_mode", "reflect"),
            ),
            **_take(
                quant,
                "quantizer",
                codebook_dim=("dimension", 128),
                n_q=("n_q", 8),
                n_q_semantic=("n_q_semantic", 1),
                bins=("bins", 1024),
            ),
            **_take(
                tr,
                "transformer",
                d_model=("d_model", None),
                num_heads=("num_heads", None),
                num_layers=("num_layers", None),
                dim_feedforward=("dim_feedforward", 2048),
                context=("context", None),
                max_period=("max_period", 10000.0),
                layer_scale=("layer_scale", None),
            ),
        }
        fields["ratios"] = tuple(fields["ratios"])
        missing = [k for k in ("d_model", "num_heads", "num_layers", "context") if fields[k] is None]
        if missing:
            raise ValueError(f"Kyutai Mimi config's transformer lacks {missing}")
        return cls(**fields)

    def to_kyutai(self) -> dict[str, Any]:
        """Kyutai's config dict for this architecture (for `moshi.models.loaders.get_mimi`)."""
        return {
            "sample_rate": self.sample_rate,
            "channels": self.channels,
            "frame_rate": self.frame_rate,
            "seanet": {
                "channels": self.channels,
                "dimension": self.dimension,
                "causal": True,
                "n_filters": self.n_filters,
                "n_residual_layers": self.n_residual_layers,
                "activation": "ELU",
                "activation_params": {"alpha": self.elu_alpha},
                "compress": self.compress,
                "dilation_base": self.dilation_base,
                "disable_norm_outer_blocks": 0,
                "kernel_size": self.kernel_size,
                "residual_kernel_size": self.residual_kernel_size,
                "last_kernel_size": self.last_kernel_size,
                "norm": "none",
                "pad_mode": self.pad_mode,
                "ratios": list(self.ratios),
                "true_skip": self.true_skip,
            },
            "quantizer": {
                "dimension": self.codebook_dim,
                "n_q": self.n_q,
                "n_q_semantic": self.n_q_semantic,
                "bins": self.bins,
                "input_dimension": self.dimension,
                "output_dimension": self.dimension,
            },
            "transformer": {
                "d_model": self.d_model,
                "num_heads": self.num_heads,
                "num_layers": self.num_layers,
                "causal": True,
                "layer_scale": self.layer_scale,
                "context": self.context,
                "conv_layout": True,
                "max_period": self.max_period,
                "gating": "none",
                "norm": "layer_norm",
                "positional_embedding": "rope",
                "dim_feedforward": self.dim_feedforward,
                "input_dimension": self.dimension,
                "output_dimensions": [self.dimension],
            },
        }

    # ---- transformers' config.json -------------------------------------------------------------------------------

    @classmethod
    def from_transformers(cls, cfg: dict[str, Any]) -> MimiConfig:
        """From a transformers `MimiConfig`'s config.json (model_type "mimi")."""
        if cfg.get("model_type") != "mimi":
            raise ValueError(f"config.json has model_type {cfg.get('model_type')!r}, not 'mimi'")
        bad = _check_fixed("config.json", cfg, _HF_FIXED)
        hidden, heads = cfg.get("hidden_size", 512), cfg.get("num_attention_heads", 8)
        if cfg.get("num_key_value_heads", heads) != heads:
            bad.append("num_key_value_heads differs from num_attention_heads")
        if cfg.get("head_dim") not in (None, hidden // heads):
            bad.append(f"head_dim {cfg.get('head_dim')} is not hidden_size / num_attention_heads")
        hidden_vq = cfg.get("vector_quantization_hidden_dimension", 256)
        if cfg.get("codebook_dim", hidden_vq) != hidden_vq:
            bad.append("codebook_dim differs from vector_quantization_hidden_dimension")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            bad.append(f"rope_type {rope.get('rope_type')!r}")
        if bad:
            raise ValueError(f"unsupported Mimi configuration: {'; '.join(bad)}")
        ratios = tuple(cfg.get("upsampling_ratios") or (8, 6, 5, 4))
        rate = cfg.get("sampling_rate", 24000)
        # transformers' frame rate: a legacy `frame_rate` field, else the SEANet hop times the stride-2 resampling
        frame_rate = cfg.get("frame_rate") or cfg.get("_frame_rate") or rate / (math.prod(ratios) * 2)
        return cls(
            sample_rate=rate,
            channels=cfg.get("audio_channels", 1),
            frame_rate=frame_rate,
            dimension=hidden,
            n_filters=cfg.get("num_filters", 64),
            ratios=ratios,
            n_residual_layers=cfg.get("num_residual_layers", 1),
            kernel_size=cfg.get("kernel_size", 7),
            last_kernel_size=cfg.get("last_kernel_size", 3),
            residual_kernel_size=cfg.get("residual_kernel_size", 3),
            dilation_base=cfg.get("dilation_growth_rate", 2),
            compress=cfg.get("compress", 2),
            true_skip=not cfg.get("use_conv_shortcut", False),
            pad_mode=cfg.get("pad_mode", "constant"),
            codebook_dim=hidden_vq,
            n_q=cfg.get("num_quantizers", 32),
            n_q_semantic=cfg.get("num_semantic_quantizers", 1),
            bins=cfg.get("codebook_size", 2048),
            d_model=hidden,
            num_heads=heads,
            num_layers=cfg.get("num_hidden_layers", 8),
            dim_feedforward=cfg.get("intermediate_size", 2048),
            context=cfg.get("sliding_window", 250),
            max_period=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            layer_scale=cfg.get("layer_scale_initial_scale", 0.01),
            norm_eps=cfg.get("norm_eps", 1e-5),
            upsample_groups=cfg.get("upsample_groups", 512),
        )


def _check_fixed(where: str, cfg: dict[str, Any], fixed: dict[str, tuple[Any, Any]]) -> list[str]:
    """Pop each fixed field of `cfg`; say which hold another value (a missing one holds the reference's default)."""
    return [
        f"{where} {k}={got!r} (only {want!r})"
        for k, (want, default) in fixed.items()
        if (got := cfg.pop(k, default)) != want
    ]


def _take(cfg: dict[str, Any], where: str, **names: tuple[str, Any]) -> dict[str, Any]:
    """`{field: cfg.get(key, default)}` for each `field=(key, default)`; a key of `cfg` neither named nor ignored
    (`_IGNORED`) is an error."""
    unknown = set(cfg) - {key for key, _ in names.values()} - set(_IGNORED[where])
    if unknown:
        raise ValueError(f"unknown fields in the Kyutai Mimi config's {where}: {sorted(unknown)}")
    return {f: cfg.get(key, default) for f, (key, default) in names.items()}
