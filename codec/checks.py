"""Input checks every tokenizer shares: PCM offline (`[T]` or `[B, T]`) and streaming (rows of chunks), and codes
`[B, K, F]`. A bad call is a ValueError that says what is wrong, before any state changes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def host_pcm(wav: torch.Tensor | np.ndarray, what: str) -> np.ndarray:
    """Float PCM as a host float32 array (its samples are checked by `check_samples`)."""
    if isinstance(wav, np.ndarray):
        if wav.dtype not in (np.float32, np.float64):
            raise ValueError(f"{what} must be float32 PCM in [-1, 1], got numpy dtype {wav.dtype}")
    elif isinstance(wav, torch.Tensor):
        if wav.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{what} must be float32 PCM in [-1, 1], got torch dtype {wav.dtype}")
        wav = wav.detach().cpu().numpy()
    else:
        raise ValueError(f"{what} must be a numpy array or torch tensor, got {type(wav).__name__}")
    return np.asarray(wav, dtype=np.float32, order="C")  # (ascontiguousarray would make a 0-d array 1-d)


def check_samples(wav: np.ndarray, what: str) -> None:
    if wav.size and not np.isfinite(wav).all():
        raise ValueError(f"{what} holds NaN or inf")
    if wav.size and np.abs(wav).max() > 1.0:
        raise ValueError(f"{what} has samples outside [-1, 1] (peak {np.abs(wav).max():.3g}): normalise it first")


class CodecInputChecks:
    """The checks as methods of a tokenizer, which gives `sample_rate`, `num_codebooks`, `codebook_size` and
    `device`; `_codebooks_note` says what sets its codebook count (for the error when codes have another)."""

    sample_rate: int
    num_codebooks: int
    codebook_size: int
    device: torch.device

    def _codebooks_note(self) -> str:
        return "the codec"

    def _check_rate(self, sample_rate: int | None) -> None:
        if sample_rate is not None and sample_rate != self.sample_rate:
            raise ValueError(
                f"audio is {sample_rate} Hz but the codec takes {self.sample_rate} Hz: resample it first "
                "(for example with soxr.resample)"
            )

    def check_pcm(self, wav: torch.Tensor | np.ndarray, sample_rate: int | None = None) -> torch.Tensor:
        """Validate offline input `[T]` or `[B, T]`; return float32 `[B, T]` on the codec's device."""
        self._check_rate(sample_rate)
        wav = host_pcm(wav, "wav")
        check_samples(wav, "wav")
        wav = torch.from_numpy(wav).to(self.device)
        if wav.dim() not in (1, 2):
            raise ValueError(f"wav must have shape [T] or [B, T], got {tuple(wav.shape)}")
        wav = wav if wav.dim() == 2 else wav[None]
        if wav.numel() == 0:
            raise ValueError(f"wav is empty: shape {tuple(wav.shape)}")
        return wav

    def check_pcm_rows(
        self, pcm: torch.Tensor | np.ndarray | Sequence, sample_rate: int | None = None
    ) -> list[np.ndarray]:
        """Validate streaming input: `[R, S]` or a sequence of R 1-D chunks (lengths may differ, even be 0). The
        chunks stay on the host, checked in one pass over all of them: no device work per row."""
        self._check_rate(sample_rate)
        if isinstance(pcm, torch.Tensor):
            pcm = pcm.detach().cpu()  # one copy to the host, not one a row
        if isinstance(pcm, torch.Tensor | np.ndarray):
            if pcm.ndim != 2:
                raise ValueError(f"pcm must have shape [rows, samples] or be a list of 1-D chunks, got {pcm.shape}")
            pcm = list(pcm)
        chunks = [host_pcm(c, "pcm chunk") for c in pcm]
        if not chunks:
            raise ValueError("pcm holds no rows")
        if any(c.ndim != 1 for c in chunks):
            raise ValueError("each pcm chunk must be 1-D")
        check_samples(np.concatenate(chunks), "pcm chunk")
        return chunks

    def check_codes(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Validate codes `[B, K, F]`: integer, K codebooks, values in [0, codebook_size), non-empty."""
        if isinstance(codes, np.ndarray):
            codes = torch.from_numpy(codes)
        if not isinstance(codes, torch.Tensor):
            raise ValueError(f"codes must be a tensor, got {type(codes).__name__}")
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise ValueError(f"codes must be integers, got {codes.dtype}")
        if codes.dim() != 3:
            raise ValueError(f"codes must have shape [B, K, F], got {tuple(codes.shape)}")
        if codes.shape[1] != self.num_codebooks:
            raise ValueError(
                f"codes have {codes.shape[1]} codebooks but {self._codebooks_note()} uses {self.num_codebooks}"
            )
        if codes.numel() == 0:
            raise ValueError(f"codes are empty: shape {tuple(codes.shape)}")
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= self.codebook_size:
            raise ValueError(f"codes must lie in [0, {self.codebook_size}), got values in [{lo}, {hi}]")
        return codes.long().to(self.device)
