"""MoshiLM: Kyutai's Moshi language model (`moshi.models.lm.LMModel`) in the engine's model interface.

- `embed_checked`: a step's tokens (the engine's layout, `MoshiConfig.layout`) -> the sum of the text embedding and
  every audio codebook's, both streams. As Kyutai's `LMGen` does, codebook k reads its initial token up to and including
  step `delays[k]`: a stream's frame 0 is never read.
- The temporal transformer is a `Backbone` (RoPE rotate-half: the loader permutes Kyutai's interleaved q/k rows),
  with Kyutai's `out_norm` as its final norm, so it runs on the paged K/V pool in every cache mode.
- `head`: the text token from the text linear, then the depformer's codebooks (`depformer.py`), all rows at once,
  each sampled with the row's counter-based stream (`sampling.sample_keyed`).
- `forward`: teacher forcing over whole sequences, as `LMModel.forward`: the reference the tests compare.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from s2s.models.backbone import Backbone
from s2s.models.moshi.config import MoshiConfig
from s2s.models.moshi.depformer import Depformer
from s2s.models.moshi.text import TextPieces
from s2s.models.paged_step import PagedStep
from s2s.runner.sampling import RandomStream, SamplingParams, sample_keyed, stream_keys

if TYPE_CHECKING:
    from s2s.models.moshi.head_graphs import HeadGraphs


class MoshiLM(PagedStep, nn.Module):
    def __init__(self, cfg: MoshiConfig):
        super().__init__()
        cfg.check()
        self.moshi = cfg
        self.config = cfg.layout()
        self.text_pieces: TextPieces | None = None  # the checkpoint's tokenizer (`checkpoint.load_moshi`)
        k, dep_q, n_q = self.config.num_codebooks, cfg.dep_q, cfg.n_q
        # one flat table: the text embedding (text_card + 1 rows), then each of the n_q audio embeddings (card + 1)
        self.embeddings = nn.Parameter(torch.empty(cfg.text_card + 1 + n_q * (cfg.card + 1), cfg.dim))
        self.backbone = Backbone(self.config)
        self.text_head = nn.Parameter(torch.empty(cfg.text_card, cfg.dim))
        self.depformer = Depformer(cfg)
        # the engine's step columns (user's K, then model's K) that are read: all but the user's empty text slot
        columns = list(range(1, k)) + list(range(k, 2 * k))
        stream = [dep_q + c for c in range(1, k)] + [0] + list(range(1, k))  # Kyutai's stream of each column
        offset = [0 if s == 0 else cfg.text_card + 1 + (s - 1) * (cfg.card + 1) for s in stream]
        initial = [cfg.text_card if s == 0 else cfg.card for s in stream]
        self.register_buffer("_columns", torch.tensor(columns), persistent=False)
        self.register_buffer("_offsets", torch.tensor(offset), persistent=False)
        self.register_buffer("_initial", torch.tensor(initial), persistent=False)
        self.register_buffer("_limits", torch.tensor(initial), persistent=False)  # (ids below the initial token)
        self.register_buffer("_delays", torch.tensor([cfg.delays[s] for s in stream]), persistent=False)

    # ---- the engine's model interface ---------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Step tokens `[N, 2K]` at steps `positions` `[N]` -> `[N, dim]`, every id checked."""
        cfg = self.config
        if tokens.dim() != 2 or tokens.shape[-1] != cfg.step_width:
            raise ValueError(f"step tokens must be [N, {cfg.step_width}], got {list(tokens.shape)}")
        read = tokens[:, self._columns]
        initial = positions[:, None] <= self._delays  # (what is read there is never looked at)
        bad = ~initial & ((read < 0) | ((read >= self._limits) & (read != cfg.pad_id)))  # limits: text_card, card
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            column = int(self._columns[col])
            raise ValueError(
                f"step token column {column} holds {int(read[row, col])}, outside [0, {int(self._limits[col])})"
            )
        return self.embed_checked(tokens, positions)

    def embed_checked(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`embed` without the checks (no host sync: what a CUDA graph can hold)."""
        read = tokens[:, self._columns].long()
        initial = (positions[:, None] <= self._delays) | (read == self.config.pad_id)
        ids = torch.where(initial, self._initial, read) + self._offsets
        return F.embedding_bag(ids, self.embeddings, mode="sum")

    def step_state(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """The backbone's last hidden states are what `head` reads (its final norm is Kyutai's `out_norm`)."""
        return hidden

    def head_graphs(self, max_batch: int, device: torch.device) -> HeadGraphs:
        """`head` as CUDA graphs per batch bucket (the depformer's passes and samplings of a round)."""
        from s2s.models.moshi.head_graphs import HeadGraphs

        return HeadGraphs(self, max_batch, device)

    def head(self, state: torch.Tensor, params: list[SamplingParams], streams: list[RandomStream]) -> torch.Tensor:
        """The next step's model codes `[S, 1 + dep_q]` (text, then audio) from the temporal outputs `[S, dim]`. Each
        row draws once for the step; the text is sampled with the checkpoint's text settings (`lm_gen_config`),
        its temperature scaled as the row's audio temperature is."""
        keys = stream_keys(streams)
        text_params = [self._text_params(p) for p in params]
        text = sample_keyed(F.linear(state, self.text_head)[:, None], text_params, keys)[:, 0]
        codes, previous, cache = [text], text, self.depformer.new_cache(len(state))
        for k in range(self.moshi.dep_q):
            logits = self.depformer.step(state, k, previous, cache)
            previous = sample_keyed(logits[:, None], params, keys, first_codebook=1 + k)[:, 0]
            codes.append(previous)
        return torch.stack(codes, 1)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (a few settings per server; the model lives as long as it)
    def _text_params(self, params: SamplingParams) -> SamplingParams:
        defaults = self.moshi.sampling
        return SamplingParams(
            temperature=params.temperature * defaults.temp_text / defaults.temp,
            top_k=defaults.top_k_text,
            top_p=params.top_p,
            seed=params.seed,
        )

    # ---- the reference ------------------------------------------------------------------------------------------

    def forward(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing, as Kyutai's `LMModel.forward`: codes `[B, 1 + n_q, T]` (text, the model's audio, the
        user's) -> text logits `[B, T, text_card]` and audio logits `[B, dep_q, T, card]`, each aligned with the code
        it predicts (NaN where its delay leaves no prediction)."""
        cfg = self.moshi
        batch, streams, steps = codes.shape
        if streams != 1 + cfg.n_q:
            raise ValueError(f"codes must be [B, {1 + cfg.n_q}, T], got {list(codes.shape)}")
        initial = torch.tensor([cfg.text_card] + [cfg.card] * cfg.n_q, device=codes.device)
        delayed = torch.full((batch, streams, steps + 1), 0, dtype=torch.long, device=codes.device)
        delayed[:] = initial[None, :, None]
        for k, d in enumerate(cfg.delays):
            delayed[:, k, 1 + d :] = codes[:, k, : steps - d]
        table_offsets = torch.tensor(
            [0] + [cfg.text_card + 1 + s * (cfg.card + 1) for s in range(cfg.n_q)], device=codes.device
        )
        inputs = (delayed[:, :, :-1] + table_offsets[None, :, None]).transpose(1, 2).reshape(-1, streams)
        x = F.embedding_bag(inputs, self.embeddings, mode="sum").view(batch, steps, cfg.dim)
        hidden = self.backbone(x)
        text_logits = F.linear(hidden, self.text_head)
        read = delayed[:, : cfg.dep_q, 1:].transpose(1, 2).reshape(-1, cfg.dep_q)
        logits = self.depformer(hidden.reshape(-1, cfg.dim), read).view(batch, steps, cfg.dep_q, -1)
        logits = logits.transpose(1, 2)
        out = torch.full_like(logits, float("nan"))
        for k, d in enumerate(cfg.delays[1 : 1 + cfg.dep_q]):
            out[:, k, : steps - d] = logits[:, k, d:]
        text_out = torch.full_like(text_logits, float("nan"))
        text_out[:, : steps - cfg.delays[0]] = text_logits[:, cfg.delays[0] :]
        return text_out, out
