"""The turn lifecycle of a conversation: a turn opens when its user speaks, its reply starts once their audio is in,
ends at its END code or its longest, is cut by a barge-in, regenerated, or the whole conversation restarted. While
the model speaks, the user's stream is silent: what the user says meanwhile is held, and heard once the reply is
over (`release_held`), as the next turn.

`TurnLifecycle` is `Session`'s (`session.py`): it works on the session's streams, phase and turns, and returns
the frame to rewind to where its stream must go back (the engine rewinds, and `KVManager.trim` fixes the pages).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from s2s.engine.frames import UNKNOWN

INPUT_GAP_S = 0.5  # input this far behind real time is a gap (muted, paused), not a server too slow to read it


class Phase(enum.Enum):
    LISTEN = "listen"  # duplex: always; turn: the user speaks, the model stream is silent
    REPLY = "reply"  # turn: the model speaks until it ends its reply


@dataclass
class Turn:
    """One user utterance and the reply to it, with the stage timestamps (engine clock, seconds)."""

    id: int
    first_frame: int  # first user frame of the turn
    reply_start: int | None = None  # first predicted model frame
    reply_end: int | None = None  # first model frame after the reply (END sampled or max frames)
    committed: bool = False  # closed with no reply yet (`commit`): the next audio opens another turn
    times: dict[str, float] = field(default_factory=dict)


class TurnLifecycle:
    """Methods of `Session` (it inherits them): the fields are its own."""

    __slots__ = ()

    def hear(self, codes: np.ndarray, now: float) -> None:
        """New user frames `[K, n]` from the encoder (or pushed as codes). In turn mode, speech after an answered
        turn opens the next turn; while a reply plays, it is held."""
        self.heard_at(now)
        if self.mode == "turn" and self.phase is Phase.REPLY:
            self.held.append(codes)
            return
        if self.mode == "turn" and (not self.turns or self._closed(self.turns[-1])):
            self.turns.append(Turn(len(self.turns), self.user_frames, times={"first_audio_in": now}))
        self.add_user_frames(codes)

    def heard_at(self, now: float) -> None:
        """User frames reached the engine at `now`."""
        if self.first_frame_at is None:
            self.first_frame_at = now
        self.last_heard = now

    @staticmethod
    def _closed(turn: Turn) -> bool:
        return turn.reply_start is not None or turn.committed

    def release_held(self, now: float) -> list[int | None]:
        """Once a reply is over: the user's audio held while it played is heard, in order, with the commits made
        meanwhile (`None` marks, `Engine.commit`); returns what each of those commits closed."""
        held, self.held, closed = self.held, [], []
        for codes in held:
            if codes is None:
                closed.append(self.commit(now))
            else:
                self.hear(codes, now)
        return closed

    def _open_turn(self) -> Turn | None:
        """The last turn while listening, if it is open (no reply, not committed) and has speech."""
        turn = self.turns[-1] if self.turns else None
        if self.phase is not Phase.LISTEN or turn is None or self._closed(turn) or self.user_frames == turn.first_frame:
            return None
        return turn

    def commit(self, now: float) -> int | None:
        """The open turn is closed with no reply yet (the Realtime API's commit), to be answered by a later
        `end_turn`; the next audio opens another. Returns its id, or None when there is nothing to close (no speech
        since the last turn, or a reply playing). Its audio must be in (`Engine.commit` encodes what is pending)."""
        if (turn := self._open_turn()) is None:
            return None
        turn.committed = True
        turn.times["committed"] = now
        return turn.id

    def clear_input(self) -> int | None:
        """The user's audio since the last closed turn goes (the Realtime API's clear): what is pushed and not yet
        heard, and while listening the open turn's frames. Returns the frame to rewind to, or None."""
        self.pending = []
        commits = [i for i, codes in enumerate(self.held) if codes is None]
        self.held = self.held[: commits[-1] + 1] if commits else []
        if (turn := self._open_turn()) is None:
            return None
        if not self.can_rewind(turn.first_frame):
            raise ValueError("the audio to clear began before the context window: it cannot be cleared")
        turn.times = {}
        return turn.first_frame

    def end_turn(self, ended: float) -> None:
        """The user finished speaking at `ended`; the reply starts once their audio is in (`start_reply`). A second
        end of turn with no new speech (from VAD and the client both) changes nothing."""
        answered = self.turns and self.turns[-1].reply_start is not None and not self.pending
        if self.phase is Phase.REPLY or answered:
            return
        if self.end_of_turn_at is None:  # stamped on the turn when its reply starts: it may not exist yet
            self.end_of_turn_at = ended

    def start_reply(self, now: float) -> bool:
        """Turn mode: once a finished turn's audio is all in, the model stream becomes predicted. True when the
        user's last step is already computed, so the reply's first step can be sampled at once."""
        if self.end_of_turn_at is None or self.pending or self.phase is Phase.REPLY or not self.turns:
            return False
        turn = self.turns[-1]
        turn.times.setdefault("end_of_turn", self.end_of_turn_at)
        self.end_of_turn_at = None
        turn.reply_start = self.user_frames
        turn.times["reply_start"] = now
        self.phase = Phase.REPLY
        self.emitted = turn.reply_start
        self.fill_reply_silence()
        if self.computed == turn.reply_start and self.last_logits is not None:
            turn.times["prefill_done"] = now
            return True
        return False

    def fill_reply_silence(self) -> None:
        """While replying, the user stream is silent; after the reply's end, the model stream is too."""
        turn = self.turns[-1]
        horizon = self.computed + int(self.delays.max()) + 2
        self._ensure(horizon + 1)
        silent = self.cfg.silent_id
        for f in range(turn.reply_start, horizon):
            if self.user[f, 0] == UNKNOWN:
                self.user[f] = silent
        self.user_frames = max(self.user_frames, horizon)
        if turn.reply_end is not None:
            block = self.model[turn.reply_end : horizon]
            block[block == UNKNOWN] = silent

    def end_reply_at(self, filled: list[tuple[int, int]], max_reply_frames: int) -> None:
        """After sampling: the reply ends at its END code, or after `max_reply_frames` frames."""
        turn = self.turns[-1]
        for f, k in filled:
            if k or turn.reply_end is not None:
                continue
            if self.model[f, 0] == self.cfg.end_id:
                turn.reply_end = f
            elif f - turn.reply_start + 1 >= max_reply_frames:
                turn.reply_end = f + 1
        if turn.reply_end is not None:
            self.fill_reply_silence()

    def reply_over(self) -> bool:
        """Every codebook of the reply's frames is known and decoded."""
        if self.phase is not Phase.REPLY:
            return False
        turn = self.turns[-1]
        return turn.reply_end is not None and self.emitted >= turn.reply_end

    def finish_reply(self, now: float) -> dict:
        """Back to listening; returns the `reply_done` event's data. Call `rewind(computed)` after."""
        turn = self.turns[-1]
        turn.times["reply_done"] = now
        self.phase = Phase.LISTEN
        frames = int(turn.reply_end - turn.reply_start)
        return {"event": "reply_done", "turn": turn.id, "frames": frames, "times": dict(turn.times)}

    def cut_reply(self, played_frames: int, now: float) -> int | None:
        """Barge-in: the reply ends after the `played_frames` frames the user heard. Returns the frame to rewind to,
        or None when no reply is playing."""
        if self.phase is not Phase.REPLY:
            return None
        turn = self.turns[-1]
        cut = turn.reply_start + max(0, min(played_frames, self.complete_model_frames() - turn.reply_start))
        turn.reply_end = cut
        turn.times["interrupted"] = now
        self.phase = Phase.LISTEN
        self.emitted = cut
        self.events.drop_turn_audio(turn.id)
        return cut

    def regenerate(self, now: float) -> int:
        """Turn mode: drop the last reply to generate it again; returns the frame to rewind to."""
        if self.mode != "turn" or self.phase is not Phase.LISTEN or not self.turns:
            raise ValueError("regenerate needs a turn-mode conversation that has finished a reply")
        turn = self.turns[-1]
        if turn.reply_start is None:
            raise ValueError("the last turn has no reply to regenerate")
        if not self.can_rewind(turn.reply_start):
            raise ValueError("the last reply has left the context window: it cannot be regenerated")
        cut = turn.reply_start
        turn.reply_start = turn.reply_end = None
        turn.times = {"regenerate": now}
        self.end_of_turn_at = now
        return cut

    def restart(self) -> int:
        """Back to the voice prompt, turns numbered from 0 again; returns the frame to rewind to. Audio of the old
        context still queued is dropped; its stream's deadlines start again with its next frame."""
        for turn in self.turns:
            self.events.drop_turn_audio(turn.id)
        self.turns, self.phase, self.end_of_turn_at, self.pending, self.held = [], Phase.LISTEN, None, [], []
        self.first_frame_at, self.emitted = None, 0
        return self.prompt_frames

    def answered(self) -> bool:
        """Its last turn has its reply (not cut by a barge-in, whose speech is on its way), or no speech yet."""
        if not self.turns:
            return True
        turn = self.turns[-1]
        if turn.reply_start is None:
            return self.user_frames == turn.first_frame  # the turn opened with a voice prompt, before any speech
        return "interrupted" not in turn.times

    def note_input(self, seconds: float, pushed_at: float) -> None:
        """`seconds` of input pushed at `pushed_at`. Input that comes over `INPUT_GAP_S` later than real time from
        its start (the client muted, or paused its stream) moves its frames' deadlines on by as much: the server
        cannot answer what it has not heard. Less is left to count: a loaded server reads its sockets late too."""
        if self.input_started is None:
            self.input_started = pushed_at
        late = pushed_at - (self.input_started + self.input_s)
        if late > INPUT_GAP_S:
            self.input_started += late
            if self.first_frame_at is not None:
                self.first_frame_at += late
        self.input_s += seconds

    def splice(self, start: int, stop: int) -> None:
        """Take frames `start..stop-1` out of both streams (turn mode, listening): the frames after move back to
        `start`, known as they were (their steps are computed again), and the turns' frames with them."""
        if self.phase is not Phase.LISTEN or not self.prompt_frames <= start <= stop <= self.user_frames:
            raise AssertionError(f"{self.id}: cannot splice frames {start}..{stop} of {self.user_frames}")
        user, model = self.user[stop : self.user_frames].copy(), self.model[stop : self.user_frames].copy()
        assert (user != UNKNOWN).all() and (model != UNKNOWN).all(), "spliced frames must be known"
        self.rewind(start)
        self._ensure(start + len(user) + 1)
        self.user[start : start + len(user)] = user
        self.model[start : start + len(model)] = model
        self.user_frames = start + len(user)

        def moved(frame: int | None) -> int | None:
            return frame if frame is None or frame <= start else max(start, frame - (stop - start))

        for turn in self.turns:
            turn.first_frame = moved(turn.first_frame)
            turn.reply_start, turn.reply_end = moved(turn.reply_start), moved(turn.reply_end)
        self.emitted = moved(self.emitted)

    def rewind(self, frame: int) -> None:
        """Forget both streams from `frame` on; steps from there lose their K/V (`KVManager.trim` drops them)."""
        self.idle_frames = -1  # it is no longer what was preempted (`dormant`)
        self.user.truncate(frame)
        self.model.truncate(frame)
        self.user_frames = frame
        self.complete = min(self.complete, frame)
        if self.computed > frame:
            # the stored logits belong to a forgotten step: recompute step frame - 1 to predict frame again
            self.computed = max(0, frame - 1)
            self.last_logits = None
