"""EncodecTokenizer: 24 kHz PCM <-> multi-codebook codes, offline and streaming, on transformers' EnCodec."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import EncodecConfig, EncodecModel
from transformers.utils import logging as hf_logging

from codec.checks import CodecInputChecks
from codec.pcm import SAMPLE_RATE
from codec.stream_layers import StreamingNet
from codec.streaming import StreamingDecoder, StreamingEncoder

BANDWIDTHS = (1.5, 3.0, 6.0, 12.0, 24.0)


def _weight_normed_convs(model: nn.Module) -> list[nn.Module]:
    return [
        m for m in model.modules() if isinstance(m, nn.Conv1d | nn.ConvTranspose1d) and hasattr(m, "parametrizations")
    ]


def _seed_codebooks(model: EncodecModel, generator: torch.Generator) -> None:
    """Give a freshly initialised model codebooks that cover its own latent space (transformers leaves them zero).

    Each codebook is drawn from a diagonal Gaussian fitted to the residual it will quantize, measured on seeded
    noise, so random weights still give varied codes, with no near-duplicate entries (which would make ties).
    """
    noise = 0.3 * torch.randn(2 * SAMPLE_RATE, generator=generator)
    residual = model.encoder(noise[None, None]).squeeze(0).T  # [frames, dim]
    for layer in model.quantizer.layers:
        book = layer.codebook
        mean, std = residual.mean(0), residual.std(0)
        book.embed.copy_(mean + std * torch.randn(book.embed.shape, generator=generator))
        residual = residual - book.decode(book.encode(residual))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


class EncodecTokenizer(CodecInputChecks):
    """EnCodec 24 kHz as a tokenizer: `encode` PCM [B, T] to codes [B, K, F], `decode` codes back to PCM [B, F * 320].

    Build it with `from_pretrained`. Weight norm is folded into plain weights for inference.
    """

    sample_rate = SAMPLE_RATE
    frame_size = 320  # EnCodec 24 kHz's hop: the product of its upsampling ratios
    frame_rate = SAMPLE_RATE // frame_size

    def __init__(self, model: EncodecModel, bandwidth: float):
        cfg = model.config
        if bandwidth not in BANDWIDTHS or bandwidth not in cfg.target_bandwidths:
            raise ValueError(f"bandwidth must be one of {list(cfg.target_bandwidths)} (kbps), got {bandwidth!r}")
        problems = {
            "sampling_rate": cfg.sampling_rate == SAMPLE_RATE,
            "audio_channels": cfg.audio_channels == 1,
            "use_causal_conv": cfg.use_causal_conv,
            "chunk_length_s": cfg.chunk_length_s is None,
            "normalize": not cfg.normalize,
            "upsampling_ratios": math.prod(cfg.upsampling_ratios) == self.frame_size,
            "norm_type": cfg.norm_type == "weight_norm",
        }
        bad = [name for name, ok in problems.items() if not ok]
        if bad:
            raise ValueError(f"not a causal 24 kHz mono EnCodec with 320-sample frames: check config fields {bad}")
        for conv in _weight_normed_convs(model):
            torch.nn.utils.parametrize.remove_parametrizations(conv, "weight", leave_parametrized=True)
        self.model = model.eval().requires_grad_(False)
        self.bandwidth = float(bandwidth)
        self.codebook_size = cfg.codebook_size
        self.num_codebooks = model.quantizer.get_num_quantizers_for_bandwidth(self.bandwidth)
        self.encoder_net = StreamingNet(model.encoder.layers)
        self.decoder_net = StreamingNet(model.decoder.layers)
        # A stream's start looks ahead by the left padding of the convolution that runs at the frame rate.
        self.encoder_warmup_frames = self.encoder_net.layers[-1].padding + 1
        self.decoder_warmup_frames = self.decoder_net.layers[0].padding + 1

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def from_pretrained(
        cls, path: str | Path | None = None, bandwidth: float = 1.5, device: str | torch.device = "cpu", seed: int = 0
    ) -> EncodecTokenizer:
        """Load a Hugging Face EnCodec 24 kHz folder, or with `path=None` build that architecture from `seed`."""
        if path is None:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed)
                model = EncodecModel(EncodecConfig())
                _seed_codebooks(model, torch.Generator().manual_seed(seed))
        else:
            folder = Path(path)
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(f"{folder} holds no config.json: not an EnCodec checkpoint folder")
            with _quiet_transformers():  # the buffers only training uses are left out of shipped folders: no report
                model, info = EncodecModel.from_pretrained(
                    folder, local_files_only=True, output_loading_info=True, dtype=torch.float32
                )
            missing = [k for k in info["missing_keys"] if not k.endswith(("cluster_size", "embed_avg", "inited"))]
            if missing or info["mismatched_keys"]:
                raise ValueError(
                    f"checkpoint in {folder} does not fit EncodecModel: missing {missing[:5]}, "
                    f"mismatched {info['mismatched_keys'][:5]}"
                )
        return cls(model.to(device), bandwidth)

    def save_pretrained(self, path: str | Path) -> None:
        """Write a folder `EncodecModel.from_pretrained` (and `from_pretrained` here) loads: weight norm restored."""
        model = copy.deepcopy(self.model)
        for m in model.modules():
            if isinstance(m, nn.Conv1d | nn.ConvTranspose1d):
                torch.nn.utils.parametrizations.weight_norm(m)
        model.save_pretrained(path)

    def describe(self) -> str:
        """The codec in a line (`s2s roundtrip` prints it)."""
        return (
            f"EnCodec 24 kHz at {self.bandwidth:g} kbps, {self.num_codebooks} codebooks of {self.codebook_size}, "
            f"{self.frame_size}-sample frames ({self.frame_rate:g} Hz)"
        )

    def _codebooks_note(self) -> str:
        return f"the codec at {self.bandwidth} kbps"

    # ---- offline paths ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor | np.ndarray, sample_rate: int | None = None) -> torch.Tensor:
        """PCM `[T]` or `[B, T]` (float32 in [-1, 1], 24 kHz) -> codes `[B, K, ceil(T / 320)]`."""
        wav = self.check_pcm(wav, sample_rate)
        return self.model.encode(wav[:, None, :], bandwidth=self.bandwidth).audio_codes[0]

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Codes `[B, K, F]` -> PCM `[B, F * 320]`."""
        codes = self.check_codes(codes)
        return self.model.decode(codes[None], [None]).audio_values[:, 0, :]

    def quantize(self, latent: torch.Tensor) -> torch.Tensor:
        """Encoder output `[B, D, F]` -> codes `[B, K, F]`."""
        return self.model.quantizer.encode(latent, self.bandwidth).transpose(0, 1)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes `[B, K, F]` -> decoder input `[B, D, F]`."""
        return self.model.quantizer.decode(codes.transpose(0, 1))

    # ---- streaming ----------------------------------------------------------------------------------------------

    def streaming_encoder(self, batch_size: int, batch_invariant: bool = False) -> StreamingEncoder:
        return StreamingEncoder(self, batch_size, batch_invariant)

    def streaming_decoder(self, batch_size: int, batch_invariant: bool = False) -> StreamingDecoder:
        return StreamingDecoder(self, batch_size, batch_invariant)
