"""Conversations for training the echo model, laid out frame by frame as the engine lays them out (`Session`,
`TurnLifecycle`), with the label and loss mask of every model frame.

- Turn mode: a voice prompt (the user silent), then turns. While the user speaks, the model stream is forced
  silent, and what the model predicts there is the codec's `quiet` frame (what digital silence encodes to): the
  engine samples the reply's first frame at the turn's last step. So the reply is that quiet frame, then the turn's
  speech (its frames from the first loud one to the last), then END on codebook 0; after it both streams are silent
  for a few frames, as the engine fills them. Some replies are cut short (a barge-in) and the next turn follows at
  once.
- Duplex: the model stream is the user's, `delay` frames later; quiet frames before that (frame 0 is the engine's
  silent frame).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from s2s.models.config import ModelConfig


@dataclass
class Utterance:
    """One user turn's codes `[F, K]` and where its speech lies: frames `start` to `stop` (exclusive)."""

    codes: np.ndarray
    start: int
    stop: int


@dataclass
class Conversation:
    """Frame-level streams `[F, K]`: what the model reads (`user`, `model`), what it should predict (`label`), and
    which model frames the engine samples (`predicted`, the loss mask) and which of those it plays (`spoken`: the
    reply or the echo, not the listening aid)."""

    user: np.ndarray
    model: np.ndarray
    label: np.ndarray
    predicted: np.ndarray
    spoken: np.ndarray


class _Builder:
    def __init__(self, cfg: ModelConfig):
        self.cfg, self.user, self.model, self.label, self.predicted, self.spoken = cfg, [], [], [], [], []

    def add(self, user: np.ndarray, model: np.ndarray, label: np.ndarray | None = None, predicted=False) -> None:
        """Frames of both streams; without a `label`, what the model reads is what it should have said (spoken)."""
        n = len(user)
        self.user.append(user)
        self.model.append(model)
        self.label.append(model if label is None else label)
        mask = np.broadcast_to(np.asarray(predicted, dtype=bool), (n, self.cfg.num_codebooks))
        self.predicted.append(mask)
        self.spoken.append(mask & (label is None))

    def silent(self, n: int) -> np.ndarray:
        return np.full((n, self.cfg.num_codebooks), self.cfg.silent_id, dtype=np.int64)

    def build(self) -> Conversation:
        parts = (self.user, self.model, self.label, self.predicted, self.spoken)
        return Conversation(*(np.concatenate(x) for x in parts))


def turn_conversation(
    cfg: ModelConfig,
    turns: list[Utterance],
    prompt: np.ndarray | None,
    quiet: np.ndarray,
    rng: np.random.Generator,
    cut_rate: float,
) -> Conversation:
    b = _Builder(cfg)
    if prompt is not None:
        b.add(b.silent(len(prompt)), prompt)
    for i, turn in enumerate(turns):
        n = len(turn.codes)
        b.add(turn.codes, b.silent(n), np.tile(quiet, (n, 1)), predicted=True)
        first = quiet.copy()  # codebook 0 sampled while listening; the others once the reply starts: the speech's
        first[1:] = turn.codes[turn.start - 1, 1:] if turn.start else quiet[1:]  # delayed codebooks, one frame back
        speech = np.concatenate([first[None], turn.codes[turn.start : turn.stop]])
        if i < len(turns) - 1 and rng.random() < cut_rate:  # a barge-in: the next turn's audio follows at once
            played = int(rng.integers(1, len(speech) + 1))
            b.add(b.silent(played), speech[:played], predicted=True)
            continue
        b.add(b.silent(len(speech)), speech, predicted=True)
        end = np.array([[cfg.end_id] + [cfg.silent_id] * (cfg.num_codebooks - 1)])
        b.add(b.silent(1), end, predicted=np.arange(cfg.num_codebooks)[None] == 0)
        gap = int(rng.integers(1, 4))
        b.add(b.silent(gap), b.silent(gap))
    return b.build()


def duplex_conversation(
    cfg: ModelConfig, user: np.ndarray, prompt: np.ndarray | None, quiet: np.ndarray, delay: int
) -> Conversation:
    b = _Builder(cfg)
    p = 0 if prompt is None else len(prompt)
    if prompt is not None:
        b.add(b.silent(p), prompt)
    heard = np.concatenate([np.tile(quiet, (p, 1)), user])
    echo = np.concatenate([np.tile(quiet, (delay, 1)), heard[: len(heard) - delay]])[p:]
    mask = np.ones((len(user), 1), dtype=bool)
    if p == 0:
        echo[0], mask[0] = cfg.silent_id, False  # the engine forces model frame 0 silent
    b.add(user, echo, predicted=mask)
    return b.build()


def to_batch(
    cfg: ModelConfig, conversations: list[Conversation]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step tokens `[B, T, 2K]`, labels `[B, T, K]`, loss mask and spoken mask `[B, T, K]` for teacher forcing.

    Step t holds codebook k of frame t - delays[k] (`pad_id` before frame 0); its logits predict step t + 1's
    model codes, codebook k of frame t + 1 - delays[k]. Rows are padded at the end (masked out).
    """
    delays = np.asarray(cfg.delays)
    steps = max(len(c.user) for c in conversations) + int(delays.max())
    k = np.arange(cfg.num_codebooks)
    tokens = np.full((len(conversations), steps, cfg.step_width), cfg.pad_id, dtype=np.int64)
    labels = np.zeros((len(conversations), steps, cfg.num_codebooks), dtype=np.int64)
    mask = np.zeros((len(conversations), steps, cfg.num_codebooks), dtype=bool)
    spoken = np.zeros_like(mask)
    for row, c in enumerate(conversations):
        n = len(c.user)
        frames = np.arange(steps)[:, None] - delays[None, :]  # [T, K]: the frame each step holds
        inside = (frames >= 0) & (frames < n)
        f = np.clip(frames, 0, n - 1)
        tokens[row, :, : cfg.num_codebooks] = np.where(
            inside, c.user[f, k], np.where(frames < 0, cfg.pad_id, cfg.silent_id)
        )
        tokens[row, :, cfg.num_codebooks :] = np.where(
            inside, c.model[f, k], np.where(frames < 0, cfg.pad_id, cfg.silent_id)
        )
        nxt = frames + 1  # step t's logits: frame t + 1 - delays[k]
        ok = (nxt >= 0) & (nxt < n)
        g = np.clip(nxt, 0, n - 1)
        labels[row] = np.where(ok, c.label[g, k], 0)
        mask[row] = ok & c.predicted[g, k]
        spoken[row] = ok & c.spoken[g, k]
    return tuple(torch.from_numpy(x) for x in (tokens, labels, mask, spoken))
