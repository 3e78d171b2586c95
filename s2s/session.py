"""Session: one conversation's two streams of frames, the step tokens they make, its turns and its K/V pages.

Both streams share one frame index. A model frame is either forced (a voice prompt, silence while the user speaks
in turn mode, silence after the reply ends) or predicted. Step t holds codebook k of frame t - delays[k] of both
streams (`pad_id` before frame 0), so step t is known once user frame t - delays[k] and model frame t - delays[k]
are, for every k. The forward over step t gives the logits of step t + 1; of those, only the (frame, codebook)
pairs still unknown are sampled.

The engine thread alone reads and writes a live session: callers on other threads reach it through the engine's
command queue (`input_kind` and `events` aside: the first is set once, by the caller, before its first input command;
the second is a thread-safe queue). Its pages and cache handle are `KVManager`'s to change; its turn lifecycle (a
reply starts, is cut by a barge-in, ends, is regenerated) is `TurnLifecycle`'s (`s2s/turns.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from types import EllipsisType

import numpy as np
import torch

from s2s.config import ModelConfig
from s2s.context import ContextBound
from s2s.events import EventQueue
from s2s.frames import UNKNOWN, FrameRows, Frames
from s2s.sampling import SamplingParams
from s2s.turns import Phase, Turn, TurnLifecycle

STREAMING_S = 1.0  # a session whose user's audio came in this recently is a stream (admission)
INPUT_GAP_S = 0.5  # input this far behind real time is a gap (muted, paused), not a server too slow to read it


class Session(TurnLifecycle):
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
        bound: ContextBound | None = None,
    ):
        """`bound`: what its steps attend to (`s2s/context.py`); None: everything before them."""
        if mode not in ("duplex", "turn"):
            raise ValueError(f"mode must be duplex or turn, got {mode!r}")
        self.id, self.mode, self.cfg, self.row, self.bound = cid, mode, cfg, row, bound
        self.events = EventQueue()
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
        user, model = copy.deepcopy(self.user), copy.deepcopy(self.model)
        user.truncate(self.user_frames)
        model.truncate(self.user_frames)
        return {
            "user": user,
            "model": model,
            "frames": self.user_frames,
            "turns": [Turn(t.id, t.first_frame, t.reply_start, t.reply_end, t.committed) for t in self.turns],
            "held": list(self.held),
            "prompt_frames": self.prompt_frames,
            "sink": self.sink,
            "dropped": self.dropped,
            "emitted": min(self.emitted, self.user_frames),
        }

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

    def set_prompt(self, codes: np.ndarray) -> None:
        """A voice prompt `[K, P]` becomes model frames 0..P-1, the user silent meanwhile."""
        p = codes.shape[1]
        self._ensure(p + 1)
        self.model[:p] = codes.T
        self.user[:p] = self.cfg.silent_id
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

    def step_token(self, t: int) -> np.ndarray | None:
        """Step t's 2K codes, or None while some of them are unknown."""
        if t - self.min_delay >= len(self.user):
            return None
        token = self._tokens(t, t + 1)[0]
        return None if (token == UNKNOWN).any() else token

    def step_known(self, t: int) -> bool:
        """`step_token(t) is not None`, read code by code where its frames are recent (the engine loop asks it of
        every duplex session after every tick)."""
        if t - self.max_delay >= max(self.user.start, self.model.start):
            return self._recent_step(t) is not None
        return self.step_token(t) is not None

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        """Steps start..stop-1 as `[n, 2K]`, UNKNOWN where a code is not known (frames within the arrays)."""
        low = start - self.max_delay
        if low >= self.user.start and low >= self.model.start:  # each tick's read: recent frames, none padded
            return self.recent_tokens(start, stop)
        frames = np.arange(start, stop)[:, None] - self.delays[None, :]
        idx = np.arange(len(self.delays))[None, :]
        safe = np.maximum(frames, 0)
        user = np.where(frames < 0, self.cfg.pad_id, self.user.gather(safe, idx))
        model = np.where(frames < 0, self.cfg.pad_id, self.model.gather(safe, idx))
        return np.concatenate([user, model], axis=1)

    def recent_tokens(self, start: int, stop: int) -> np.ndarray:
        """`_tokens` of steps whose frames are all held from the streams' `start` on: a slice per codebook."""
        tokens = np.full((stop - start, 2 * len(self.delays)), UNKNOWN, dtype=np.int64)
        for base, stream in ((0, self.user), (len(self.delays), self.model)):
            data, first = stream.data, start - stream.start
            if first - self.max_delay < 0:
                raise IndexError(f"step {start} reads frames before the recent ones ({stream.start} on)")
            for k, d in self.codebook_delays:
                codes = data[first - d : first - d + stop - start, k]
                tokens[: len(codes), base + k] = codes
        return tokens

    def _recent_step(self, t: int) -> list[int] | None:
        """Step t's 2K codes read one by one, or None at the first unknown (the model's first: a decode round waits on
        those). Its frames must all be from the streams' `start` on. A known step is one `ready_steps` may return
        alone whatever its bounds: the step count, the arrays' end, a chunk's pages and a gap's all stop after it."""
        codes = [0] * (2 * len(self.delays))
        for base, stream in ((len(self.delays), self.model), (0, self.user)):
            data, start = stream.data, stream.start
            for k, d in self.codebook_delays:
                row = t - d - start
                if row >= len(data) or (code := int(data[row, k])) == UNKNOWN:
                    return None
                codes[base + k] = code
        return codes

    def _steps_in_arrays(self) -> int:
        """Steps from this one on need a frame beyond the stream arrays: none of them is known."""
        return max(0, len(self.user) + self.min_delay)

    @staticmethod
    def _known_run(tokens: np.ndarray) -> np.ndarray:
        """The leading rows of `tokens` with every code known."""
        unknown = np.flatnonzero((tokens == UNKNOWN).any(axis=1))
        return tokens[: unknown[0]] if len(unknown) else tokens

    def known_key(self) -> np.ndarray:
        """The prefix key of every step known so far (contiguous from 0): what a prefix-cache match looks up. Past
        a gap in its pages, only its sink's steps: no cached prefix can be what it has after the gap."""
        if self.dropped:
            return self._tokens(0, self.sink * self.bound.page_size)
        return self._known_run(self._tokens(0, self._steps_in_arrays()))

    def ready_steps(self, limit: int) -> np.ndarray:
        """Up to `limit` known steps from `computed` on, as `[n, 2K]` (n may be 0): steps of one chunk, which all
        see the same pages (`ContextBound.chunk_stop`), and none past the sink when the pages after it have a gap."""
        t = self.computed
        if limit >= 1 and t - self.max_delay >= max(self.user.start, self.model.start):  # a decode round's usual read
            if (step := self._recent_step(t)) is None:
                return np.empty((0, 2 * len(self.delays)), dtype=np.int64)
            if self._recent_step(t + 1) is None:  # one step: within every bound (see `_recent_step`)
                return np.array([step], dtype=np.int64)
        stop = min(self.computed + limit, max(self.computed, self._steps_in_arrays()))
        if self.bound is not None:
            stop = min(stop, self.bound.chunk_stop(self.sink, self.computed))
            if self.dropped and self.computed < self.sink * self.bound.page_size:
                stop = min(stop, self.sink * self.bound.page_size)
        return self._known_run(self._tokens(self.computed, stop))

    # ---- the bounded context (`s2s/context.py`) ---------------------------------------------------------------------

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

    def key(self, steps: int) -> np.ndarray:
        """The prefix key: step tokens 0..steps-1 (all known)."""
        key = self._tokens(0, steps)
        if (known := len(self._known_run(key))) < steps:
            raise ValueError(f"step {known} of the key is not known")
        return key

    def wanted(self) -> list[tuple[int, int]]:
        """(frame, codebook) pairs that sampling the logits of step `computed` would fill: those still unknown."""
        return self.wanted_after(0)

    def wanted_after(self, steps: int) -> list[tuple[int, int]]:
        """What sampling would fill once `steps` more steps are computed."""
        t, model = self.computed + steps, self.model
        end, start, data, out = len(model), model.start, model.data, []
        for k, d in self.codebook_delays:
            f = t - d
            if f >= start:  # the usual read: a recent frame
                if f >= end or data[f - start, k] != UNKNOWN:
                    continue
            elif f < 0 or model.forgotten(f) or model.code(f, k) != UNKNOWN:  # (forgotten frames were all known)
                continue
            if self._predicted(f):
                out.append((f, k))
        return out

    def _predicted(self, frame: int) -> bool:
        if self.mode == "duplex":
            return frame >= 1 and frame >= self.prompt_frames
        turn = self.turns[-1] if self.turns else None
        return (
            turn is not None
            and turn.reply_start is not None
            and frame >= turn.reply_start
            and (turn.reply_end is None or frame < turn.reply_end)
        )

    def accept(self, codes: np.ndarray, wanted: list[tuple[int, int]]) -> None:
        """Fill the `wanted()` (frame, codebook) pairs from sampled step codes `[K]`."""
        self._ensure(self.computed + 2)
        model = self.model
        for f, k in wanted:
            if f >= model.start:
                model.data[f - model.start, k] = codes[k]
            else:
                model[f, k] = codes[k]

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

    # ---- the turn lifecycle --------------------------------------------------------------------------------------

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
