"""`s2s train echo`: an `S2SModel` that echoes its user, made from codes of the shipped codec.

- Turn mode: it replays the user's speech after the turn ends, then ends its reply (END).
- Duplex: it repeats the user 38 frames (half a second) later.

Replaying a turn of any length is a copy by content (an induction head), which a randomly initialised model finds
late and unreliably. So the circuit is planted (`echo_init.py`) from what `speech_codes` measures of the codec
on training speech (its quiet and loud codes); `--steps` can then tune the readout, teacher-forced (`tune`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from codec import EncodecTokenizer
from s2s.models.config import ModelConfig
from s2s.models.model import S2SModel
from s2s.models.shipped import CODEC
from s2s.training.echo_data import Conversation, Utterance, duplex_conversation, to_batch, turn_conversation
from s2s.training.echo_init import DUPLEX_DELAY, ECHO_CONFIG, planted_init, silence_idle_units
from speech.sentences import training_sentences
from speech.voices import RATE, TRAIN_VOICES, Voice, say

ROOT = Path(__file__).resolve().parents[2]


def _in_repository(path: Path) -> str | None:
    """`path` relative to the repository, as `training.json` records it; None for a path outside it (a machine's
    cache or temporary folder, which another machine would not have)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else None


@dataclass
class Speech:
    """Training speech as codes, and what the circuit needs to know about the codec's codes."""

    utterances: list[Utterance]
    quiet: np.ndarray  # [K]: the codes of digital silence
    loud: np.ndarray  # [K, codebook_size] booleans: codes seen mostly inside speech


def conversation(cfg: ModelConfig, speech: Speech, rng: np.random.Generator) -> Conversation:
    """A voice prompt of up to 60 frames 3 times in 10; duplex 1 in 4; else one turn, or two 4 times in 10."""
    pick = speech.utterances

    def one() -> Utterance:
        return pick[int(rng.integers(len(pick)))]

    prompt = one().codes[: int(rng.integers(10, 61))] if rng.random() < 0.3 else None
    if rng.random() < 0.25:
        return duplex_conversation(cfg, one().codes, prompt, speech.quiet, DUPLEX_DELAY)
    turns = [one() for _ in range(1 + int(rng.random() < 0.4))]
    return turn_conversation(cfg, turns, prompt, speech.quiet, rng, cut_rate=0.3)


def readout(model: S2SModel) -> list[torch.Tensor]:
    """What `--steps` tunes: the last MLP and the output heads, which read the circuit's result. The attention stays
    as planted: its "most recent" heads hang on exact flag values, which a gradient step would blur."""
    model.requires_grad_(False)
    tuned = [model.heads, *model.backbone.layers[-1].mlp.parameters()]
    for p in tuned:
        p.requires_grad_(True)
    return tuned


def loss_and_accuracy(model: S2SModel, batch: list[Conversation]) -> tuple[torch.Tensor, float]:
    """Cross-entropy over every predicted frame, and the accuracy of the spoken ones (argmax = label)."""
    tokens, labels, mask, spoken = to_batch(model.config, batch)
    logits = model(tokens)  # [B, T, K, V]
    loss = F.cross_entropy(logits[mask].float(), labels[mask])
    accuracy = (logits[spoken].argmax(-1) == labels[spoken]).float().mean().item()
    return loss, accuracy


def speech_codes(codec_folder: Path, count: int, seed: int) -> Speech:
    """`count` clean training sentences (3 to 7 words) in training voices, between 0-0.3 s of silence before and
    0.1-0.6 s after, as codes of the codec at 1.5 kbps. A codebook-0 code is loud when over three in four of the
    frames it codes have a peak of 1e-3 or more (codebook 1: ten in eleven); an utterance's speech runs from its
    first frame with a loud codebook-0 code to its last."""

    tok = EncodecTokenizer.from_pretrained(codec_folder, bandwidth=1.5)
    rng = np.random.default_rng(seed)
    clips, inside = [], np.zeros((tok.num_codebooks, tok.codebook_size))
    outside = np.zeros_like(inside)
    for text in tqdm(training_sentences(count, seed + 1, words=(3, 7)), desc="speech codes", unit="sentence"):
        base = TRAIN_VOICES[int(rng.integers(len(TRAIN_VOICES)))]
        pcm = say(text, Voice(base.engine, base.name, int(rng.integers(120, 181))))
        lead, trail = int(rng.uniform(0, 0.3) * RATE), int(rng.uniform(0.1, 0.6) * RATE)
        audio = np.concatenate([np.zeros(lead, np.float32), pcm, np.zeros(trail, np.float32)])
        codes = tok.encode(audio)[0].T.numpy()  # [F, K]
        frames = len(audio) // tok.frame_size
        loud = np.abs(audio[: frames * tok.frame_size]).reshape(frames, -1).max(1) >= 1e-3
        for k in range(tok.num_codebooks):
            np.add.at(inside[k], codes[:frames, k][loud], 1)
            np.add.at(outside[k], codes[:frames, k][~loud], 1)
        clips.append(codes)
    loud_codes = inside > np.array([[3], [10]]) * outside  # codebook 1 stricter: its loud codes mark speech going on
    utterances = []
    for codes in clips:
        loud = np.flatnonzero(loud_codes[0][codes[:, 0]])
        if len(loud):
            utterances.append(Utterance(codes, int(loud[0]), int(loud[-1]) + 1))
    quiet = tok.encode(np.zeros(RATE, np.float32))[0, :, -1].numpy()
    return Speech(utterances, quiet, loud_codes)


def train(args: argparse.Namespace) -> Path:
    torch.set_num_threads(args.threads)
    started = time.time()
    speech = speech_codes(args.codec, args.sentences, args.seed)
    cut = max(1, len(speech.utterances) // 20)
    held_out = dataclasses.replace(speech, utterances=speech.utterances[:cut])
    speech.utterances = speech.utterances[cut:]
    print(
        f"speech codes: {len(speech.utterances)} sentences to train on, {cut} to check ({time.time() - started:.0f} s)"
    )
    cfg = ModelConfig(**ECHO_CONFIG, num_codebooks=len(speech.quiet))
    model = S2SModel(cfg)
    planted_init(model, args.seed, speech.quiet, speech.loud)
    rng, check_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    check_batch = [conversation(cfg, held_out, check_rng) for _ in range(args.batch)]
    with torch.no_grad():
        _, planted = loss_and_accuracy(model, check_batch)
    print(f"planted: held-out speech {planted:.3f} (teacher-forced accuracy of the spoken frames)", flush=True)
    log = [{"step": -1, "held_out_accuracy": planted}]
    if args.steps:
        log += tune(model, speech, check_batch, rng, args, started)
    return save(model, args, log, time.time() - started)


def tune(
    model: S2SModel,
    speech: Speech,
    check_batch: list,
    rng: np.random.Generator,
    args: argparse.Namespace,
    started: float,
) -> list[dict]:
    """Gradient steps on the readout (`readout`), teacher-forced on speech conversations."""
    model.train()
    opt = torch.optim.AdamW(readout(model), lr=args.lr, weight_decay=0.0)
    warmup = max(1, min(50, args.steps // 5))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    )
    log = []
    for step in range(args.steps):
        loss, accuracy = loss_and_accuracy(model, [conversation(model.config, speech, rng) for _ in range(args.batch)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        log.append({"step": step, "loss": loss.item(), "accuracy": accuracy})
        if step % args.log_every == 0 or step == args.steps - 1:
            with torch.no_grad():
                _, held = loss_and_accuracy(model, check_batch)
            recent = log[-args.log_every :]
            log[-1]["held_out_accuracy"] = held
            print(
                f"step {step:5d}  loss {np.mean([r['loss'] for r in recent]):.3f}  "
                f"spoken accuracy {np.mean([r['accuracy'] for r in recent]):.3f}  held-out speech {held:.3f}  "
                f"{time.time() - started:.0f} s",
                flush=True,
            )
    return log


def save(model: S2SModel, args: argparse.Namespace, log: list[dict], seconds: float) -> Path:
    silence_idle_units(model)
    model.eval().half().save_pretrained(args.out)  # fp16: the shipped weights are small; loading casts back
    every = max(1, args.log_every)
    tuned = [r for r in log if "loss" in r]
    record = {
        "command": "s2s train echo " + " ".join(args.argv),
        "arguments": {
            k: _in_repository(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("argv",)
        },
        "seconds": round(seconds, 1),
        "torch_threads": torch.get_num_threads(),
        "loss_curve": [
            {"step": tuned[i]["step"], "loss": float(np.mean([r["loss"] for r in tuned[i : i + every]]))}
            for i in range(0, len(tuned), every)
        ],
        "held_out_accuracy": [
            {"step": r["step"], "accuracy": r["held_out_accuracy"]} for r in log if "held_out_accuracy" in r
        ],
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return args.out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s2s train echo", description="an S2S model that echoes its user")
    p.add_argument("--out", type=Path, required=True, help="folder to write (S2SModel.from_pretrained loads it)")
    p.add_argument("--codec", type=Path, default=CODEC, help="the codec whose codes it learns (default: shipped)")
    p.add_argument("--sentences", type=int, default=1500, help="training sentences to encode")
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="gradient steps on the readout after planting (default none: tuning teacher-forced made free-running "
        "replies worse, see docs/DESIGN.md)",
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="a minute-long run (CI): the loss falls")
    return p


QUICK = {"sentences": 12, "steps": 30, "batch": 4, "log_every": 10}  # `--quick`'s defaults (what is given stays)


def main(argv: list[str]) -> None:
    p = parser()
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.argv = argv
    out = train(args)
    record = json.loads((out / "training.json").read_text())
    curve, held = record["loss_curve"], record["held_out_accuracy"]
    tuned = f"; loss {curve[0]['loss']:.3f} -> {curve[-1]['loss']:.3f}" if curve else ""
    print(f"wrote {out} in {record['seconds']:.0f} s; held-out speech {held[-1]['accuracy']:.3f}{tuned}")
