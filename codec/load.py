"""Either codec from a path: `load_tokenizer` tells Mimi's checkpoints (Kyutai's safetensors file, or a folder
transformers' `MimiModel` or `MoshiForConditionalGeneration` saved) from an EnCodec folder, and `Tokenizer` names what
it gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from codec.mimi.tokenizer import MimiTokenizer
from codec.tokenizer import EncodecTokenizer

Tokenizer = EncodecTokenizer | MimiTokenizer

KINDS = "an EnCodec folder, a Mimi safetensors file, or a transformers Mimi or Moshi folder"


def load_tokenizer(
    path: str | Path | None,
    bandwidth: float = 1.5,
    num_codebooks: int = 8,
    config: str | Path | dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> Tokenizer:
    """The codec at `path`: a file is Kyutai's Mimi safetensors (its config `config`, else `NAME.json` beside
    `NAME.safetensors`, else Kyutai's Mimi); a folder is the model its config.json's `model_type` names ("mimi":
    transformers' `MimiModel`; "moshi": the audio encoder of transformers' `MoshiForConditionalGeneration`, a Mimi;
    "encodec"); None is EnCodec's architecture with seeded weights. `bandwidth` (kbps) applies to EnCodec,
    `num_codebooks` and `config` to Mimi."""
    if path is None:
        return EncodecTokenizer.from_pretrained(None, bandwidth=bandwidth, device=device)
    path = Path(path)
    if path.is_file():
        _check_safetensors(path)
        return MimiTokenizer.from_pretrained(path, config, num_codebooks, device)
    if not path.is_dir():
        raise FileNotFoundError(f"no codec at {path}: give {KINDS}")
    kind = _model_type(path)
    if config is not None:
        raise ValueError(f"{path} is a folder, which brings its own config.json: a config is for a Mimi file")
    if kind in ("mimi", "moshi"):
        return MimiTokenizer.from_pretrained(path, num_codebooks=num_codebooks, device=device)
    if kind == "encodec":
        return EncodecTokenizer.from_pretrained(path, bandwidth=bandwidth, device=device)
    raise ValueError(f"{path}/config.json names model_type {kind!r}, not a codec served here: give {KINDS}")


def _check_safetensors(path: Path) -> None:
    try:
        with safe_open(str(path), "pt"):
            pass
    except Exception as e:  # (safetensors' error types differ between its versions)
        raise ValueError(f"{path} is not a safetensors file ({e}): give {KINDS}") from None


def _model_type(folder: Path) -> str | None:
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{folder} holds no config.json: give {KINDS}")
    try:
        return json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{config} is not a JSON object: {e}") from None
