"""Training the residual vector quantizer of a transformers EncodecModel in place: k-means initialisation,
exponential-moving-average codebooks with dead-code replacement, and a straight-through estimate for the encoder.

transformers keeps each codebook as buffers (`embed`, `embed_avg`, `cluster_size`) and implements inference only;
this is the training half, as EnCodec trains its quantizer.
"""

from __future__ import annotations

import torch
from transformers import EncodecModel

DECAY = 0.99
DEAD_BELOW = 0.05  # a code whose smoothed use falls under this many frames a step is re-seeded from the batch


def _nearest(x: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    return torch.cdist(x, embed).argmin(-1)


@torch.no_grad()
def kmeans_init(model: EncodecModel, latents: torch.Tensor, iterations: int = 12, seed: int = 0) -> None:
    """Set every codebook by k-means on the residual it will quantize. `latents`: [N, D] encoder frames."""
    gen = torch.Generator().manual_seed(seed)
    residual = latents.float()
    for layer in model.quantizer.layers:
        book = layer.codebook
        k = book.embed.shape[0]
        centers = residual[torch.randint(len(residual), (k,), generator=gen)].clone()
        for _ in range(iterations):
            idx = _nearest(residual, centers)
            counts = torch.bincount(idx, minlength=k).float()
            sums = torch.zeros_like(centers).index_add_(0, idx, residual)
            empty = counts == 0
            centers = torch.where(
                empty[:, None],
                residual[torch.randint(len(residual), (k,), generator=gen)],
                sums / counts.clamp(min=1)[:, None],
            )
        book.embed.copy_(centers)
        book.embed_avg.copy_(centers)
        book.cluster_size.fill_(1.0)
        residual = residual - centers[_nearest(residual, centers)]


def quantize(
    model: EncodecModel, latents: torch.Tensor, num_quantizers: int, update: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual VQ over the first `num_quantizers` codebooks. `latents`: [B, D, F].

    Returns the quantized latents (straight-through: gradients reach the encoder) and the commitment loss. With
    `update`, each used codebook moves toward its assigned residuals by EMA and unused codes are re-seeded.
    """
    x = latents.transpose(1, 2).reshape(-1, latents.shape[1])  # [B * F, D]
    residual = x
    quantized = torch.zeros_like(x)
    commit = x.new_zeros(())
    for layer in model.quantizer.layers[:num_quantizers]:
        book = layer.codebook
        idx = _nearest(residual.detach(), book.embed)
        q = book.embed[idx]
        commit = commit + (residual - q.detach()).pow(2).mean() / num_quantizers
        if update:
            _ema_update(book, residual.detach(), idx)
        quantized = quantized + q
        residual = residual - q.detach()
    out = x + (quantized - x).detach()
    return out.reshape(latents.shape[0], latents.shape[2], -1).transpose(1, 2), commit


@torch.no_grad()
def _ema_update(book, residual: torch.Tensor, idx: torch.Tensor) -> None:
    k = book.embed.shape[0]
    onehot_counts = torch.bincount(idx, minlength=k).float()
    sums = torch.zeros_like(book.embed).index_add_(0, idx, residual)
    book.cluster_size.mul_(DECAY).add_(onehot_counts, alpha=1 - DECAY)
    book.embed_avg.mul_(DECAY).add_(sums, alpha=1 - DECAY)
    n = book.cluster_size.sum()
    smoothed = (book.cluster_size + 1e-5) / (n + k * 1e-5) * n
    book.embed.copy_(book.embed_avg / smoothed[:, None])
    dead = book.cluster_size < DEAD_BELOW
    if dead.any():
        picks = residual[torch.randint(len(residual), (int(dead.sum()),), device=residual.device)]
        book.embed[dead] = picks
        book.embed_avg[dead] = picks
        book.cluster_size[dead] = 1.0
