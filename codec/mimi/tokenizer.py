"""MimiTokenizer: Kyutai's Mimi codec (24 kHz PCM <-> codes at 12.5 Hz), offline and streaming, with the surface of
`codec.tokenizer.EncodecTokenizer`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from codec.checks import CodecInputChecks
from codec.mimi.config import MimiConfig
from codec.mimi.model import MimiModel
from codec.mimi.weights import gather_weights, read_checkpoint
from codec.streaming import StreamingDecoder, StreamingEncoder


class MimiTokenizer(CodecInputChecks):
    """Mimi as a tokenizer: `encode` PCM `[B, T]` to codes `[B, K, F]`, `decode` codes back to PCM
    `[B, F * frame_size]`, K = `num_codebooks` (the semantic codebook, then acoustic ones; settable up to the
    checkpoint's). Build it with `from_pretrained` or `random`.

    Its nets are streaming steps (`encoder_net`, `decoder_net`: `net(x, state) -> (y, new_state)`), which
    `codec.streaming` drives for many rows at once. The convolutions pad with zeros (the resampling replicates its
    first input), so nothing looks ahead: a frame's codes come with its last sample, its audio with its codes.
    """

    encoder_warmup_frames = 1
    decoder_warmup_frames = 1

    def __init__(self, model: MimiModel, num_codebooks: int = 8):
        cfg = model.cfg
        self.model = model.eval().requires_grad_(False)
        self.config = cfg
        self.sample_rate = cfg.sample_rate
        self.frame_size = cfg.frame_size
        self.frame_rate = cfg.sample_rate / cfg.frame_size
        self.codebook_size = cfg.bins
        self.total_codebooks = cfg.n_q
        self.num_codebooks = num_codebooks
        model.quantizer.prepare()
        self.encoder_net = model.encoder_step()
        self.decoder_net = model.decoder_step()

    @property
    def num_codebooks(self) -> int:
        return self._num_codebooks

    @num_codebooks.setter
    def num_codebooks(self, n: int) -> None:
        if not self.config.n_q_semantic <= n <= self.total_codebooks:
            raise ValueError(
                f"num_codebooks must be in [{self.config.n_q_semantic}, {self.total_codebooks}], got {n!r}"
            )
        self._num_codebooks = int(n)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        config: str | Path | dict[str, Any] | None = None,
        num_codebooks: int = 8,
        device: str | torch.device = "cpu",
    ) -> MimiTokenizer:
        """Load Kyutai's Mimi safetensors file (with its config JSON or dict, else `NAME.json` beside
        `NAME.safetensors`, else Kyutai's defaults), or a folder transformers' `MimiModel.save_pretrained` wrote."""
        cfg, source = read_checkpoint(path, config)
        with torch.device("meta"):
            model = MimiModel(cfg)
        weights = gather_weights(model.state_dict(), source, f"Mimi checkpoint {path}")
        model.load_state_dict(weights, assign=True)
        return cls(model.to(device), num_codebooks)

    @classmethod
    def random(
        cls,
        config: MimiConfig | dict[str, Any] | None = None,
        seed: int = 0,
        num_codebooks: int = 8,
        device: str | torch.device = "cpu",
    ) -> MimiTokenizer:
        """Random weights from `seed` for `config` (a `MimiConfig` or Kyutai's config dict; None: Kyutai's Mimi),
        with codebooks fitted to their own latents so that codes vary (for tests and benchmarks)."""
        cfg = config if isinstance(config, MimiConfig) else MimiConfig.from_kyutai(config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = MimiModel(cfg).to(device)
        model.seed_codebooks(torch.Generator().manual_seed(seed))
        return cls(model, num_codebooks)

    def save_pretrained(self, path: str | Path) -> None:
        """Write the weights as Kyutai's safetensors file `NAME.safetensors` and its Kyutai config beside it as
        `NAME.json` (`moshi.models.loaders.get_mimi` loads both, and `from_pretrained` here the file alone)."""
        path = Path(path)
        state = {k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        for name in [k for k in state if k.endswith("._codebook.cluster_usage")]:
            state[name.replace("cluster_usage", "_initialized")] = torch.ones(1)
        save_file(state, str(path))
        path.with_suffix(".json").write_text(json.dumps(self.config.to_kyutai(), indent=2))

    def describe(self) -> str:
        """The codec in a line (`s2s roundtrip` prints it)."""
        return (
            f"Mimi, {self.num_codebooks} of {self.total_codebooks} codebooks of {self.codebook_size}, "
            f"{self.frame_size}-sample frames ({self.frame_rate:g} Hz)"
        )

    # ---- offline paths ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor | np.ndarray, sample_rate: int | None = None) -> torch.Tensor:
        """PCM `[T]` or `[B, T]` (float32 in [-1, 1]) -> codes `[B, K, ceil(T / frame_size)]`; the last frame is
        padded with zeros, as Kyutai's `MimiModel.encode` pads it."""
        wav = self.check_pcm(wav, sample_rate)
        frames = -(-wav.shape[-1] // self.frame_size)
        x = F.pad(wav, (0, frames * self.frame_size - wav.shape[-1]))[:, None]
        latent, _ = self.encoder_net(x, None)
        return self.quantize(latent)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Codes `[B, K, F]` -> PCM `[B, F * frame_size]`."""
        codes = self.check_codes(codes)
        audio, _ = self.decoder_net(self.dequantize(codes), None)
        return audio[:, 0]

    def quantize(self, latent: torch.Tensor) -> torch.Tensor:
        """Encoder output `[B, D, F]` -> codes `[B, K, F]`."""
        return self.model.quantizer.encode(latent, self.num_codebooks)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes `[B, K, F]` -> decoder input `[B, D, F]`."""
        return self.model.quantizer.decode(codes)

    # ---- streaming ----------------------------------------------------------------------------------------------

    def streaming_encoder(self, batch_size: int, batch_invariant: bool = False) -> StreamingEncoder:
        return StreamingEncoder(self, batch_size, batch_invariant)

    def streaming_decoder(self, batch_size: int, batch_invariant: bool = False) -> StreamingDecoder:
        return StreamingDecoder(self, batch_size, batch_invariant)
