"""What each command does, applied by the engine thread at the start of a tick in the order the calls came
(`Engine._apply_commands`). The caller's thread checked its arguments (`s2s/engine/commands.py`); what only the
engine thread can know (no such turn, a reply still playing, frames gone from the context window) becomes an error
event here.

A command comes with the `Session` its call found. One whose open failed, or that closed meanwhile, is not the live
one (`engine.sessions` holds another or none), and most commands then do nothing."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache import OutOfPages
from s2s.engine.commands import (
    ClearInput,
    Close,
    Commit,
    EndTurn,
    Interrupt,
    Pause,
    Push,
    PushAudio,
    PushCodes,
    Regenerate,
    Remove,
    Restart,
    SetSampling,
)
from s2s.engine.events import MetaEvent
from s2s.engine.session import Session
from s2s.engine.turns import Phase, Turn


@dataclass(frozen=True, eq=False)
class Open:
    """The engine's own (`Engine.open`): an admitted conversation goes live, with its voice prompt or, `resume`,
    the context its close kept."""

    cid: str
    prompt: np.ndarray | None
    resume: bool


Handler = Callable[[Any, Session, Any], None]  # (engine, its session, the command)
HANDLERS: dict[type, Handler] = {}


def handles(*kinds: type) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        HANDLERS.update(dict.fromkeys(kinds, fn))
        return fn

    return register


class CommandHandlers:
    """`Engine`'s handlers of its commands (a mixin: they work on the engine's sessions, K/V, codec rows and
    queue)."""

    def _apply_commands(self) -> None:
        while True:
            try:
                message, s = self._commands.get_nowait()
            except queue.Empty:
                return
            HANDLERS[type(message)](self, s, message)

    def _committed(self, s: Session, turns: list[int | None]) -> None:
        for turn in turns:
            self._tell(s, {"event": "committed", "turn": turn})

    def _release_held(self, s: Session) -> None:
        self._committed(s, s.release_held(self.clock()))

    @staticmethod
    def _tell(s: Session, data: dict) -> None:
        """An event for the session's caller, on its current turn."""
        s.events.put(MetaEvent(s.id, s.turns[-1].id if s.turns else 0, data))

    def _rewind(self, s: Session, frame: int) -> None:
        s.rewind(frame)
        self.kv.trim(s)

    def _live(self, s: Session) -> bool:
        return self.sessions.get(s.id) is s

    @handles(Open)
    def _go_live(self, s: Session, c: Open) -> None:
        context = self.resumable.take(s.id)  # (a new conversation under the id: what an earlier one kept goes)
        if c.resume and context is None:
            return self._fail_open(s, "nothing to resume: its open had failed, or what it kept was dropped since")
        if c.resume:
            s.restore(context)
        elif c.prompt is not None:
            s.set_prompt(c.prompt)
        try:
            self.kv.attach(s)
        except OutOfPages as err:  # admission counts naive mode's reservations: only pages taken outside it
            return self._fail_open(s, f"no K/V memory for it: {err}")
        s.hold_frames(self.user_rows, self.model_rows)
        self.audio.reset(s.row)
        self.sessions[s.id] = s
        if not s.turns and (s.mode == "duplex" or s.prompt_frames):
            s.turns.append(Turn(0, s.prompt_frames))

    def _fail_open(self, s: Session, reason: str) -> None:
        """The session never goes live: its events end with the reason (its row is free once it is closed)."""
        s.events.put(MetaEvent(s.id, 0, {"event": "error", "message": reason}))
        s.events.put(None)

    @handles(PushAudio, PushCodes)
    def _push(self, s: Session, c: Push) -> None:
        if self._live(s) and not s.paused:
            s.pending.append(c.data)
            s.note_input(c.seconds(self.cfg.frame_s), c.pushed_at)

    @handles(Pause)
    def _pause(self, s: Session, c: Pause) -> None:
        if not self._live(s) or s.paused == c.paused:
            return
        s.paused = c.paused
        self._tell(s, {"event": "paused" if c.paused else "started"})

    @handles(Restart)
    def _restart(self, s: Session, c: Restart) -> None:
        if not self._live(s):
            return
        self._rewind(s, s.restart())
        if s.mode == "duplex" and not s.prompt_frames:
            s.model[0] = self.model.config.silent_id
        if s.mode == "duplex" or s.prompt_frames:
            s.turns.append(Turn(0, s.prompt_frames))
        self.audio.reset(s.row)
        s.events.put(MetaEvent(s.id, 0, {"event": "restarted"}))

    @handles(Close)
    def _close(self, s: Session, c: Close) -> None:
        self.scheduler.forget(s.id)
        self._checked_idle = False  # (it may have opened and closed within this tick's commands)
        if self.sessions.pop(s.id, None) is s:
            self.kv.insert(s, lock=False)
            self.kv.detach(s)
            if c.keep:
                context = s.snapshot()
                self.resumable.put(s.id, context, Session.context_bytes(context))
            s.release_frames()
        elif c.keep:
            self.resumable.take(s.id)  # it never went live: nothing to keep
        s.events.put(None)

    @handles(Interrupt)
    def _interrupt(self, s: Session, c: Interrupt) -> None:
        self._cut_reply(s, c.played_frames)

    def _cut_reply(self, s: Session, played_frames: int) -> None:
        """Cancel the reply, keeping its first `played_frames` frames (a barge-in's, or a playing reply's removal)."""
        if s.phase is Phase.LISTEN:
            s.end_of_turn_at = None  # a reply asked for and not started yet is not wanted either
        if s.id in self.sessions and (cut := s.cut_reply(played_frames, self.clock())) is not None:
            self._rewind(s, cut)
            self.audio.reset_decoder(s.row)
            self._release_held(s)

    @handles(SetSampling)
    def _set_sampling(self, s: Session, c: SetSampling) -> None:
        s.sampling, s.generator = c.sampling, c.sampling.generator()

    @handles(EndTurn)
    def _end_turn(self, s: Session, c: EndTurn) -> None:
        """The reply to the audio pushed before the end of turn, not after: that is encoded first, and the reply starts
        now if it can (audio that comes after is held until the reply is over). With nothing new to answer (the last
        turn has its reply, or there is no speech yet), a `no_reply` event says so."""
        if not self._live(s):
            return
        self._timed("encode", self.audio.encode, [s])
        s.end_turn(self.clock())
        if s.phase is Phase.LISTEN and (s.end_of_turn_at is None or not s.turns):
            s.end_of_turn_at = None  # (before any speech, it would fire on the first frames of the next utterance)
            self._tell(s, {"event": "no_reply"})
        elif not s.paused and s.start_reply(self.clock()):
            self._sample([s])

    @handles(Commit)
    def _commit(self, s: Session, c: Commit) -> None:
        if not self._live(s):
            return
        self._timed("encode", self.audio.encode, [s])  # its audio pushed before the commit, not after
        if s.phase is Phase.REPLY:
            s.held.append(None)  # it closes the audio held meanwhile, once the reply is over
        else:
            self._committed(s, [s.commit(self.clock())])

    @handles(ClearInput)
    def _clear_input(self, s: Session, c: ClearInput) -> None:
        if not self._live(s):
            return
        if self.audio.encoder is not None:
            self.audio.encoder.reset(s.row)  # the samples it holds towards its next frame go too
        try:
            frame = s.clear_input()
        except ValueError as err:
            return self._error(s, str(err))
        if frame is not None:
            self._rewind(s, frame)

    @handles(Remove)
    def _remove(self, s: Session, c: Remove) -> None:
        if not self._live(s):
            return
        turn = next((t for t in s.turns if t.id == c.turn), None)
        if turn is None:
            return self._error(s, f"no turn {c.turn} in this conversation")
        if c.part == "reply" and s.phase is Phase.REPLY and turn is s.turns[-1]:
            return self._cut_reply(s, c.keep_frames)
        if c.part == "reply":
            if turn.reply_start is None or turn.reply_end is None:
                return self._error(s, f"turn {c.turn} has no finished reply")
            start, stop = min(turn.reply_start + c.keep_frames, turn.reply_end), turn.reply_end
        else:
            later = [t.first_frame for t in s.turns if t.first_frame > turn.first_frame]
            start = turn.first_frame
            stop = turn.reply_start if turn.reply_start is not None else min(later, default=s.user_frames)
        if start == stop:
            return
        if s.phase is Phase.REPLY:
            return self._error(s, f"turn {c.turn} is before the reply playing now: cancel that reply first")
        if not s.can_rewind(start):
            return self._error(s, f"turn {c.turn} has left the context window: it cannot be changed")
        s.splice(start, stop)
        self.kv.trim(s)

    @handles(Regenerate)
    def _regenerate(self, s: Session, c: Regenerate) -> None:
        try:
            self._rewind(s, s.regenerate(self.clock()))
        except ValueError as err:
            self._error(s, str(err))

    def _error(self, s: Session, message: str) -> None:
        self._tell(s, {"event": "error", "message": message})
