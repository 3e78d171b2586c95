"""What each simulated user does, drawn from a seeded generator: the mode, a shared voice prompt or none, turns
with the silence streamed before each, barge-ins, one silence with the microphone muted, and how it leaves."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Turn:
    utterance: int  # which speech clip the user says
    gap_s: float  # silence the microphone streams before it
    # turn mode: the user speaks the next turn this long after the reply's first audio (a barge-in); None: the user
    # listens to the reply's end (`reply_done`). The last turn never barges in.
    barge_in_s: float | None = None


@dataclass(frozen=True)
class Plan:
    mode: str  # "duplex" or "turn"
    voice: str | None  # a shared voice prompt (`s2s serve --prompts`), or none
    seed: int  # the conversation's sampling seed
    turns: tuple[Turn, ...]
    silent_before: int | None  # the turn before which the user is silent for `silent_s`, or never
    silent_s: float
    # During that silence the microphone sends nothing (a muted or stalled client), or streams silence. A duplex
    # stream that stops and goes on has every later frame counted late (`frame_deadline` counts from its first
    # frame as if its input had never stopped), so duplex users stream their silence unless `Mix.duplex_mute`.
    mute: bool
    leave: str  # "close" (a close frame) or "abort" (the TCP connection cut, no close frame)
    leave_mid_reply: bool  # turn mode: leave while the last reply plays, not after it

    def query(self) -> str:
        params = {"mode": self.mode, "codec": "pcm16", "seed": str(self.seed)}
        if self.voice is not None:
            params["voice"] = self.voice
        return "&".join(f"{k}={v}" for k, v in params.items())


@dataclass(frozen=True)
class Mix:
    """The shares and ranges plans are drawn from (uniform within each range)."""

    turn_share: float = 0.5  # turn mode; the rest duplex
    turns: tuple[int, int] = (2, 4)  # turns per conversation, inclusive
    gap_s: tuple[float, float] = (0.5, 2.0)
    barge_in: float = 0.3  # share of turns (all but the last) cut by the next one
    # After the reply's first audio. The server's VAD hears a new utterance only after `--vad-silence` (0.5 s) of
    # silence past the last one (which ended when the reply started), and replies last 3 s.
    barge_in_s: tuple[float, float] = (0.8, 2.0)
    silent: float = 0.3  # share of conversations that go silent once
    # Silent for this long: under the server's idle timeout (60 s by default), or it would close the muted ones.
    silent_s: tuple[float, float] = (5.0, 15.0)
    duplex_mute: bool = False  # duplex users mute their microphone to go silent, as turn-mode users do
    abort: float = 0.5  # share that leave without a close frame
    mid_reply: float = 0.25  # share of turn-mode conversations that leave while their last reply plays
    voices: tuple[str, ...] = ()  # the server's voice prompts
    voice_share: float = 2 / 3  # share of conversations that open with one of them


QUICK_MIX = Mix(turns=(1, 2), gap_s=(0.3, 1.0), silent_s=(1.5, 3.0))


def make_plan(rng: np.random.Generator, mix: Mix, clips: int, index: int) -> Plan:
    """The plan of the `index`-th client. Modes are dealt in their shares exactly (the first is turn mode, even in a
    short run); the rest is drawn from `rng`."""
    turn = math.ceil((index + 1) * mix.turn_share) > math.ceil(index * mix.turn_share)
    mode = "turn" if turn else "duplex"
    voice = str(rng.choice(mix.voices)) if mix.voices and rng.random() < mix.voice_share else None
    n = int(rng.integers(mix.turns[0], mix.turns[1] + 1))
    turns = []
    for i in range(n):
        barge = mode == "turn" and i < n - 1 and rng.random() < mix.barge_in
        turns.append(
            Turn(
                utterance=int(rng.integers(clips)),
                gap_s=float(rng.uniform(*mix.gap_s)),
                barge_in_s=float(rng.uniform(*mix.barge_in_s)) if barge else None,
            )
        )
    silent = rng.random() < mix.silent
    quiet_before = [i for i in range(n) if i == 0 or turns[i - 1].barge_in_s is None]  # not between a barge-in's two
    return Plan(
        mode=mode,
        voice=voice,
        seed=int(rng.integers(1 << 31)),
        turns=tuple(turns),
        silent_before=int(rng.choice(quiet_before)) if silent else None,
        silent_s=float(rng.uniform(*mix.silent_s)) if silent else 0.0,
        mute=mode == "turn" or mix.duplex_mute,
        leave="abort" if rng.random() < mix.abort else "close",
        leave_mid_reply=mode == "turn" and rng.random() < mix.mid_reply,
    )
