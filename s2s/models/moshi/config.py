"""MoshiConfig: the shape of a Moshi-family language model (Kyutai's `LMModel` arguments), and the step layout the
engine serves it in.

Kyutai's model reads, each 80 ms step, a text token, its own `dep_q` audio codebooks and the user's: `1 + n_q` streams
with `delays`. The engine's steps hold K codebooks of two streams (`ModelConfig`): here K = 1 + dep_q, codebook 0 of
the model's stream is its text (the inner monologue) and codebook 0 of the user's is empty (`ModelConfig.text_stream`).
Token ids in the engine's steps: text ids, audio codes, and `pad_id` (past both), which the embedding reads as each
stream's initial token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from s2s.models.config import ModelConfig

# Moshi 7B (`moshi.models.loaders._lm_kwargs`): what a Kyutai folder without a config.json holds
MOSHI_7B = {
    "dim": 4096,
    "text_card": 32000,
    "existing_text_padding_id": 3,
    "n_q": 16,
    "dep_q": 8,
    "card": 2048,
    "num_heads": 32,
    "num_layers": 32,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 3000,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 1024,
    "depformer_dim_feedforward": int(4.125 * 1024),
    "depformer_num_heads": 16,
    "depformer_num_layers": 6,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 8,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}

# what the arguments must be for this implementation, where Kyutai's LMModel takes others
_REQUIRED = {
    "causal": True,
    "gating": "silu",
    "positional_embedding": "rope",
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_multi_linear": True,
    "depformer_weights_per_step": True,
    "norm_emb": False,
    "bias_proj": False,
    "demux_second_text_stream": False,
    "depformer_weights_per_step_schedule": None,
    "depformer_low_rank_embeddings": None,
    "depformer_norm": None,
    "conditioners": None,
    "fuser": None,
    "cross_attention": False,
    "text_card_out": None,
    "extra_heads_num_heads": 0,
    "layer_scale": None,
    "depformer_layer_scale": None,
    "kv_repeat": 1,
    "depformer_kv_repeat": 1,
    "lora": False,
    "demux_second_stream": False,
}
_NORM_EPS = {"rms_norm_f32": 1e-8, "rms_norm": 1e-5}
# what is read, with Kyutai's defaults (`LMModel.__init__`, `StreamingTransformer`)
_DEFAULTS = {
    "existing_text_padding_id": 3,
    "max_period": 10000.0,
    "context": None,
    "depformer_dim_feedforward": None,
    "depformer_num_heads": 8,
    "depformer_num_layers": 6,
    "norm": "rms_norm_f32",
}
_IGNORED = {"depformer_context", "depformer_max_period", "depformer_causal", "lora_rank", "lora_scaling"}


@dataclass
class SamplingDefaults:
    """Kyutai's `LMGen` settings (a checkpoint's `lm_gen_config`): audio and text temperature and top-k."""

    temp: float = 0.8
    temp_text: float = 0.7
    top_k: int = 250
    top_k_text: int = 25


@dataclass
class MoshiConfig:
    dim: int
    num_heads: int
    num_layers: int
    hidden_scale: float
    text_card: int
    card: int
    n_q: int
    dep_q: int
    delays: list[int]
    depformer_dim: int
    depformer_num_heads: int
    depformer_num_layers: int
    depformer_dim_feedforward: int
    existing_text_padding_id: int = 3
    context: int | None = 3000
    max_period: float = 10000.0
    norm_eps: float = 1e-8
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)

    @classmethod
    def from_kyutai(cls, kwargs: dict, lm_gen_config: dict | None = None, where: str = "config") -> MoshiConfig:
        """Kyutai's `LMModel` keyword arguments (`config.json` of a Kyutai folder, less its file names), refused with
        what is wrong where this implementation computes something else."""
        unknown = sorted(set(kwargs) - set(_REQUIRED) - set(_DEFAULTS) - _IGNORED - set(MOSHI_7B) - {"delays"})
        wrong = [
            f"{k}={kwargs[k]!r} (must be {v!r})"
            for k, v in _REQUIRED.items()
            if k in kwargs and kwargs[k] != v and not (v is None and kwargs[k] in ([], {}, 0))
        ]
        norm = kwargs.get("norm", _DEFAULTS["norm"])
        if norm not in _NORM_EPS:
            wrong.append(f"norm={norm!r} (must be one of {sorted(_NORM_EPS)})")
        if kwargs.get("depformer_norm", norm) not in (norm, None):
            wrong.append("the depformer's norm differs from the transformer's")
        missing = [k for k in ("dim", "num_heads", "num_layers", "text_card", "card", "n_q", "dep_q", "delays",
                               "depformer_dim") if k not in kwargs]  # fmt: skip
        if unknown or wrong or missing:
            raise ValueError(
                f"{where}: not a Moshi model this server runs:"
                + (f" unknown arguments {unknown};" if unknown else "")
                + (f" unsupported {wrong};" if wrong else "")
                + (f" missing {missing}" if missing else "")
            )
        dim, dep_dim = int(kwargs["dim"]), int(kwargs["depformer_dim"])
        hidden_scale = float(kwargs.get("hidden_scale", 4))
        dep_ff = kwargs.get("depformer_dim_feedforward") or int(hidden_scale * dep_dim)
        known = SamplingDefaults.__dataclass_fields__
        sampling = SamplingDefaults(**{k: v for k, v in (lm_gen_config or {}).items() if k in known})
        config = cls(
            dim=dim,
            num_heads=int(kwargs["num_heads"]),
            num_layers=int(kwargs["num_layers"]),
            hidden_scale=hidden_scale,
            text_card=int(kwargs["text_card"]),
            card=int(kwargs["card"]),
            n_q=int(kwargs["n_q"]),
            dep_q=int(kwargs["dep_q"]),
            delays=[int(d) for d in kwargs["delays"]],
            depformer_dim=dep_dim,
            depformer_num_heads=int(kwargs.get("depformer_num_heads", _DEFAULTS["depformer_num_heads"])),
            depformer_num_layers=int(kwargs.get("depformer_num_layers", _DEFAULTS["depformer_num_layers"])),
            depformer_dim_feedforward=int(dep_ff[0] if isinstance(dep_ff, list) else dep_ff),
            existing_text_padding_id=int(kwargs.get("existing_text_padding_id", 3)),
            context=kwargs.get("context"),
            max_period=float(kwargs.get("max_period", 10000)),
            norm_eps=_NORM_EPS[norm],
            sampling=sampling,
        )
        config.check(where)
        return config

    def check(self, where: str = "config") -> None:
        problems = []
        if len(self.delays) != 1 + self.n_q:
            problems.append(f"{len(self.delays)} delays for 1 + n_q = {1 + self.n_q} streams")
        if not 0 < self.dep_q <= self.n_q:
            problems.append(f"dep_q {self.dep_q} must be in [1, n_q = {self.n_q}]")
        if self.dim % self.num_heads or self.depformer_dim % self.depformer_num_heads:
            problems.append("dim and depformer_dim must be multiples of their head counts")
        if min(self.delays, default=0) < 0:
            problems.append(f"delays {self.delays} must be >= 0")
        # the engine's steps hold the same audio codebooks, with the same delays, for both streams
        model, user = self.delays[1 : 1 + self.dep_q], self.delays[1 + self.dep_q :]
        if len(user) != self.dep_q:
            problems.append(f"{self.dep_q} generated audio codebooks but {len(user)} of the user's (served: as many)")
        elif model != user:
            problems.append(f"the model's audio delays {model} differ from the user's {user}")
        if problems:
            raise ValueError(f"{where}: bad Moshi configuration: " + "; ".join(problems))

    @property
    def ffn_hidden(self) -> int:
        """The gated feed-forward's width: Kyutai's `make_gating` takes 2/3 of `hidden_scale * dim`."""
        return 2 * int(self.hidden_scale * self.dim) // 3

    @property
    def depformer_ffn_hidden(self) -> int:
        return 2 * self.depformer_dim_feedforward // 3

    def layout(self) -> ModelConfig:
        """The engine's view: the temporal transformer's shape (the K/V pool's) and the step layout."""
        return ModelConfig(
            hidden_size=self.dim,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            head_dim=self.dim // self.num_heads,
            intermediate_size=self.ffn_hidden,
            rope_theta=self.max_period,
            rms_norm_eps=self.norm_eps,
            max_position_embeddings=1 << 24,  # RoPE at any step (two weeks of 80 ms steps); attention: `context`
            sliding_window=self.context,
            num_codebooks=1 + self.dep_q,
            codebook_size=self.card,
            delays=self.delays[: 1 + self.dep_q],
            text_vocab=self.text_card,
        )
