"""A Moshi-family checkpoint folder, in Kyutai's layout or transformers': its LM, its Mimi and its text tokenizer.

Kyutai's layout is what `moshi.models.loaders.CheckpointInfo` reads: `config.json` with the LM's arguments and the
file names (`moshi_name`, `mimi_name`, `mimi_config_name`, `tokenizer_name`, `lm_gen_config`); without a
`config.json`, Moshi 7B's arguments and Kyutai's default file names (`kyutai/moshiko-pytorch-bf16`). transformers'
layout is `MoshiForConditionalGeneration.save_pretrained` (`transformers_layout.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from s2s.models.moshi.config import MOSHI_7B, MoshiConfig
from s2s.models.moshi.model import MoshiLM
from s2s.models.moshi.text import TextPieces
from s2s.models.moshi.weights import load_kyutai_state

MOSHI_NAME = "model.safetensors"  # Kyutai's default names (`moshi.models.loaders`)
MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_NAME = "tokenizer_spm_32k_3.model"
_FILE_KEYS = {"moshi_name", "mimi_name", "mimi_config_name", "tokenizer_name", "lm_gen_config", "model_type"}
_UNUSED_KEYS = {"lora_name", "tts_config", "stt_config", "model_id"}


@dataclass
class MoshiFolder:
    folder: Path
    config: MoshiConfig
    weights: Path  # the LM's safetensors
    tokenizer: Path  # sentencepiece
    mimi: Path | None  # Mimi's weights: a safetensors file (Kyutai) or a MimiModel folder (transformers)
    mimi_config: Path | None = None
    state: dict[str, torch.Tensor] | None = field(default=None, repr=False)  # Kyutai-layout LM state, if converted


def is_kyutai_folder(folder: Path) -> bool:
    config = folder / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        return "dep_q" in data or "moshi_name" in data
    return (folder / MOSHI_NAME).is_file() and (folder / TOKENIZER_NAME).is_file()


def read_kyutai_folder(folder: Path) -> MoshiFolder:
    config_path = folder / "config.json"
    data = json.loads(config_path.read_text()) if config_path.is_file() else {}
    model_type = data.get("model_type", "moshi")
    if model_type != "moshi":
        raise ValueError(f"{config_path}: model_type {model_type!r} is not served (only 'moshi')")
    lm_kwargs = {k: v for k, v in data.items() if k not in _FILE_KEYS | _UNUSED_KEYS} if data else dict(MOSHI_7B)
    if data.get("lora_name"):
        raise ValueError(f"{config_path}: LoRA checkpoints are not served (lora_name {data['lora_name']!r})")
    where = str(config_path if data else folder)
    config = MoshiConfig.from_kyutai(lm_kwargs, data.get("lm_gen_config"), where)

    def named(key: str, default: str | None) -> Path | None:
        name = data.get(key, default)
        if name is None:
            return None
        path = folder / Path(name).name  # (a hf:// or absolute name: its file in this folder)
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: {key} {name!r} is not in the folder")
        return path

    return MoshiFolder(
        folder=folder,
        config=config,
        weights=named("moshi_name", MOSHI_NAME),
        tokenizer=named("tokenizer_name", TOKENIZER_NAME),
        mimi=(folder / MIMI_NAME)
        if "mimi_name" not in data and (folder / MIMI_NAME).is_file()
        else named("mimi_name", None),
        mimi_config=named("mimi_config_name", None),
    )


def text_pieces(path: Path, config: MoshiConfig) -> TextPieces:
    """The folder's sentencepiece model, whose vocabulary must be the LM's text vocabulary."""
    pieces = TextPieces(path, (config.existing_text_padding_id, 0))
    if pieces.vocab_size != config.text_card:
        raise ValueError(
            f"{path}: the text tokenizer has {pieces.vocab_size} pieces but the model's text_card is {config.text_card}"
        )
    return pieces


def load_moshi(found: MoshiFolder, dtype: torch.dtype, device: torch.device) -> MoshiLM:
    """The LM, with its text tokenizer as `text_pieces` (what the server writes its text stream with)."""
    pieces = text_pieces(found.tokenizer, found.config)
    state = found.state if found.state is not None else load_file(str(found.weights))
    with torch.device(device):  # (Linear's init of 7B weights: seconds on a GPU, a minute on a CPU)
        model = MoshiLM(found.config).to(dtype)
    load_kyutai_state(model, state, str(found.weights))
    model.text_pieces = pieces
    return model.eval().requires_grad_(False)
