"""ModelConfig: the S2S model's shape, read from and written to `config.json`.

Backbone fields carry `transformers.LlamaConfig`'s names, so `to_llama_config()` builds the matching LlamaModel.
Token ids per codebook: codes `0 .. codebook_size - 1`, then three reserved ids: `pad_id` (before a stream starts,
the delay padding), `silent_id` (the stream is silent) and `end_id` (the model ends its reply, turn mode).
With a `text_vocab`, codebook 0 of the model's stream is text (Moshi's inner monologue: tokenizer ids below
`text_vocab`) and codebook 0 of the user's is empty (`pad_id`); the codec's codebooks are 1 .. K - 1
(`audio_codebooks`), and the reserved ids come after both vocabularies.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import LlamaConfig

_PRESETS = {
    # name: hidden, layers, heads, kv heads, head dim, intermediate
    "tiny": (64, 2, 4, 2, 16, 128),
    "small": (256, 4, 4, 2, 64, 768),
    "base": (768, 12, 12, 4, 64, 2048),
    "large": (2048, 16, 16, 8, 128, 5632),
}


@dataclass
class ModelConfig:
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    sliding_window: int | None = None
    num_codebooks: int = 2
    codebook_size: int = 1024
    delays: list[int] = field(default_factory=list)
    text_vocab: int = 0

    def __post_init__(self) -> None:
        if not self.delays:
            self.delays = list(range(self.num_codebooks))
        problems = []
        if len(self.delays) != self.num_codebooks or min(self.delays) < 0:
            problems.append(f"delays {self.delays} must be {self.num_codebooks} non-negative ints")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append("sliding_window must be >= 1 or None")
        if min(self.hidden_size, self.num_hidden_layers, self.head_dim, self.intermediate_size, self.num_codebooks) < 1:
            problems.append("sizes must be positive")
        if problems:
            raise ValueError("bad ModelConfig: " + "; ".join(problems))

    @property
    def text_stream(self) -> bool:
        return self.text_vocab > 0

    @property
    def pad_id(self) -> int:
        return max(self.codebook_size, self.text_vocab)

    @property
    def silent_id(self) -> int:
        return self.pad_id + 1

    @property
    def end_id(self) -> int:
        return self.pad_id + 2

    @property
    def vocab_size(self) -> int:
        return self.pad_id + 3

    @property
    def audio_codebooks(self) -> int:
        """The codec's codebooks in a frame: all K, or K - 1 after the text."""
        return self.num_codebooks - self.text_stream

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def step_width(self) -> int:
        """Codes in one step token: every codebook of the user stream, then of the model stream."""
        return 2 * self.num_codebooks

    def checked_codes(self, codes: np.ndarray | torch.Tensor, what: str) -> np.ndarray:
        """The codec's `codes` `[audio_codebooks, n >= 1]`, every id a real code, as a stream's frames `[K, n]` (an
        empty text slot first, with a text stream); or a ValueError saying what is wrong."""
        codes = np.asarray(torch.as_tensor(codes).cpu(), dtype=np.int64)
        if codes.ndim != 2 or codes.shape[0] != self.audio_codebooks or codes.shape[1] == 0:
            raise ValueError(f"{what} must be [K={self.audio_codebooks}, n >= 1], got {codes.shape}")
        if codes.min() < 0 or codes.max() >= self.codebook_size:
            raise ValueError(f"{what} must lie in [0, {self.codebook_size})")
        return self.as_frames(codes)

    def as_frames(self, codes: np.ndarray) -> np.ndarray:
        """The codec's codes `[audio_codebooks, n]` as a stream's frames `[K, n]`: behind an empty text slot
        (`pad_id`) with a text stream, else as they are."""
        if not self.text_stream:
            return codes
        return np.concatenate([np.full((1, codes.shape[1]), self.pad_id, dtype=codes.dtype), codes])

    @classmethod
    def preset(cls, name: str, num_codebooks: int = 2, **overrides) -> ModelConfig:
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(_PRESETS)}")
        h, n, heads, kv, d, inter = _PRESETS[name]
        fields = dict(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=d,
            intermediate_size=inter,
            num_codebooks=num_codebooks,
        )
        return cls(**{**fields, **overrides})

    def to_llama_config(self) -> LlamaConfig:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
        )

    def save(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} holds no config.json")
        data = json.loads(path.read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown ModelConfig fields {unknown}")
        return cls(**data)
