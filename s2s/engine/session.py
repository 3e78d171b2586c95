"""Session: one conversation's two streams of frames, the step tokens they make, its turns and its K/V pages.

Both streams share one frame index. A model frame is either forced (a voice prompt, silence while the user speaks
in turn mode, silence after the reply ends) or predicted. Step t holds codebook k of frame t - delays[k] of both
streams (`pad_id` before frame 0), so step t is known once user frame t - delays[k] and model frame t - delays[k]
are, for every k. The forward over step t gives the logits of step t + 1; of those, only the (frame, codebook)
pairs still unknown are sampled.

The engine thread alone reads and writes a live session: callers on other threads reach it through the engine's
command queue (`input_kind` and `events` aside: the first is set once, by the caller, before its first input command;
the second is a thread-safe queue). Its pages and cache handle are `KVManager`'s to change; its turn lifecycle (a
reply starts, is cut by a barge-in, ends, is regenerated) is `TurnLifecycle`'s (`s2s/engine/turns.py`), and its
step tokens' reads `StepTokens`' (`s2s/engine/step_tokens.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from types import EllipsisType

import numpy as np
import torch

from s2s.engine.events import EventQueue
from s2s.engine.frames import UNKNOWN, FrameRows, Frames
from s2s.engine.prompts import Prompt
from s2s.engine.step_tokens import StepTokens
from s2s.engine.turns import Phase, Turn, TurnLifecycle
from s2s.models.config import ModelConfig
from s2s.runner.sampling import SamplingParams
from s2s.scheduling.context import ContextBound

STREAMING_S = 1.0  # a session whose user's audio came in this recently is a stream (admission)


class Session(StepTokens, TurnLifecycle):
    __slots__ = (  # (attributes inline in the object: the engine reads every session's several times a tick)
        "_last_logits",
        "_logits_row",
        "bound",
        "cached_at_open",
        "cfg",
        "codebook_delays",
        "complete",
        "computed",
        "deadline_misses",
        "delays",
        "dropped",
        "emitted",
        "end_of_turn_at",
        "events",
        "first_frame_at",
        "generator",
        "handle",
        "held",
        "id",
        "idle_frames",
        "input_kind",
        "input_s",
        "input_started",
        "last_active",
        "last_heard",
        "max_delay",
        "min_delay",
        "mode",
        "model",
        "open_key_steps",
        "own_pages",
        "pages",
        "paused",
        "pending",
        "phase",
        "prompt_frames",
        "row",
        "sampling",
        "seen_inserts",
        "sink",
        "turns",
        "user",
        "user_frames",
    )

    def __init__(
        self,
        cid: str,
        mode: str,
        cfg: ModelConfig,
        sampling: SamplingParams,
        row: int,
        now: float,
        frame_size: int,
        bound: ContextBound | None = None,
    ):
        """`frame_size`: samples a frame of its audio events (the engine's codec's); `bound`: what its steps attend
        to (`ContextBound`); None: everything before them."""
        if mode not in ("duplex", "turn"):
            raise ValueError(f"mode must be duplex or turn, got {mode!r}")
        self.id, self.mode, self.cfg, self.row, self.bound = cid, mode, cfg, row, bound
        self.events = EventQueue(frame_size)
        self.input_kind: str | None = None  # "audio" or "codes", fixed by the first push (checked by the caller)
        self.pending: list[np.ndarray] = []  # pushed PCM or codes, not yet encoded
        self.held: list[np.ndarray | None] = []  # turn mode: user frames heard while a reply plays, and commits
        self.end_of_turn_at: float | None = None  # turn mode: when the turn whose reply is waiting ended
        self.sampling = sampling
        self.generator = sampling.generator()
        self.delays = np.asarray(cfg.delays)
        self.codebook_delays = list(enumerate(cfg.delays))  # (codebook, delay), for the per-step Python reads
        self.min_delay, self.max_delay = min(cfg.delays), max(cfg.delays)
        self.user, self.model = Frames(cfg.num_codebooks), Frames(cfg.num_codebooks)
        self.complete = 0  # model frames known in every codebook, from frame 0 (`complete_model_frames`)
        self.user_frames = 0  # frames of the user stream known so far (contiguous)
        self.computed = 0  # steps whose K/V sit in `pages`
        self.pages: list[int] = []  # the page table: the sink's pages, then those from `sink + dropped` on
        self.sink = bound.sink_pages(0) if bound else 0  # pages of the attention sink (`ContextBound`)
        self.dropped = 0  # pages after the sink that left the window (the page table skips them)
        self.paused = False  # its stream is stopped: nothing is computed for it
        self.own_pages: list[int] = []  # pages this conversation allocated (it holds a reference on each)
        self.handle = None  # the cache handle it holds locked
        self._last_logits: torch.Tensor | None = None  # a forward's logits, of which row `_logits_row` is its own
        self._logits_row: int | EllipsisType = ...
        self.phase = Phase.LISTEN
        self.turns: list[Turn] = []
        self.emitted = 0  # model frames handed to the audio decoder (duplex) or considered for it (turn)
        if mode == "duplex":
            self.model[0] = cfg.silent_id  # the model stream starts silent; frames from 1 on are predicted
        self.last_active = now  # its last computed step
        self.idle_frames = -1  # user frames when it was preempted while listening (`dormant`)
        self.first_frame_at: float | None = None  # when the first user frame reached the engine (deadlines)
        self.last_heard = now  # when user frames last reached the engine (`streaming`; opening counts)
        self.input_started: float | None = None  # when its input would have begun, had it come without gaps
        self.input_s = 0.0  # seconds of input pushed
        self.prompt_frames = 0
        self.cached_at_open = 0  # steps the prefix cache gave back when it opened
        self.open_key_steps = 0  # steps known when it opened (what the first match looked up)
        self.seen_inserts = -1  # `KVManager.inserts` when this session last matched
        self.deadline_misses = 0  # duplex frames sent after their deadline (`AudioIO`)

    @property
    def last_logits(self) -> torch.Tensor | None:
        """Logits of step `computed`, from the last forward (its row of the batch's, taken when read)."""
        return None if self._last_logits is None else self._last_logits[self._logits_row]

    @last_logits.setter
    def last_logits(self, logits: torch.Tensor | None) -> None:
        self._last_logits, self._logits_row = logits, ...

    def streaming(self, now: float) -> bool:
        """It costs a real-time stream now: it replies, or its user's audio came in within the last second (read
        from callers' threads: a stale answer is a tick old)."""
        if self.paused:
            return False
        return self.phase is Phase.REPLY or (self.last_heard is not None and now - self.last_heard < STREAMING_S)

    @property
    def waiting(self) -> bool:
        """Nothing is to be computed for it now: paused, or `dormant`."""
        return self.paused or self.dormant

    @property
    def dormant(self) -> bool:
        """Preempted while listening with all it had computed, and no new user frames since: nothing to answer, so
        nothing is recomputed (into pages that are short) until its user speaks again."""
        return self.phase is Phase.LISTEN and self.user_frames <= self.idle_frames

    def snapshot(self) -> dict:
        """What a resumed conversation needs: both streams (what is kept of them), the turns, its sink and gap."""
        return {
            "user": self.user.until(self.user_frames),
            "model": self.model.until(self.user_frames),
            "frames": self.user_frames,
            "turns": [Turn(t.id, t.first_frame, t.reply_start, t.reply_end, t.committed) for t in self.turns],
            "held": list(self.held),
            "prompt_frames": self.prompt_frames,
            "sink": self.sink,
            "dropped": self.dropped,
            "emitted": min(self.emitted, self.user_frames),
        }

    @staticmethod
    def context_bytes(snap: dict) -> int:
        """The bytes of a `snapshot()`'s arrays: its streams' and the input held for after a reply."""
        held = sum(codes.nbytes for codes in snap["held"] if codes is not None)
        return snap["user"].nbytes + snap["model"].nbytes + held

    def restore(self, snap: dict) -> None:
        """The context of `snapshot()`. One that had dropped pages recomputes its sink and then its window, each
        step seeing what is kept before it (`advance` jumps the gap)."""
        self.user, self.model = copy.deepcopy(snap["user"]), copy.deepcopy(snap["model"])
        n = self.user_frames = snap["frames"]
        self._ensure(n + 1)
        if self.mode == "duplex" and n == 0:
            self.model[0] = self.cfg.silent_id
        self.turns, self.prompt_frames, self.held = snap["turns"], snap["prompt_frames"], list(snap["held"])
        self.sink, self.dropped, self.emitted = snap["sink"], snap["dropped"], snap["emitted"]
        self.complete = 0

    # ---- frames --------------------------------------------------------------------------------------------------

    def hold_frames(self, user: FrameRows, model: FrameRows) -> None:
        """While it is live, its streams' recent frames are its row of the engine's (`FrameRows`)."""
        self.user.attach(user, self.row)
        self.model.attach(model, self.row)

    def release_frames(self) -> None:
        self.user.detach()
        self.model.detach()

    def _ensure(self, frames: int) -> None:
        self.user.ensure(frames)
        self.model.ensure(frames)

    def set_prompt(self, prompt: Prompt | np.ndarray) -> None:
        """A prompt (or a voice's model frames `[K, P]`) becomes frames 0..P-1 of both streams (the user's silent
        where it gives none)."""
        prompt = prompt if isinstance(prompt, Prompt) else Prompt(prompt)
        p = prompt.frames
        self._ensure(p + 1)
        self.model[:p] = prompt.model.T
        self.user[:p] = self.cfg.silent_id if prompt.user is None else prompt.user.T
        self.user_frames = self.prompt_frames = p
        if self.bound is not None:
            self.sink = self.bound.sink_pages(p)

    def add_user_frames(self, codes: np.ndarray) -> None:
        """New user frames `[K, n]`. In turn mode while listening, the model stream is forced silent alongside."""
        n = codes.shape[1]
        f = self.user_frames
        self._ensure(f + n + 1)
        if f >= self.user.start:  # (the usual write: recent frames)
            self.user.data[f - self.user.start : f - self.user.start + n] = codes.T
        else:
            self.user[f : f + n] = codes.T
        if self.mode == "turn" and self.phase is Phase.LISTEN:
            self.model[f : f + n] = self.cfg.silent_id
        self.user_frames += n

    @staticmethod
    def heard_in_rows(sessions: list[Session], n: int, now: float) -> None:
        """Duplex: `n` new user frames of each, which the caller has written into their rows (`AudioIO`). One loop
        for all: `heard_at` and the count, without a call per session."""
        for s in sessions:
            if s.first_frame_at is None:
                s.first_frame_at = now
            s.last_heard = now
            s.user_frames += n

    # ---- the bounded context (`ContextBound`) ---------------------------------------------------------------------

    @property
    def table_pages(self) -> int:
        """Pages its table would have without the gap: the steps computed or reserved so far, in pages."""
        return len(self.pages) + (self.dropped if len(self.pages) >= self.sink else 0)

    def advance(self, steps: int) -> None:
        """`steps` more steps are computed; past the sink of one with a gap (recomputing it), the next is after it."""
        self.computed += steps
        if self.dropped and self.computed == self.sink * self.bound.page_size:
            self.computed = (self.sink + self.dropped) * self.bound.page_size
            self.last_logits = None  # they predict a step in the gap

    def visible(self) -> tuple[list[int], int, int]:
        """What a chunk from `computed` attends to: the page table the forward sees (the sink's pages, then the
        window's), the steps in it before the chunk, and how far the window's positions are from their place in it
        (added for RoPE)."""
        if self.bound is None:
            return self.pages, self.computed, 0
        ps = self.bound.page_size
        hidden = self.bound.window_start(self.sink, self.computed // ps) - self.sink
        if self.computed >= self.sink * ps:  # recomputing after a gap (`restore`, preempted): what is kept
            hidden = max(hidden, self.dropped)
        if hidden <= 0:
            return self.pages, self.computed, 0
        table = self.pages[: self.sink] + self.pages[self.sink + hidden - self.dropped :]
        return table, self.computed - hidden * ps, hidden * ps

    def can_rewind(self, frame: int) -> bool:
        """Whether a rewind to `frame` can recompute step `frame - 1`: into the sink, or where the pages its window
        needs are still in the table (turn mode keeps the last reply's)."""
        if self.bound is None or not self.dropped:
            return True
        ps = self.bound.page_size
        first_kept = self.sink + self.dropped
        return frame <= self.sink * ps or frame - 1 >= (first_kept + self.bound.window_pages - 1) * ps

    @staticmethod
    def record_steps(
        sessions: list[Session], computed: list[int], logits: torch.Tensor, rows: Sequence[int], now: float
    ) -> None:
        """Decode steps of each session up to `computed[i]` were computed and sampled (`DuplexLane`, which wrote their
        model codes into its rows, and steps none past its sink with a gap: `advance` would only add); row `rows[i]`
        of `logits` is its last step's. One loop for all, without a call per session."""
        for s, t, row in zip(sessions, computed, rows, strict=True):
            s.computed, s._last_logits, s._logits_row, s.last_active = t, logits, row, now
            # every codebook of frame t - max_delay is known now, and of each before it (the steps before were known)
            if t + 1 - s.max_delay > s.complete:
                s.complete = t + 1 - s.max_delay

    def complete_model_frames(self) -> int:
        """Model frames whose every codebook is known, counted from frame 0 (contiguous)."""
        model = self.model
        while self.complete < len(model):
            if model.forgotten(self.complete):
                self.complete = model.start  # forgotten frames were all complete
            elif UNKNOWN in model[self.complete].tolist():
                break
            else:
                self.complete += 1
        return self.complete

    STATS = (
        "session",
        "mode",
        "phase",
        "turn",
        "steps",
        "pages",
        "own_pages",
        "cached_steps_at_open",
        "frames_out",
        "deadline_misses",
    )

    @staticmethod
    def stats_of(sessions: list[Session]) -> list[tuple]:
        """Each one's `STATS`, in order (one comprehension, no call per session: the engine publishes them every
        tick)."""
        return [
            (
                s.id,
                s.mode,
                s.phase._value_,  # (`.value` is a property: a call per session)
                s.turns[-1].id if s.turns else 0,
                s.computed,
                len(s.pages),
                len(s.own_pages),
                s.cached_at_open,
                s.emitted,
                s.deadline_misses,
            )
            for s in sessions
        ]
