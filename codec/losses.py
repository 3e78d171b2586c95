"""Reconstruction losses for codec training: multi-scale log-mel and linear-magnitude spectra, plus the waveform."""

from __future__ import annotations

import torch
from torch import nn
from transformers.audio_utils import mel_filter_bank

from codec.pcm import SAMPLE_RATE


class MultiScaleMelLoss(nn.Module):
    """Mean over window sizes 2^6 .. 2^11 of L1 on log-mel plus L1 on mel magnitudes (EnCodec's frequency loss)."""

    def __init__(self, scales: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)):
        super().__init__()
        self.scales = scales
        for n_fft in scales:
            mels = mel_filter_bank(
                num_frequency_bins=n_fft // 2 + 1,
                num_mel_filters=min(80, n_fft // 4),
                min_frequency=0.0,
                max_frequency=SAMPLE_RATE / 2,
                sampling_rate=SAMPLE_RATE,
                norm="slaney",
                mel_scale="slaney",
            )
            self.register_buffer(f"mel_{n_fft}", torch.tensor(mels, dtype=torch.float32).T, persistent=False)
            self.register_buffer(f"window_{n_fft}", torch.hann_window(n_fft), persistent=False)

    def _mel(self, wav: torch.Tensor, n_fft: int) -> torch.Tensor:
        spec = torch.stft(
            wav, n_fft, hop_length=n_fft // 4, window=getattr(self, f"window_{n_fft}"), return_complex=True
        ).abs()
        return getattr(self, f"mel_{n_fft}") @ spec

    def forward(self, fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """`fake`, `real`: [B, T] PCM."""
        total = fake.new_zeros(())
        for n_fft in self.scales:
            f, r = self._mel(fake, n_fft), self._mel(real, n_fft)
            total = total + (f - r).abs().mean() + (torch.log(f + 1e-5) - torch.log(r + 1e-5)).abs().mean()
        return total / len(self.scales)
