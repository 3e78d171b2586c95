"""What the engine needs of a model family (`StepModel`), and the registry that loads one from its folder.

Two families: this project's `S2SModel` (a Llama backbone, one sampling over K heads) and Moshi's (`MoshiLM`: the
temporal transformer, then the text token and the depformer's codebooks). Both step on the paged K/V pool; the engine,
the runner, the CUDA graphs and the duplex lane call only what is named here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from s2s.models.backbone import Backbone
from s2s.models.config import ModelConfig
from s2s.models.model import S2SModel
from s2s.models.moshi.text import TextPieces
from s2s.models.paged_step import StepOutput
from s2s.runner.sampling import RandomStream, SamplingParams


class StepModel(Protocol):
    """What the engine calls of a model; both families are `PagedStep`s, whose `forward_paged` reads the rest."""

    config: ModelConfig  # the step's layout (streams, codebooks, delays, reserved ids) and the K/V pool's shape
    backbone: Backbone  # the stack over the paged pool
    text_pieces: TextPieces | None  # with a text stream: its ids as text

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Step tokens `[N, 2K]` at conversation steps `positions` `[N]` -> `[N, H]`, every id checked."""

    def embed_checked(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`embed` for ids already checked: no host sync (what a CUDA graph holds)."""

    def step_state(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """The backbone's last hidden states `[S, H]` -> the state `head` samples from (what a CUDA graph ends in)."""

    def head(self, state: torch.Tensor, params: list[SamplingParams], streams: list[RandomStream]) -> torch.Tensor:
        """The next step's model codes `[S, K]`, each row with its settings and counter-based stream."""

    def head_graphs(self, max_batch: int, device: torch.device) -> object | None:
        """`head` as CUDA graphs (`fits(n)`, `run(state, params, streams)`), or None where it has none."""

    def forward_paged(self, tokens, batch, k_caches, v_caches, batch_invariant: bool = False) -> StepOutput:
        """`PagedStep.forward_paged`: a round over the pool."""

    def parameters(self): ...


@dataclass
class FolderCodec:
    """The codec a model folder holds (Moshi's Mimi): `codec.load_tokenizer`'s path and config."""

    path: Path
    config: Path | None = None


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device) -> tuple[StepModel, FolderCodec | None]:
    """The model in `folder` and the codec it holds (Moshi's Mimi; None for this project's models, whose codec is
    given apart): Kyutai's layout, transformers' (`model_type` "moshi"), or this project's (`ModelConfig`'s
    config.json)."""
    from s2s.models.moshi.checkpoint import is_kyutai_folder, load_moshi, read_kyutai_folder

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if is_kyutai_folder(folder):
        found = read_kyutai_folder(folder)
        return load_moshi(found, dtype, device), _codec(found)
    config = folder / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type == "moshi":
        from s2s.models.moshi.transformers_layout import read_transformers_folder

        found = read_transformers_folder(folder)
        return load_moshi(found, dtype, device), _codec(found)
    if model_type is not None:
        raise ValueError(f"{config}: model_type {model_type!r} is not served (Moshi's family, or this project's)")
    return S2SModel.from_pretrained(folder, dtype=dtype, device=device), None


def _codec(found) -> FolderCodec | None:
    return FolderCodec(found.mimi, found.mimi_config) if found.mimi is not None else None
