"""Mimi's split residual vector quantizer: the first `n_q_semantic` codebooks (the semantic one) quantize the latent
through their own projection, the acoustic codebooks quantize it again through another, residually; decoding sums
each group's entries and projects them back, and adds the two. A codebook entry is `embedding_sum / cluster_usage`
(the usage clamped at 1e-5), as Kyutai's `EuclideanCodebook` computes it. Names follow Kyutai's
`SplitResidualVectorQuantizer` (`quantizer.rvq_first.vq.layers.0._codebook.embedding_sum`, ...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from codec.mimi.config import MimiConfig

_USAGE_EPS = 1e-5


class _Codebook(nn.Module):
    def __init__(self, bins: int, dim: int):
        super().__init__()
        self.register_buffer("embedding_sum", torch.zeros(bins, dim))
        self.register_buffer("cluster_usage", torch.ones(bins))

    def embedding(self) -> torch.Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=_USAGE_EPS)[:, None]


class _Layer(nn.Module):
    def __init__(self, bins: int, dim: int):
        super().__init__()
        self._codebook = _Codebook(bins, dim)


class _VQ(nn.Module):
    def __init__(self, n_q: int, bins: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(bins, dim) for _ in range(n_q)])


class _RVQ(nn.Module):
    def __init__(self, n_q: int, cfg: MimiConfig):
        super().__init__()
        self.input_proj = nn.Conv1d(cfg.dimension, cfg.codebook_dim, 1, bias=False)
        self.output_proj = nn.Conv1d(cfg.codebook_dim, cfg.dimension, 1, bias=False)
        self.vq = _VQ(n_q, cfg.bins, cfg.codebook_dim)


class SplitRVQ(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.rvq_first = _RVQ(cfg.n_q_semantic, cfg)
        self.rvq_rest = _RVQ(cfg.n_q - cfg.n_q_semantic, cfg)
        self.n_q_semantic = cfg.n_q_semantic
        self.books: list[torch.Tensor] = []

    def prepare(self) -> None:
        """Compute the codebooks' entries from their buffers (again after loading weights or moving devices)."""
        self.books = [layer._codebook.embedding() for rvq in (self.rvq_first, self.rvq_rest) for layer in rvq.vq.layers]

    def encode(self, latent: torch.Tensor, n_q: int) -> torch.Tensor:
        """Latent `[B, D, F]` -> codes `[B, n_q, F]`: each codebook's nearest entry (Euclidean, as torch.cdist
        computes it) to what the codebooks before it in its group left."""
        batch, _, frames = latent.shape
        codes = []
        for rvq, first, count in (
            (self.rvq_first, 0, min(n_q, self.n_q_semantic)),
            (self.rvq_rest, self.n_q_semantic, n_q - self.n_q_semantic),
        ):
            if count <= 0:
                continue
            residual = F.conv1d(latent, rvq.input_proj.weight).transpose(1, 2).reshape(batch * frames, -1)
            for book in self.books[first : first + count]:
                index = torch.cdist(residual[None], book[None])[0].argmin(dim=-1)
                codes.append(index)
                residual = residual - book[index]
        return torch.stack(codes, dim=1).view(batch, frames, n_q).transpose(1, 2)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes `[B, K, F]` -> latent `[B, D, F]`."""
        out = None
        for rvq, first, last in (
            (self.rvq_first, 0, min(codes.shape[1], self.n_q_semantic)),
            (self.rvq_rest, self.n_q_semantic, codes.shape[1]),
        ):
            if last <= first:
                continue
            summed = None
            for k in range(first, last):
                entry = F.embedding(codes[:, k], self.books[k])  # [B, F, D]
                summed = entry if summed is None else summed + entry
            part = F.conv1d(summed.transpose(1, 2), rvq.output_proj.weight)
            out = part if out is None else out + part
        return out
