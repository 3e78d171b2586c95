"""The calls that change a conversation, as commands: one frozen dataclass each, naming the conversation (`cid`).

`Engine.submit` checks a command in the caller's thread and queues it for the engine's next tick, which applies it
(`s2s/engine/handlers.py`). A front end's `EngineClient.submit` checks the same command and sends it, pickled, to the
`EngineCore`, which submits it to its engine. Both check it here, the one place for each rule: `checked` for the
arguments (a ValueError), then `check_mode` against the conversation's mode (a ValueError for a turn-mode call on a
duplex conversation); a conversation that is not open is a KeyError (`not_open`). What only the engine thread can
know (no such turn, a reply still playing) becomes an error event there.

`Calls` is the engine's public calls that make them, shared by `Engine` and `EngineClient`. Light to import: a
front-end process imports this module, never the engine, the model or the codec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from codec.pcm import SAMPLE_RATE, checked_audio

if TYPE_CHECKING:
    import torch

    from s2s.models.config import ModelConfig
    from s2s.runner.sampling import SamplingParams


def not_open(cid: str) -> KeyError:
    return KeyError(f"no open session {cid!r}")


@dataclass(frozen=True)
class Command:
    cid: str
    turn_mode_only: ClassVar[bool] = False  # a turn-mode call: a duplex conversation's caller gets a ValueError
    wakes: ClassVar[bool] = False  # the engine ticks at once, not at its next tick's time

    @property
    def call(self) -> str:
        """The call that makes it, for messages: `EndTurn` -> end_turn."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()

    def checked(self, config: ModelConfig, has_codec: bool) -> Command:
        """This command with its arguments as the engine takes them, or a ValueError saying what is wrong."""
        return self

    def check_mode(self, mode: str) -> None:
        """A ValueError unless a conversation in `mode` takes this command."""
        if self.turn_mode_only and mode != "turn":
            raise ValueError(f"{self.call} is for turn mode")


@dataclass(frozen=True, eq=False)
class Push(Command):
    """User input (`data`), taken in the next tick as it is. `pushed_at`: when the engine took it (`Engine.submit`
    sets it, on its own clock)."""

    pushed_at: float = field(default=0.0, kw_only=True)
    kind: ClassVar[str]  # what the conversation is fed: fixed by its first push

    @property
    def data(self) -> np.ndarray:
        raise NotImplementedError

    def seconds(self, frame_s: float) -> float:
        """The input's duration, at `frame_s` a frame (the engine's)."""
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class PushAudio(Push):
    pcm: np.ndarray
    kind: ClassVar[str] = "audio"

    @property
    def data(self) -> np.ndarray:
        return self.pcm

    def seconds(self, frame_s: float) -> float:
        return len(self.pcm) / SAMPLE_RATE

    def checked(self, config: ModelConfig, has_codec: bool) -> PushAudio:
        if not has_codec:
            raise ValueError("this engine has no codec: feed it codes with push_codes")
        return replace(self, pcm=checked_audio(self.pcm))


@dataclass(frozen=True, eq=False)
class PushCodes(Push):
    codes: np.ndarray
    kind: ClassVar[str] = "codes"

    @property
    def data(self) -> np.ndarray:
        return self.codes

    def seconds(self, frame_s: float) -> float:
        return self.codes.shape[1] * frame_s

    def checked(self, config: ModelConfig, has_codec: bool) -> PushCodes:
        return replace(self, codes=config.checked_codes(self.codes, "codes"))


@dataclass(frozen=True)
class EndTurn(Command):
    turn_mode_only = True
    wakes = True  # its reply starts now, not up to a tick later


@dataclass(frozen=True)
class Commit(Command):
    turn_mode_only = True


@dataclass(frozen=True)
class ClearInput(Command):
    turn_mode_only = True


@dataclass(frozen=True)
class Remove(Command):
    turn: int
    part: str  # "user" or "reply"
    keep_frames: int = 0
    turn_mode_only = True

    def checked(self, config: ModelConfig, has_codec: bool) -> Remove:
        if self.part not in ("user", "reply") or self.keep_frames < 0:
            raise ValueError(f"part must be user or reply and keep_frames >= 0, got {self.part!r}, {self.keep_frames}")
        return self


@dataclass(frozen=True)
class Interrupt(Command):
    played_frames: int


@dataclass(frozen=True)
class Regenerate(Command):
    turn_mode_only = True


@dataclass(frozen=True)
class SetSampling(Command):
    sampling: SamplingParams


@dataclass(frozen=True)
class Pause(Command):
    paused: bool = True  # False: unpause


@dataclass(frozen=True)
class Restart(Command):
    pass


@dataclass(frozen=True)
class Close(Command):
    keep: bool = False  # its context is kept for a resume (`Resumable`); a server, which never resumes, keeps none


class Calls:
    """The calls that change a conversation: each makes its command and `submit`s it (any thread, never waits)."""

    def submit(self, command: Command) -> None:
        raise NotImplementedError

    def push_audio(self, cid: str, pcm: np.ndarray) -> None:
        """User PCM (float32, 24 kHz, any length, in [-1, 1]); encoded in the next tick with everyone else's. Bad
        samples raise `ValueError` here, in the caller's thread: the codec would raise in the engine's."""
        self.submit(PushAudio(cid, pcm))

    def push_codes(self, cid: str, codes: np.ndarray | torch.Tensor) -> None:
        """User frames given as codes `[K, n]` (ids below `codebook_size`), taken in the next tick as they are: the
        input of a codec-free engine, or text bytes fed to a speech model as its user stream."""
        self.submit(PushCodes(cid, codes))

    def end_turn(self, cid: str) -> None:
        """Turn mode: the user finished speaking; the reply starts once their audio is in (`no_reply` event: there
        is nothing new to answer)."""
        self.submit(EndTurn(cid))

    def commit(self, cid: str) -> None:
        """Turn mode: the user's audio so far is one turn, to be answered by a later `end_turn` (the Realtime API's
        commit without a response); the next audio opens another turn. A `committed` event answers each commit,
        naming the turn, or None when there was nothing to close (no speech since the last turn, or a reply plays)."""
        self.submit(Commit(cid))

    def clear_input(self, cid: str) -> None:
        """Turn mode: drop the user's audio since the last closed turn (pushed, or heard while listening)."""
        self.submit(ClearInput(cid))

    def remove(self, cid: str, turn: int, part: str, keep_frames: int = 0) -> None:
        """Turn mode: take turn `turn`'s user audio (`part="user"`) or its reply after its first `keep_frames`
        frames (`part="reply"`) out of the context. What follows is computed again, its frames kept; a reply still
        playing is cut as at a barge-in. What cannot be removed (a reply playing after it, frames that left the
        context window) gets an error event."""
        self.submit(Remove(cid, turn, part, keep_frames))

    def interrupt(self, cid: str, played_frames: int) -> None:
        """Barge-in: cancel the reply and keep in the context only the `played_frames` frames the user heard."""
        self.submit(Interrupt(cid, played_frames))

    def regenerate(self, cid: str) -> None:
        """Turn mode: drop the last reply and generate it again (a new draw unless sampling is greedy or seeded);
        everything before the reply keeps its K/V. A session with no finished reply gets an error event."""
        self.submit(Regenerate(cid))

    def set_sampling(self, cid: str, sampling: SamplingParams) -> None:
        """How the conversation's next frames are drawn (a seed starts its generator again)."""
        self.submit(SetSampling(cid, sampling))

    def pause(self, cid: str) -> None:
        """Stop the conversation's stream: nothing is computed for it, input pushed meanwhile is dropped, and its
        context is kept (its pages are the first to go when the pool runs short: it recomputes them on `unpause`)."""
        self.submit(Pause(cid))

    def unpause(self, cid: str) -> None:
        """Start a paused conversation's stream again where it stopped; its frame deadlines count from now."""
        self.submit(Pause(cid, paused=False))

    def restart(self, cid: str) -> None:
        """Take the conversation back to its voice prompt: the rest of its context goes, turns count from 0."""
        self.submit(Restart(cid))

    def close(self, cid: str, keep: bool = False) -> None:
        """End the conversation: its context goes into the prefix cache, its private pages are freed, and its event
        queue ends with None. `keep`: its context is kept too, so that `open(session_id=cid, resume=True)` can reopen
        it, within `session_ttl_s` and while it is among the `resumable_conversations` latest kept (and their
        `resumable_bytes`)."""
        self.submit(Close(cid, keep))
