"""Engine: every live conversation advanced by one batched model forward and one batched codec call per tick.

`step()` is one tick: ingest (callers' commands, then new user audio through the encoder) -> schedule (who computes
what this round, and their pages) -> run (one forward and one sampling over all of it) -> emit (newly complete frames
through the decoder, to each session's event queue). Schedule and run repeat for each of `frames_per_tick` rounds,
each followed by the decode of any turn's first audio; the rest is decoded once, at the end of the tick.
`start()` runs it in a thread. Callers on other threads never wait for a tick: `open` decides admission at once and
every call puts a command on a queue that the next tick applies first, in order (mini-sglang's scheduler takes its
messages the same way). Readers of stats get the `snapshot()` the last tick published.

Who owns what: a live `Session` belongs to the engine thread; its pages and cache handle to `KVManager`; the codec
rows to `AudioIO`; the batch to `ModelRunner`; the pick, preemption order, admission and deadlines to `scheduler`.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from cache import OutOfPages, PagePool
from codec import EncodecTokenizer
from codec.pcm import SAMPLE_RATE, checked_audio
from s2s.audio_io import AudioIO
from s2s.calibration import calibrate
from s2s.config import FRAME_S, EngineConfig
from s2s.context import ContextBound
from s2s.duplex_lane import DuplexLane, LaneRound
from s2s.events import AudioEvent, CodesEvent, EventQueue, MetaEvent
from s2s.frames import FrameRows
from s2s.kv_manager import KVManager
from s2s.metrics import CostModel, EngineSnapshot, EngineStats
from s2s.model import S2SModel
from s2s.model_runner import ModelRunner
from s2s.registry import Refused, Registry
from s2s.sampling import SamplingParams
from s2s.scheduler import Admission, Scheduler, Work
from s2s.session import Session
from s2s.turns import Phase, Turn

log = logging.getLogger("s2s.engine")

__all__ = ["FRAME_S", "AudioEvent", "CodesEvent", "Engine", "EngineConfig", "EngineSnapshot", "MetaEvent", "Refused"]


class Engine:
    runner_class: type[ModelRunner] = ModelRunner  # what computes a round (`s2s bench engine` swaps in a baseline)
    duplex_lane = True  # steady duplex conversations step as rows of arrays (`DuplexLane`); False: all as `Work`

    def __init__(
        self,
        model: S2SModel,
        tokenizer: EncodecTokenizer | None,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.model, self.tok, self.cfg, self.clock = model, tokenizer, config or EngineConfig(), clock
        mcfg, cfg = model.config, self.cfg
        if tokenizer is not None and mcfg.num_codebooks != tokenizer.num_codebooks:
            raise ValueError(
                f"model uses {mcfg.num_codebooks} codebooks but the codec {tokenizer.num_codebooks}: pick the "
                "codec bandwidth that matches"
            )
        param = next(model.parameters())
        self.pool = PagePool(
            mcfg.num_hidden_layers,
            mcfg.num_key_value_heads,
            mcfg.head_dim,
            cfg.page_size,
            num_pages=None if cfg.kv_budget_bytes else cfg.num_pages,
            budget_bytes=cfg.kv_budget_bytes,
            dtype=param.dtype,
            device=param.device,
        )
        self.stats = EngineStats()
        self.bound = ContextBound.of(cfg.max_context, cfg.page_size, cfg.max_reply_frames, mcfg.max_delay)
        self._check_in_range(1)
        self.kv = KVManager(self.pool, cfg.cache_mode, self.bound, self.stats, cfg.max_conversations)
        self.cache = self.kv.cache
        self.runner = self.runner_class(model, self.pool, cfg.max_conversations, cfg.cuda_graphs, cfg.deterministic)
        rows = cfg.max_conversations
        held = 2 * self.bound.max_pages(1, "turn") * cfg.page_size  # twice the most a conversation's pages cover
        self.user_rows, self.model_rows = (FrameRows(rows, mcfg.num_codebooks, held) for _ in range(2))
        self.audio = AudioIO(
            tokenizer,
            rows,
            self.user_rows,
            self.model_rows,
            mcfg.codebook_size,
            cfg.jitter_buffer_s,
            self.stats,
            clock,
            cfg.deterministic,
            cfg.frames_per_tick if cfg.cuda_graphs else None,
        )
        page_size = cfg.page_size if self.cache.shares_prefixes else None
        self.scheduler = Scheduler(cfg.prefill_budget, cfg.background_budget, page_size)
        lane_rounds = cfg.frames_per_tick if self.duplex_lane else 0
        self.lane = DuplexLane(mcfg.delays, self.bound, lane_rounds, self.user_rows, self.model_rows, self.kv.tables)
        self.cost = CostModel()
        self.admission = Admission(
            self.cost, cfg.max_conversations, self.kv.capacity, cfg.frames_per_tick, cfg.admission_headroom
        )
        self.sessions: dict[str, Session] = {}  # live, in the order they opened: the engine thread's alone
        self.voices: dict[str, np.ndarray] = {}  # named voice prompts (codes [K, P])
        self._closed_context: dict[str, dict] = {}  # closed sessions' context, for resume (the engine thread's)
        self.registry = Registry(
            mcfg,
            self.admission,
            self.bound,
            cfg.max_conversations,
            cfg.session_ttl_s,
            self.stats,
            clock,
            self._forget_snapshot,
        )
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by `end_turn` (the engine thread ticks at once) and `stop`
        self._checked_idle = True  # `_check_when_idle` has run since the last conversation went
        self._turn_mode_sessions: list[Session] = []  # this tick's live sessions in turn mode
        calibrate(self)
        self._publish()

    # ---- public API: any thread, never waits for a tick ---------------------------------------------------------

    def add_voice(self, name: str, codes: np.ndarray | torch.Tensor) -> None:
        """Register a voice prompt under `name`; conversations opened with `prompt=name` share its prefix."""
        codes = self.model.config.checked_codes(codes, "voice codes")
        self._check_in_range(self.bound.sink_pages(codes.shape[1]))
        self.voices[name] = codes

    def open(
        self,
        mode: str = "duplex",
        prompt: np.ndarray | torch.Tensor | str | None = None,
        sampling: SamplingParams | None = None,
        session_id: str | None = None,
        resume: bool = False,
        *,
        admit: bool = True,
    ) -> str:
        """Admit a conversation or raise `Refused` with the reason. `prompt`: voice-prompt codes `[K, P]`, or the
        name of one registered with `add_voice`.

        `resume=True` reopens the closed session `session_id` (within `session_ttl_s`) with its whole context; the
        prefix cache gives back whatever of it is still cached. `admit=False` skips the cost check (the engine's
        own calibration only)."""
        if isinstance(prompt, str):
            if prompt not in self.voices:
                raise KeyError(f"no voice prompt named {prompt!r}; known: {sorted(self.voices)}")
            prompt = self.voices[prompt]
        elif prompt is not None:
            prompt = self.model.config.checked_codes(prompt, "prompt codes")
            self._check_in_range(self.bound.sink_pages(prompt.shape[1]))
        s = self.registry.admit(mode, sampling or SamplingParams(), session_id, resume, admit)
        self._commands.put(functools.partial(self._apply_open, s, prompt, resume))
        return s.id

    def admission_problem(self, count: bool = False) -> str | None:
        """Why `open` would refuse a conversation now, or None: for a server that refuses before it accepts a
        connection (`count`: that refusal counts in `stats.refused`), and for its health check."""
        return self.registry.problem(count)

    def push_audio(self, cid: str, pcm: np.ndarray) -> None:
        """User PCM (float32, 24 kHz, any length, in [-1, 1]); encoded in the next tick with everyone else's. Bad
        samples raise `ValueError` here, in the caller's thread: the codec would raise in the engine's."""
        if self.tok is None:
            raise ValueError("this engine has no codec: feed it codes with push_codes")
        pcm = checked_audio(pcm)
        s = self.registry.fed(cid, "audio")
        self._commands.put(functools.partial(self._apply_input, s, pcm, len(pcm) / SAMPLE_RATE, self.clock()))

    def push_codes(self, cid: str, codes: np.ndarray | torch.Tensor) -> None:
        """User frames given as codes `[K, n]` (ids below `codebook_size`), taken in the next tick as they are: the
        input of a codec-free engine, or text bytes fed to a speech model as its user stream."""
        codes = self.model.config.checked_codes(codes, "codes")
        s, seconds = self.registry.fed(cid, "codes"), codes.shape[1] * FRAME_S
        self._commands.put(functools.partial(self._apply_input, s, codes, seconds, self.clock()))

    def end_turn(self, cid: str) -> None:
        """Turn mode: the user finished speaking; the reply starts once their audio is in (`no_reply` event: there
        is nothing new to answer)."""
        self._commands.put(functools.partial(self._apply_end_turn, self._turn_mode(cid, "end_turn")))
        self._wake.set()

    def commit(self, cid: str) -> None:
        """Turn mode: the user's audio so far is one turn, to be answered by a later `end_turn` (the Realtime API's
        commit without a response); the next audio opens another turn. A `committed` event answers each commit,
        naming the turn, or None when there was nothing to close (no speech since the last turn, or a reply plays)."""
        s = self._turn_mode(cid, "commit")
        self._commands.put(functools.partial(self._apply_commit, s))

    def clear_input(self, cid: str) -> None:
        """Turn mode: drop the user's audio since the last closed turn (pushed, or heard while listening)."""
        self._commands.put(functools.partial(self._apply_clear, self._turn_mode(cid, "clear_input")))

    def remove(self, cid: str, turn: int, part: str, keep_frames: int = 0) -> None:
        """Turn mode: take turn `turn`'s user audio (`part="user"`) or its reply after its first `keep_frames`
        frames (`part="reply"`) out of the context. What follows is computed again, its frames kept; a reply still
        playing is cut as at a barge-in. What cannot be removed (a reply playing after it, frames that left the
        context window) gets an error event."""
        if part not in ("user", "reply") or keep_frames < 0:
            raise ValueError(f"part must be user or reply and keep_frames >= 0, got {part!r}, {keep_frames}")
        s = self._turn_mode(cid, "remove")
        self._commands.put(functools.partial(self._apply_remove, s, turn, part, keep_frames))

    def interrupt(self, cid: str, played_frames: int) -> None:
        """Barge-in: cancel the reply and keep in the context only the `played_frames` frames the user heard."""
        self._commands.put(functools.partial(self._apply_interrupt, self.registry.get(cid), played_frames))

    def regenerate(self, cid: str) -> None:
        """Turn mode: drop the last reply and generate it again (a new draw unless sampling is greedy or seeded);
        everything before the reply keeps its K/V. A session with no finished reply gets an error event."""
        self._commands.put(functools.partial(self._apply_regenerate, self._turn_mode(cid, "regenerate")))

    def set_sampling(self, cid: str, sampling: SamplingParams) -> None:
        """How the conversation's next frames are drawn (a seed starts its generator again)."""
        self._commands.put(functools.partial(self._apply_sampling, self.registry.get(cid), sampling))

    def pause(self, cid: str) -> None:
        """Stop the conversation's stream: nothing is computed for it, input pushed meanwhile is dropped, and its
        context is kept (its pages are the first to go when the pool runs short: it recomputes them on `unpause`)."""
        self._commands.put(functools.partial(self._apply_pause, self.registry.get(cid), True))

    def unpause(self, cid: str) -> None:
        """Start a paused conversation's stream again where it stopped; its frame deadlines count from now."""
        self._commands.put(functools.partial(self._apply_pause, self.registry.get(cid), False))

    def restart(self, cid: str) -> None:
        """Take the conversation back to its voice prompt: the rest of its context goes, turns count from 0."""
        self._commands.put(functools.partial(self._apply_restart, self.registry.get(cid)))

    def close(self, cid: str) -> None:
        """End the conversation: its context goes into the prefix cache, its private pages are freed, and its event
        queue ends with None. It can be resumed within `session_ttl_s`."""
        self.registry.close(cid, then=lambda s: self._commands.put(functools.partial(self._apply_close, s)))

    def discard(self, cid: str) -> None:
        """Drop a session at once, keeping and caching nothing (calibration's). Only from the thread that calls
        `step()`, with no loop running."""
        s = self.registry.close(cid, resumable=False)
        self.sessions.pop(cid, None)
        self.kv.detach(s)
        s.release_frames()

    def event_queue(self, cid: str) -> EventQueue:
        return self.registry.get(cid).events

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def start(self) -> None:
        """Run `step()` every `tick_s` in a thread until `stop()`."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="s2s-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()  # a loop waiting for its next tick sees the stop now, not a tick later
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ---- the tick ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        with self.runner.on_device():
            start, work_done, lane_steps = self.clock(), [], 0
            self._ingest()
            for i in range(self.cfg.frames_per_tick):  # each round: one step of every due session
                work = self._schedule(i)
                lane = self.lane.round(i)
                if not work and lane is None:
                    break
                self._run(work, lane)
                self._timed("decode", self.audio.decode, self.lane.others, first_audio_only=True)  # (turn mode's)
                work_done.append(work)
                lane_steps += len(lane) if lane is not None else 0
            self.lane.give_back_all()
            for s in self.lane.stalled:  # as `Scheduler.pick` forgets one with nothing to compute
                self.scheduler.forget(s.id)
            self._timed("decode", self.audio.decode, self.sessions.values())
            self._finish_replies()
            self._check_when_idle()
            self._record(start, work_done, lane_steps)

    def _ingest(self) -> None:
        self._apply_commands()
        self._timed("encode", self.audio.encode, self.sessions.values())
        self._turn_mode_sessions = [s for s in self.sessions.values() if s.mode == "turn"]  # (the tick's own loops)
        for s in self._turn_mode_sessions:
            if s.end_of_turn_at is not None and not s.paused and s.start_reply(self.clock()):
                self._sample([s])  # the user's last step is already computed: sample at once
        self.kv.rematch(self.sessions.values())
        self.lane.take(list(self.sessions.values()))

    def _schedule(self, index: int) -> list[Work]:
        """Round `index`'s work besides the lane's, and pages for both."""
        t = self.clock()
        sessions = list(self.sessions.values())
        schedulable = self.lane.schedulable(index, lambda rows: self.kv.grow_steps(rows, len(self.lane.others)))
        work = self.scheduler.pick(schedulable, t, prefill=index == 0)
        work = self.kv.reserve(work, lambda s, busy: self._victim(s, sessions, busy))
        work = self.lane.keep_reserved(work)
        self.stats.phase_seconds["schedule"] += self.clock() - t
        return work

    def _victim(self, s: Session, sessions: list[Session], busy: set[str]) -> Session | None:
        """`Scheduler.victim`; one the lane steps gets its steps back first, and steps no more this tick."""
        if (v := self.scheduler.victim(s, sessions, busy)) is not None:
            self.lane.give_back(v)
        return v

    def _run(self, work: list[Work], lane: LaneRound | None) -> None:
        t = self.clock()
        logits = self.runner.forward(work, lane)
        now = self.clock()
        for w, row in zip(work, logits[: len(work)].unbind(), strict=True):  # (one call for every row's view)
            s = w.session
            s.last_active, s.last_logits = now, row
            s.advance(len(w.tokens))
            turn = s.turns[-1] if s.turns else None
            if turn is not None and turn.reply_start is not None and s.computed >= turn.reply_start:
                turn.times.setdefault("prefill_done", now)
            if not w.decode:
                self.kv.insert(s, lock=True)  # a prefill chunk: sessions behind it can share it next tick
        # waits for the forward (on a GPU)
        self._sample([w.session for w in work], [w.wanted for w in work], lane, logits[len(work) :], now)
        for s in self._turn_mode_sessions:  # (a duplex session never replies by turn)
            if s.phase is Phase.REPLY:
                s.fill_reply_silence()
        self.stats.phase_seconds["model"] += self.clock() - t

    def _sample(
        self,
        sessions: list[Session],
        known: list | None = None,
        lane: LaneRound | None = None,
        lane_logits: torch.Tensor | None = None,
        computed_at: float = 0.0,
    ) -> None:
        """Sample each session's next codes, and the lane's rows' (`lane_logits`: theirs, computed at
        `computed_at`); `known`: what each session will fill where the scheduler found it (or None)."""
        todo = [
            (s, filled)
            for s, found in zip(sessions, known or [None] * len(sessions), strict=True)
            if s.last_logits is not None and (filled := found or s.wanted())
        ]
        if not todo and lane is None:
            return
        logits = [torch.stack([s.last_logits for s, _ in todo])] if todo else []
        params, streams = [s.sampling for s, _ in todo], [s.generator for s, _ in todo]
        if lane is not None:
            logits.append(lane_logits)
            lane_params, lane_streams = self.lane.sampling(lane)
            params, streams = params + lane_params, streams + lane_streams
        codes = self.runner.sample(torch.cat(logits) if len(logits) > 1 else logits[0], params, streams)
        now = self.clock()
        if lane is not None:
            self.lane.accept(lane, codes[len(todo) :], lane_logits, computed_at)  # (still on the device)
        if todo:
            codes = codes[: len(todo)].cpu().numpy()
        for (s, filled), c in zip(todo, codes[: len(todo)], strict=True):
            s.accept(c, filled)
            if s.phase is Phase.REPLY:
                s.turns[-1].times.setdefault("first_step", now)
                s.end_reply_at(filled, self.cfg.max_reply_frames)

    def _finish_replies(self) -> None:
        for s in self._turn_mode_sessions:
            if s.reply_over():
                data = s.finish_reply(self.clock())
                self._rewind(s, s.computed)
                self.kv.insert(s, lock=True)
                s.events.put(MetaEvent(s.id, data["turn"], data))
                self._release_held(s)

    def _record(self, start: float, rounds: list[list[Work]], lane_steps: int) -> None:
        decode = lane_steps + sum(w.decode for work in rounds for w in work)
        prefill = sum(len(w.tokens) for work in rounds for w in work if not w.decode)
        elapsed = self.clock() - start
        self.cost.observe(len(rounds), decode, prefill, elapsed)  # the whole tick: what must fit the frame budget
        self.stats.record_tick(elapsed, prefill)
        self._publish()

    def _check_when_idle(self) -> None:
        """Once each time the last conversation has gone: every page free or cached, the pool's counts consistent
        (`PrefixCache.check`), no page table or frame row still held; a failure is counted and logged, and the engine
        goes on."""
        if self.sessions:
            self._checked_idle = False
            return
        if self._checked_idle:
            return
        self._checked_idle = True
        self.stats.kv_checks += 1
        try:
            self.cache.check()
            c = self.cache.stats()
            assert c.private == c.cached_locked == 0, f"pages held with no conversation open: {c}"
            assert not self.kv.tables.lengths.any(), "a page table left with no conversation open"
            assert not self.user_rows.attached and not self.model_rows.attached, "frame rows held by no conversation"
        except AssertionError:
            self.stats.kv_check_failures += 1
            log.exception("page integrity check failed")

    def _timed(self, phase: str, fn: Callable, *args, **kw) -> None:
        t = self.clock()
        fn(*args, **kw)
        self.stats.phase_seconds[phase] += self.clock() - t

    def _publish(self) -> None:
        sessions = Session.stats_of(list(self.sessions.values()))
        self._snapshot = EngineSnapshot(len(self.sessions), self.cache.stats(), self.stats.copy(), sessions)

    def _loop(self) -> None:
        next_tick = self.clock()
        while not self._stop.is_set():
            self.step()
            next_tick += self.cfg.tick_s
            delay = next_tick - self.clock()
            if delay <= 0 or self._behind():
                # late, or input waiting: start the next tick now, and count from there (not from a schedule that
                # ran ahead while ticks ran back to back, which would then sleep through arriving frames)
                next_tick = self.clock()
            elif self._wake.wait(delay):  # a turn ended: its reply starts now, not up to a tick later
                self._wake.clear()
                next_tick = self.clock()

    def _behind(self) -> bool:
        """A duplex session still has a step it could take now: its input came in faster than a tick's worth
        (clients send 80 ms blocks), so the next tick starts at once instead of waiting for its slot."""
        if self.lane.ahead:  # one the lane ended the tick with (it knows of those)
            return True
        return any(
            s.mode == "duplex" and not s.paused and s.step_known(s.computed) and s.wanted_after(1)
            for s in self.lane.rest
        )

    # ---- commands, applied by the engine thread at the start of a tick -----------------------------------------

    def _apply_commands(self) -> None:
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _apply_open(self, s: Session, prompt: np.ndarray | None, resume: bool) -> None:
        if resume and (context := self._closed_context.pop(s.id, None)) is None:
            return self._fail_open(s, "nothing to resume: its open had failed")
        if resume:
            s.restore(context)
        elif prompt is not None:
            s.set_prompt(prompt)
        try:
            self.kv.attach(s)
        except OutOfPages as e:  # admission counts naive mode's reservations: only pages taken outside it
            return self._fail_open(s, f"no K/V memory for it: {e}")
        s.hold_frames(self.user_rows, self.model_rows)
        self.audio.reset(s.row)
        self.sessions[s.id] = s
        if not s.turns and (s.mode == "duplex" or s.prompt_frames):
            s.turns.append(Turn(0, s.prompt_frames))

    def _apply_input(self, s: Session, data: np.ndarray, seconds: float, pushed_at: float) -> None:
        if self.sessions.get(s.id) is s and not s.paused:  # not one whose open failed
            s.pending.append(data)
            s.note_input(seconds, pushed_at)

    def _apply_pause(self, s: Session, paused: bool) -> None:
        if self.sessions.get(s.id) is not s or s.paused == paused:
            return
        s.paused = paused
        self._tell(s, {"event": "paused" if paused else "started"})

    def _apply_restart(self, s: Session) -> None:
        if self.sessions.get(s.id) is not s:
            return
        self._rewind(s, s.restart())
        if s.mode == "duplex" and not s.prompt_frames:
            s.model[0] = self.model.config.silent_id
        if s.mode == "duplex" or s.prompt_frames:
            s.turns.append(Turn(0, s.prompt_frames))
        self.audio.reset(s.row)
        s.events.put(MetaEvent(s.id, 0, {"event": "restarted"}))

    def _fail_open(self, s: Session, reason: str) -> None:
        """The session never goes live: its events end with the reason (its row is free once it is closed)."""
        s.events.put(MetaEvent(s.id, 0, {"event": "error", "message": reason}))
        s.events.put(None)

    def _apply_close(self, s: Session) -> None:
        self.scheduler.forget(s.id)
        self._checked_idle = False  # (it may have opened and closed within this tick's commands)
        if self.sessions.pop(s.id, None) is s:
            self.kv.insert(s, lock=False)
            self.kv.detach(s)
            self._closed_context[s.id] = s.snapshot()
            s.release_frames()
        s.events.put(None)

    def _apply_interrupt(self, s: Session, played_frames: int) -> None:
        if s.phase is Phase.LISTEN:
            s.end_of_turn_at = None  # a reply asked for and not started yet is not wanted either
        if s.id in self.sessions and (cut := s.cut_reply(played_frames, self.clock())) is not None:
            self._rewind(s, cut)
            self.audio.reset_decoder(s.row)
            self._release_held(s)

    @staticmethod
    def _apply_sampling(s: Session, sampling: SamplingParams) -> None:
        s.sampling, s.generator = sampling, sampling.generator()

    def _apply_end_turn(self, s: Session) -> None:
        """The reply to the audio pushed before the end of turn, not after: that is encoded first, and the reply
        starts now if it can (audio that comes after is held until the reply is over). With nothing new to answer
        (the last turn has its reply, or there is no speech yet), a `no_reply` event says so."""
        if self.sessions.get(s.id) is not s:
            return
        self._timed("encode", self.audio.encode, [s])
        s.end_turn(self.clock())
        if s.phase is Phase.LISTEN and (s.end_of_turn_at is None or not s.turns):
            s.end_of_turn_at = None  # (before any speech, it would fire on the first frames of the next utterance)
            self._tell(s, {"event": "no_reply"})
        elif not s.paused and s.start_reply(self.clock()):
            self._sample([s])

    def _apply_commit(self, s: Session) -> None:
        if self.sessions.get(s.id) is not s:
            return
        self._timed("encode", self.audio.encode, [s])  # its audio pushed before the commit, not after
        if s.phase is Phase.REPLY:
            s.held.append(None)  # it closes the audio held meanwhile, once the reply is over
        else:
            self._committed(s, [s.commit(self.clock())])

    def _committed(self, s: Session, turns: list[int | None]) -> None:
        for turn in turns:
            self._tell(s, {"event": "committed", "turn": turn})

    def _release_held(self, s: Session) -> None:
        self._committed(s, s.release_held(self.clock()))

    def _apply_clear(self, s: Session) -> None:
        if self.sessions.get(s.id) is not s:
            return
        if self.audio.encoder is not None:
            self.audio.encoder.reset(s.row)  # the samples it holds towards its next frame go too
        try:
            frame = s.clear_input()
        except ValueError as e:
            return self._error(s, str(e))
        if frame is not None:
            self._rewind(s, frame)

    def _apply_remove(self, s: Session, turn_id: int, part: str, keep: int) -> None:
        if self.sessions.get(s.id) is not s:
            return
        turn = next((t for t in s.turns if t.id == turn_id), None)
        if turn is None:
            return self._error(s, f"no turn {turn_id} in this conversation")
        if part == "reply" and s.phase is Phase.REPLY and turn is s.turns[-1]:
            return self._apply_interrupt(s, keep)
        if part == "reply":
            if turn.reply_start is None or turn.reply_end is None:
                return self._error(s, f"turn {turn_id} has no finished reply")
            start, stop = min(turn.reply_start + keep, turn.reply_end), turn.reply_end
        else:
            later = [t.first_frame for t in s.turns if t.first_frame > turn.first_frame]
            start = turn.first_frame
            stop = turn.reply_start if turn.reply_start is not None else min(later, default=s.user_frames)
        if start == stop:
            return
        if s.phase is Phase.REPLY:
            return self._error(s, f"turn {turn_id} is before the reply playing now: cancel that reply first")
        if not s.can_rewind(start):
            return self._error(s, f"turn {turn_id} has left the context window: it cannot be changed")
        s.splice(start, stop)
        self.kv.trim(s)

    def _error(self, s: Session, message: str) -> None:
        self._tell(s, {"event": "error", "message": message})

    @staticmethod
    def _tell(s: Session, data: dict) -> None:
        """An event for the session's caller, on its current turn."""
        s.events.put(MetaEvent(s.id, s.turns[-1].id if s.turns else 0, data))

    def _turn_mode(self, cid: str, call: str) -> Session:
        s = self.registry.get(cid)
        if s.mode != "turn":
            raise ValueError(f"{call} is for turn mode")
        return s

    def _apply_regenerate(self, s: Session) -> None:
        try:
            self._rewind(s, s.regenerate(self.clock()))
        except ValueError as e:
            self._error(s, str(e))

    def _forget_snapshot(self, cid: str) -> None:
        """Called from the registry: a closed session can no longer be resumed."""
        self._commands.put(functools.partial(self._closed_context.pop, cid, None))

    def _rewind(self, s: Session, frame: int) -> None:
        s.rewind(frame)
        self.kv.trim(s)

    def _check_in_range(self, sink_pages: int) -> None:
        """What a step sees (its sink and window) stays within the positions the model was built for."""
        seen = (sink_pages + self.bound.window_pages) * self.bound.page_size
        limit = self.model.config.max_position_embeddings
        if seen > limit:
            raise ValueError(
                f"a step would see {seen} steps (a sink of {sink_pages} pages and a window of "
                f"{self.bound.window_pages}), over the model's {limit} positions: shorten the prompt or the window"
            )
