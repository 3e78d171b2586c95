"""`s2s train codec`: a small EnCodec (transformers' architecture, 24 kHz, 320-sample frames) trained from scratch
on speech this machine makes (`speech/corpus.py`).

How it trains, and why:
- transformers' initialisation makes the signal fall about 100x through the encoder and the codes collapse, so
  convolutions are re-initialised (Kaiming) and each residual branch starts at a tenth of its size;
- an autoencoder warm-up (no quantizer) comes first, then codebooks are seeded by k-means on the latents and
  trained by EMA (`codec/quantizer_train.py`);
- bandwidth dropout: each step quantizes with 2, 4, 8, 16 or 32 codebooks (1.5 to 24 kbps), as EnCodec trains,
  with the default 1.5 kbps drawn most often;
- the loss is a multi-scale mel loss (`codec/losses.py`) plus the waveform's L1 and the commitment loss.
Weight norm is folded into plain weights while training and restored on save.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import EncodecConfig, EncodecModel

from codec.losses import MultiScaleMelLoss
from codec.pcm import SAMPLE_RATE
from codec.quantizer_train import kmeans_init, quantize
from codec.tokenizer import BANDWIDTHS, _weight_normed_convs
from speech.corpus import build_corpus

ROOT = Path(__file__).resolve().parents[1]


def _in_repository(path: Path) -> str | None:
    """`path` relative to the repository, as `training.json` records it; None for a path outside it (a machine's
    cache or temporary folder, which another machine would not have)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else None


QUANTIZER_CHOICES = (2, 4, 8, 16, 32)  # codebooks at 1.5, 3, 6, 12, 24 kbps
QUANTIZER_WEIGHTS = (0.4, 0.15, 0.15, 0.15, 0.15)
COMMIT_WEIGHT = 1.0
WAVE_WEIGHT = 0.1


def codec_config(num_filters: int, hidden_size: int) -> EncodecConfig:
    return EncodecConfig(
        num_filters=num_filters,
        hidden_size=hidden_size,
        codebook_dim=hidden_size,
        target_bandwidths=list(BANDWIDTHS),
        use_causal_conv=True,
        normalize=False,
    )


def fresh_model(cfg: EncodecConfig, seed: int) -> EncodecModel:
    """An EncodecModel that trains: plain convolutions, Kaiming-initialised, residual branches scaled to 0.1."""
    torch.manual_seed(seed)
    model = EncodecModel(cfg)
    for conv in _weight_normed_convs(model):
        torch.nn.utils.parametrize.remove_parametrizations(conv, "weight", leave_parametrized=True)
    for m in model.modules():
        if isinstance(m, nn.Conv1d | nn.ConvTranspose1d):
            nn.init.kaiming_normal_(
                m.weight, nonlinearity="relu", mode="fan_in" if isinstance(m, nn.Conv1d) else "fan_out"
            )
            nn.init.zeros_(m.bias)
    for name, m in model.named_modules():
        if name.endswith(".block") and isinstance(m, nn.ModuleList):
            with torch.no_grad():
                m[-1].conv.weight.mul_(0.1)
    return model


def segments(audio: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    """`batch` random windows of `length` samples, each scaled to a random peak in [0.1, 0.95]."""
    starts = rng.integers(0, len(audio) - length, batch)
    wav = np.stack([audio[s : s + length] for s in starts])
    peaks = np.abs(wav).max(1, keepdims=True).clip(1e-3)
    return torch.from_numpy(wav / peaks * rng.uniform(0.1, 0.95, (batch, 1))).float()


def train(args: argparse.Namespace) -> Path:

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    pick = random.Random(args.seed)
    started = time.time()
    audio, _ = build_corpus(args.data, args.speech_minutes, args.seed)
    print(f"corpus: {len(audio) / SAMPLE_RATE / 60:.1f} min of speech in {args.data} ({time.time() - started:.0f} s)")
    model = fresh_model(codec_config(args.num_filters, args.hidden_size), args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"codec: num_filters {args.num_filters}, hidden {args.hidden_size}, {params / 1e6:.2f}M parameters")
    mel_loss = MultiScaleMelLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.8, 0.99), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    )
    length = int(args.segment_s * SAMPLE_RATE)
    log = []
    model.train()
    for step in range(args.steps):
        if step == args.warmup_steps:
            with torch.no_grad():
                latents = torch.cat(
                    [model.encoder(segments(audio, args.batch, length, rng)[:, None]) for _ in range(8)]
                )
            kmeans_init(model, latents.transpose(1, 2).reshape(-1, latents.shape[1]), seed=args.seed)
            print(f"step {step}: codebooks seeded by k-means on {latents.shape[0] * latents.shape[2]} latent frames")
        wav = segments(audio, args.batch, length, rng)
        latents = model.encoder(wav[:, None])
        if step >= args.warmup_steps:
            n_q = pick.choices(QUANTIZER_CHOICES, QUANTIZER_WEIGHTS)[0]
            latents, commit = quantize(model, latents, n_q, update=True)
        else:
            n_q, commit = 0, latents.new_zeros(())
        out = model.decoder(latents)[:, 0, :length]
        mel = mel_loss(out, wav)
        loss = mel + WAVE_WEIGHT * (out - wav).abs().mean() + COMMIT_WEIGHT * commit
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        log.append({"step": step, "loss": loss.item(), "mel": mel.item(), "commit": commit.item(), "n_q": n_q})
        if step % args.log_every == 0 or step == args.steps - 1:
            recent = log[-args.log_every :]
            print(
                f"step {step:5d}  loss {np.mean([r['loss'] for r in recent]):.3f}  "
                f"mel {np.mean([r['mel'] for r in recent]):.3f}  commit {np.mean([r['commit'] for r in recent]):.4f}"
                f"  {time.time() - started:.0f} s",
                flush=True,
            )
        if args.save_every and step and step % args.save_every == 0:
            save(model, args.out, args, log, time.time() - started)
    return save(model, args.out, args, log, time.time() - started)


def save(model: EncodecModel, out: Path, args: argparse.Namespace, log: list[dict], seconds: float) -> Path:
    """The codec as an fp16 Hugging Face folder (weight norm restored; codebooks without their EMA statistics, which
    only training needs) and `training.json`: the command's arguments, its time and its loss curve."""
    was_training = model.training
    saved = copy.deepcopy(model).eval()
    for m in saved.modules():
        if isinstance(m, nn.Conv1d | nn.ConvTranspose1d):
            nn.utils.parametrizations.weight_norm(m)
    state = {
        k: v.half() for k, v in saved.state_dict().items() if not k.endswith(("embed_avg", "cluster_size", "inited"))
    }
    out.mkdir(parents=True, exist_ok=True)
    saved.save_pretrained(out, state_dict=state)
    every = max(1, args.log_every)
    curve = [
        {"step": log[i]["step"], "loss": float(np.mean([r["loss"] for r in log[i : i + every]]))}
        for i in range(0, len(log), every)
    ]
    record = {
        "command": "s2s train codec " + " ".join(args.argv),
        "arguments": {
            k: _in_repository(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("func", "argv")
        },
        "steps_done": len(log),
        "seconds": round(seconds, 1),
        "torch_threads": torch.get_num_threads(),
        "loss_curve": curve,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    model.train(was_training)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="s2s train codec", description="a small EnCodec trained on speech this machine makes"
    )
    p.add_argument("--out", type=Path, required=True, help="folder to write (EncodecModel.from_pretrained loads it)")
    p.add_argument("--data", type=Path, default=Path.home() / ".cache" / "s2s" / "speech-corpus", help="corpus cache")
    p.add_argument("--speech-minutes", type=float, default=60.0, help="minutes of synthetic speech to train on")
    p.add_argument("--steps", type=int, default=12000)
    p.add_argument("--warmup-steps", type=int, default=1500, help="autoencoder steps before the quantizer")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--segment-s", type=float, default=0.5, help="seconds of audio per batch row")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num-filters", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=64, help="latent and codebook width")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=1000, help="write the folder every N steps (0: at the end only)")
    p.add_argument("--quick", action="store_true", help="a minute-long run on a small corpus (CI): the loss falls")
    return p


QUICK = {  # `--quick`'s defaults (what is given stays); its corpus goes in the output folder
    "data": None,
    "speech_minutes": 0.5,
    "steps": 60,
    "warmup_steps": 20,
    "batch": 4,
    "segment_s": 0.5,
    "log_every": 10,
    "save_every": 0,
}


def main(argv: list[str]) -> None:
    p = parser()
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.argv = argv
    if args.data is None:
        args.data = args.out / "corpus"
    if args.warmup_steps >= args.steps:
        raise SystemExit("--warmup-steps must be fewer than --steps")
    out = train(args)
    record = json.loads((out / "training.json").read_text())
    curve = record["loss_curve"]
    print(f"wrote {out} in {record['seconds']:.0f} s; loss {curve[0]['loss']:.3f} -> {curve[-1]['loss']:.3f}")
