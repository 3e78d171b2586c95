"""Kyutai's own Mimi (moshi 0.2.13) as the reference for codec.MimiTokenizer: run in .venv-moshi, not the main venv.

    .venv-moshi/bin/python tests/mimi_reference.py SPEC.json OUT_DIR

SPEC.json: {"configs": [{"name": str, "seed": int, "mimi_config": {...as moshi.models.loaders._mimi_config...},
"num_codebooks": int, "rows": int, "frames": int}, ...]}. For each configuration, OUT_DIR/<name>/ gets

- `mimi.safetensors`: the weights of a seeded random `MimiModel` built as `moshi.models.loaders.get_mimi` builds it,
  in Kyutai's layout (`MimiModel.state_dict()`). Weights are PyTorch's default init, with the transformers' layer
  scales raised (0.2 to 1, not 0.01, so that the transformers matter) and the codebooks set from the statistics of
  the residual each one quantizes (a random `cluster_usage`, `embedding_sum = embedding * cluster_usage`), so that
  every codebook's codes vary;
- `mimi_config.json`: the config, as `CheckpointInfo` reads a Mimi config;
- `ref.npz`:
  - `wav` [B, F * frame_size]: seeded signals (noise, tones, chirps, silence-then-noise, ...);
  - `codes` [B, K, F]: `mimi.encode(wav)` offline, K = num_codebooks (`set_num_codebooks`);
  - `audio` [B, F * frame_size]: `mimi.decode(codes)` offline;
  - `stream_codes` [B, K, F]: `mimi.encode` one frame at a time inside `mimi.streaming(B)`;
  - `stream_audio` [B, F * frame_size]: `mimi.decode` of `codes` one frame at a time inside `mimi.streaming(B)`;
  - `tail_codes` [B, K, F]: `mimi.encode` of `wav` cut to `(F - 1) * frame_size + frame_size // 3` samples (Kyutai
    pads the last frame with zeros);
  - `random_codes` [B, K, F] uniform over the bins, `random_audio` their offline decode and `random_stream_audio`
    their frame-by-frame streaming decode;
- `summary.json`: frame size, code variety and how far Kyutai's streaming is from its own offline paths.

The reloaded model (`get_mimi(file, config)`) computes every output, so the files are what was compared. fp32, CPU.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

# moshi is imported in the functions that use it: tests/test_mimi.py imports `signals` from the main venv


def signals(rows: int, length: int, seed: int) -> np.ndarray:
    """Seeded test signals in [-1, 1]: noise, tones, a chirp, and a row that starts silent."""
    rng = np.random.default_rng(seed)
    t = np.arange(length) / 24000.0
    out = []
    for r in range(rows):
        kind = r % 4
        if kind == 0:
            x = 0.3 * rng.standard_normal(length) * (0.6 + 0.4 * np.sin(2 * np.pi * 2 * t))
        elif kind == 1:
            f = rng.uniform(100, 2000, 3)
            x = sum(0.25 * np.sin(2 * np.pi * fi * t + rng.uniform(0, 6.3)) for fi in f)
        elif kind == 2:
            chirp = np.sin(2 * np.pi * (200 * t + 1500 * t**2 / max(t[-1], 1e-9)))
            x = 0.5 * chirp + 0.05 * rng.standard_normal(length)
        else:
            x = 0.4 * rng.standard_normal(length) * (t > t[-1] / 3)
        out.append(np.clip(x, -1, 1))
    return np.stack(out).astype(np.float32)


@torch.no_grad()
def randomize(mimi, wav: torch.Tensor, seed: int) -> None:
    """SEANet convolutions that carry their input (PyTorch's default init shrinks a signal ~2x a layer, so the
    decoder's output would be its biases), layer scales well away from 0.01, and codebooks fitted to the residuals
    they quantize."""
    from moshi.modules.transformer import LayerScale

    g = torch.Generator().manual_seed(seed + 1)
    for net in (mimi.encoder, mimi.decoder):
        for m in net.modules():
            if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                m.weight.mul_(1.7)
                if m.bias is not None:
                    m.bias.mul_(0.1)
    for m in mimi.modules():
        if isinstance(m, LayerScale):
            m.scale.copy_(0.2 + 0.8 * torch.rand(m.scale.shape, generator=g))
    latent = mimi._encode_to_unquantized_latent(wav[:, None])  # [B, D, F]
    for rvq in (mimi.quantizer.rvq_first, mimi.quantizer.rvq_rest):
        residual = rvq.input_proj(latent)
        for layer in rvq.vq.layers:
            book = layer._codebook
            flat = residual.transpose(1, 2).reshape(-1, residual.shape[1])
            mean, std = flat.mean(0), flat.std(0) + 1e-3
            embedding = mean + std * torch.randn(book.codebook_size, book.dim, generator=g)
            usage = 0.5 + 1.5 * torch.rand(book.codebook_size, generator=g)
            book.cluster_usage.copy_(usage)
            book.embedding_sum.copy_(embedding * usage[:, None])
            book._initialized.fill_(1.0)
            book.register_buffer("_embedding", None, persistent=False)
            residual = residual - layer.decode(layer.encode(residual))


@torch.no_grad()
def run_config(spec: dict, out: Path) -> dict:
    from moshi.models import loaders
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    seed, cfg = int(spec["seed"]), spec["mimi_config"]
    torch.manual_seed(seed)
    mimi = loaders.get_mimi(None, cfg, device="cpu", num_codebooks=int(spec["num_codebooks"]))
    fs, rows, frames = mimi.frame_size, int(spec["rows"]), int(spec["frames"])
    assert fs * mimi.frame_rate == mimi.sample_rate, (fs, mimi.frame_rate)
    wav = torch.from_numpy(signals(rows, frames * fs, seed))
    randomize(mimi, wav, seed)
    save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(out / "mimi.safetensors"))
    (out / "mimi_config.json").write_text(json.dumps(cfg, indent=1))

    # every output from the files, as a user of Kyutai's package loads them
    k = int(spec["num_codebooks"])
    cfg_read = json.loads((out / "mimi_config.json").read_text())
    mimi = loaders.get_mimi(out / "mimi.safetensors", cfg_read, device="cpu", num_codebooks=k)
    assert mimi.num_codebooks == k

    codes = mimi.encode(wav[:, None])
    assert codes.shape == (rows, k, frames), codes.shape
    audio = mimi.decode(codes)[:, 0]
    tail_codes = mimi.encode(wav[:, None, : (frames - 1) * fs + fs // 3])
    with mimi.streaming(rows):
        stream_codes = torch.cat([mimi.encode(wav[:, None, f * fs : (f + 1) * fs]) for f in range(frames)], -1)

    def stream_decode(c: torch.Tensor) -> torch.Tensor:
        with mimi.streaming(rows):
            return torch.cat([mimi.decode(c[..., f : f + 1])[:, 0] for f in range(frames)], -1)

    stream_audio = stream_decode(codes)
    g = torch.Generator().manual_seed(seed + 2)
    random_codes = torch.randint(0, mimi.cardinality, (rows, k, frames), generator=g)
    random_audio = mimi.decode(random_codes)[:, 0]
    random_stream_audio = stream_decode(random_codes)

    np.savez(
        out / "ref.npz",
        wav=wav.numpy(),
        codes=codes.numpy(),
        audio=audio.numpy(),
        tail_codes=tail_codes.numpy(),
        stream_codes=stream_codes.numpy(),
        stream_audio=stream_audio.numpy(),
        random_codes=random_codes.numpy(),
        random_audio=random_audio.numpy(),
        random_stream_audio=random_stream_audio.numpy(),
    )
    return {
        "frame_size": fs,
        "frame_rate": mimi.frame_rate,
        "cardinality": mimi.cardinality,
        "total_codebooks": mimi.total_codebooks,
        "audio_len": int(audio.shape[-1]),
        "distinct_codes_per_codebook": [int(codes[:, i].unique().numel()) for i in range(k)],
        "stream_codes_differ": int((stream_codes != codes).sum()),
        "stream_codes_first_diff_frame": int((stream_codes != codes).any(1).any(0).int().argmax())
        if (stream_codes != codes).any()
        else None,
        "stream_audio_max_diff": float((stream_audio - audio).abs().max()),
        "random_stream_audio_max_diff": float((random_stream_audio - random_audio).abs().max()),
        "audio_rms": float(audio.pow(2).mean().sqrt()),
        "audio_code_dependence": float((audio - random_audio).abs().max()),
        "random_audio_rms": float(random_audio.pow(2).mean().sqrt()),
        "transformer_context": cfg["transformer"].get("context"),
        "encoder_steps": int(math.ceil(frames * mimi.encoder_frame_rate / mimi.frame_rate)),
    }


def main() -> None:
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    spec = json.loads(spec_path.read_text())
    summary = {c["name"]: run_config(c, out_dir / c["name"]) for c in spec["configs"]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
