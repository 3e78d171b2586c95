"""`s2s train echo`: an `S2SModel` that echoes its user, trained on codes from the shipped codec.

- Turn mode: it replays the user's speech after the turn ends, then ends its reply (END).
- Duplex: it repeats the user `--delay` frames later.

Replaying a turn of any length is a copy by content (an induction head: find where the user said what I just said,
say what came next), which a randomly initialised model finds slowly. Two things make it quick: each model-stream
embedding table starts as a copy of the user-stream table for the same codebook, and each output head as that table
too, so "the same code" is visible from the first step; and a curriculum: random codes over a small vocabulary and
short turns first, then all 1,024 values, then real speech codes from the codec (`--codec`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from s2s.config import ModelConfig
from s2s.echo_data import Conversation, Utterance, duplex_conversation, to_batch, turn_conversation
from s2s.model import S2SModel

DELAY_FRAMES = 38  # the duplex echo's delay: about half a second at 75 frames a second
ADVANCE_AT = 0.9  # spoken accuracy at which the curriculum moves to its next stage


def tied_init(model: S2SModel, seed: int) -> None:
    """Llama's normal(0, 0.02) init, then the model stream's tables and the heads made copies of the user's."""
    cfg = model.config
    with torch.no_grad():
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.normal_(p, std=0.02)
        k = cfg.num_codebooks
        model.embeddings[k:] = model.embeddings[:k]
        model.heads.copy_(model.embeddings[:k])


def random_utterance(rng: np.random.Generator, values: int, length: tuple[int, int], silence: np.ndarray) -> Utterance:
    """Random codes in [0, values) for the speech, with up to 6 frames of `silence` codes before and after."""
    n = int(rng.integers(*length))
    lead, trail = int(rng.integers(0, 7)), int(rng.integers(1, 7))
    speech = rng.integers(0, values, (n, len(silence)))
    codes = np.concatenate([np.tile(silence, (lead, 1)), speech, np.tile(silence, (trail, 1))])
    return Utterance(codes, lead, lead + n)


class Curriculum:
    """What a step trains on, stage by stage: random codes over more values and longer turns, then speech. A stage
    ends when the spoken accuracy over its last 50 steps reaches `ADVANCE_AT`, or at its share of the steps."""

    def __init__(self, cfg: ModelConfig, stages: list[dict], speech: list[Utterance], silence: np.ndarray):
        self.cfg, self.stages, self.speech, self.silence = cfg, stages, speech, silence
        self.current, self.recent = 0, []

    @property
    def stage(self) -> dict:
        return self.stages[self.current]

    def record(self, step: int, accuracy: float) -> None:
        self.recent = (self.recent + [accuracy])[-50:]
        done = len(self.recent) == 50 and np.mean(self.recent) >= ADVANCE_AT
        if self.current < len(self.stages) - 1 and (done or step + 1 >= self.stages[self.current]["until"]):
            self.current, self.recent = self.current + 1, []

    def utterance(self, stage: dict, rng: np.random.Generator) -> Utterance:
        if stage["values"] == "speech":
            return self.speech[int(rng.integers(len(self.speech)))]
        return random_utterance(rng, stage["values"], stage["length"], self.silence)

    def conversation(self, rng: np.random.Generator) -> Conversation:
        """A voice prompt of up to 60 frames 3 times in 10; duplex 1 in 4; else one turn, or two 4 times in 10."""
        stage = self.stage
        prompt = None
        if rng.random() < 0.3:
            prompt = self.utterance(stage, rng).codes[: int(rng.integers(10, 61))]
        if rng.random() < 0.25:
            return duplex_conversation(self.cfg, self.utterance(stage, rng).codes, prompt, DELAY_FRAMES)
        turns = [self.utterance(stage, rng) for _ in range(1 + int(rng.random() < 0.4))]
        return turn_conversation(self.cfg, turns, prompt, rng, cut_rate=0.3)


def loss_and_accuracy(model: S2SModel, batch: list[Conversation]) -> tuple[torch.Tensor, float]:
    """Cross-entropy over every predicted frame, and the accuracy of the spoken ones (argmax = label)."""
    tokens, labels, mask, spoken = to_batch(model.config, batch)
    logits = model(tokens)  # [B, T, K, V]
    loss = F.cross_entropy(logits[mask].float(), labels[mask])
    accuracy = (logits[spoken].argmax(-1) == labels[spoken]).float().mean().item()
    return loss, accuracy


def speech_utterances(codec_folder: Path, count: int, seed: int) -> tuple[list[Utterance], np.ndarray]:
    """`count` clean training sentences (3 to 7 words) in training voices, between 0-0.3 s of silence before and
    0.1-0.6 s after, as codes of the codec at 1.5 kbps; the speech span is where a frame's peak reaches 1e-3. Also
    the codes of digital silence (what the random-code stages use as silence)."""
    from codec import EncodecTokenizer
    from speech.sentences import training_sentences
    from speech.voices import RATE, TRAIN_VOICES, Voice, say

    tok = EncodecTokenizer.from_pretrained(codec_folder, bandwidth=1.5)
    rng = np.random.default_rng(seed)
    out = []
    for text in tqdm(training_sentences(count, seed + 1, words=(3, 7)), desc="speech codes", unit="sentence"):
        base = TRAIN_VOICES[int(rng.integers(len(TRAIN_VOICES)))]
        pcm = say(text, Voice(base.engine, base.name, int(rng.integers(120, 181))))
        lead, trail = int(rng.uniform(0, 0.3) * RATE), int(rng.uniform(0.1, 0.6) * RATE)
        audio = np.concatenate([np.zeros(lead, np.float32), pcm, np.zeros(trail, np.float32)])
        codes = tok.encode(audio)[0].T.numpy()  # [F, K]
        frames = len(audio) // tok.frame_size
        peaks = np.abs(audio[: frames * tok.frame_size]).reshape(frames, -1).max(1)
        loud = np.flatnonzero(peaks >= 1e-3)
        out.append(Utterance(codes, int(loud[0]), int(loud[-1]) + 1))
    silence = tok.encode(np.zeros(RATE, np.float32))[0, :, -1].numpy()
    return out, silence


def stages(steps: int) -> list[dict]:
    """The curriculum over `steps`: random codes of 16 values (the copy forms), of all 1,024, then speech; each
    random stage ends by 35 and 60 % of the steps at the latest."""
    return [
        {"until": int(steps * 0.35), "values": 16, "length": (8, 40)},
        {"until": int(steps * 0.6), "values": 1024, "length": (8, 80)},
        {"until": steps, "values": "speech"},
    ]


def train(args: argparse.Namespace) -> Path:
    torch.set_num_threads(args.threads)
    started = time.time()
    speech, silence = speech_utterances(args.codec, args.sentences, args.seed)
    held_out, speech = speech[: max(1, len(speech) // 20)], speech[max(1, len(speech) // 20) :]
    print(
        f"speech codes: {len(speech)} sentences to train on, {len(held_out)} to check ({time.time() - started:.0f} s)"
    )
    cfg = ModelConfig(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        head_dim=args.hidden_size // args.heads,
        intermediate_size=3 * args.hidden_size,
        num_codebooks=len(silence),
    )
    model = S2SModel(cfg)
    tied_init(model, args.seed)
    model.train().requires_grad_(True)
    curriculum = Curriculum(cfg, stages(args.steps), speech, silence)
    checks = Curriculum(cfg, [{"until": 1, "values": "speech"}], held_out, silence)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    )
    rng, check_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    check_batch = [checks.conversation(check_rng) for _ in range(args.batch)]
    log = []
    for step in range(args.steps):
        loss, accuracy = loss_and_accuracy(model, [curriculum.conversation(rng) for _ in range(args.batch)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        stage = curriculum.stage["values"]
        log.append({"step": step, "loss": loss.item(), "accuracy": accuracy, "stage": stage})
        curriculum.record(step, accuracy)
        if step % args.log_every == 0 or step == args.steps - 1:
            with torch.no_grad():
                _, held = loss_and_accuracy(model, check_batch)
            recent = log[-args.log_every :]
            log[-1]["held_out_accuracy"] = held
            print(
                f"step {step:5d} ({stage})  loss {np.mean([r['loss'] for r in recent]):.3f}  "
                f"spoken accuracy {np.mean([r['accuracy'] for r in recent]):.3f}  held-out speech {held:.3f}  "
                f"{time.time() - started:.0f} s",
                flush=True,
            )
    return save(model, args, log, time.time() - started)


def save(model: S2SModel, args: argparse.Namespace, log: list[dict], seconds: float) -> Path:
    model.eval()
    model.save_pretrained(args.out)
    every = max(1, args.log_every)
    record = {
        "command": "s2s train echo " + " ".join(args.argv),
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("argv",)},
        "seconds": round(seconds, 1),
        "torch_threads": torch.get_num_threads(),
        "loss_curve": [
            {"step": log[i]["step"], "loss": float(np.mean([r["loss"] for r in log[i : i + every]]))}
            for i in range(0, len(log), every)
        ],
        "held_out_accuracy": [
            {"step": r["step"], "accuracy": r["held_out_accuracy"]} for r in log if "held_out_accuracy" in r
        ],
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return args.out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s2s train echo", description="an S2S model that echoes its user")
    from s2s.weights import CODEC

    p.add_argument("--out", type=Path, required=True, help="folder to write (S2SModel.from_pretrained loads it)")
    p.add_argument("--codec", type=Path, default=CODEC, help="the codec whose codes it learns (default: shipped)")
    p.add_argument("--sentences", type=int, default=1500, help="training sentences to encode")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="a minute-long run (CI): the loss falls")
    return p


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    args.argv = argv
    if args.quick:
        args.sentences, args.steps, args.batch, args.log_every = 16, 40, 4, 10
    out = train(args)
    record = json.loads((out / "training.json").read_text())
    curve = record["loss_curve"]
    print(f"wrote {out} in {record['seconds']:.0f} s; loss {curve[0]['loss']:.3f} -> {curve[-1]['loss']:.3f}")
