"""Engine: every live conversation advanced by one batched model forward and one batched codec call per tick.

`step()` is one tick: ingest (callers' commands, then new user audio through the encoder) -> schedule (who computes
what this round, and their pages) -> run (one forward and one sampling over all of it) -> emit (newly complete frames
through the decoder, to each session's event queue). Schedule and run repeat for each of `frames_per_tick` rounds,
each followed by the decode of any turn's first audio; the rest is decoded once, at the end of the tick.
`start()` runs it in a thread. Callers on other threads never wait for a tick: `open` decides admission at once and
every call puts a command (`commands.py`) on a queue that the next tick applies first, in order (`handlers.py`; as
mini-sglang's scheduler takes its messages). Readers of stats get the `snapshot()` the last tick published.

Who owns what: a live `Session` belongs to the engine thread; its pages and cache handle to `KVManager`; the codec
rows to `AudioIO`; the batch to `ModelRunner`; the pick, preemption order, admission and deadlines to `scheduler`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from cache import PagePool
from codec import Tokenizer
from s2s.engine.audio_io import AudioIO
from s2s.engine.calibration import calibrate
from s2s.engine.commands import Calls, Close, Command, Push
from s2s.engine.config import EngineConfig
from s2s.engine.events import AudioEvent, CodesEvent, EventQueue, MetaEvent
from s2s.engine.frames import FrameRows
from s2s.engine.handlers import CommandHandlers, Open
from s2s.engine.metrics import CostModel, EngineSnapshot, EngineStats
from s2s.engine.prompts import Prompt, checked_prompt
from s2s.engine.registry import Refused, Registry
from s2s.engine.resumable import Resumable
from s2s.engine.session import Session
from s2s.engine.turns import Phase
from s2s.models.family import StepModel
from s2s.runner.model_runner import ModelRunner
from s2s.runner.sampling import SamplingParams
from s2s.scheduling.context import ContextBound
from s2s.scheduling.duplex_lane import DuplexLane
from s2s.scheduling.kv_manager import KVManager
from s2s.scheduling.round_batch import RoundBatch, to_sample
from s2s.scheduling.rounds import Rounds
from s2s.scheduling.scheduler import Admission, Scheduler

log = logging.getLogger("s2s.engine")

__all__ = ["AudioEvent", "CodesEvent", "Engine", "EngineConfig", "EngineSnapshot", "MetaEvent", "Refused"]


class Engine(Calls, CommandHandlers):
    runner_class: type[ModelRunner] = ModelRunner  # what computes a round (`s2s bench engine` swaps in a baseline)
    duplex_lane = True  # steady duplex conversations step as rows of arrays (`DuplexLane`); False: all as `Work`

    def __init__(
        self,
        model: StepModel,
        tokenizer: Tokenizer | None,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """`config`: filled in with the codec's frame size (`EngineConfig.take_frame_size`), which the tick, the
        deadlines and the audio follow."""
        self.model, self.tok, self.cfg, self.clock = model, tokenizer, config or EngineConfig(), clock
        mcfg, cfg = model.config, self.cfg
        if tokenizer is not None and mcfg.audio_codebooks != tokenizer.num_codebooks:
            raise ValueError(
                f"model uses {mcfg.audio_codebooks} codebooks but the codec {tokenizer.num_codebooks}: pick the "
                "codec bandwidth (EnCodec) or codebook count (Mimi) that matches"
            )
        if tokenizer is not None and mcfg.codebook_size < tokenizer.codebook_size:
            raise ValueError(
                f"the codec's codebooks have {tokenizer.codebook_size} entries but the model's {mcfg.codebook_size}: "
                "a model for another codec"
            )
        cfg.take_frame_size(tokenizer.frame_size if tokenizer is not None else None)
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
        window = mcfg.sliding_window  # the model's own (Moshi's context): the engine's window, with no sink
        self.bound = ContextBound.of(cfg.max_context, cfg.page_size, cfg.max_reply_frames, mcfg.max_delay, window)
        self.bound.check_positions(1, mcfg.max_position_embeddings)
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
            mcfg,
            cfg.frame_s,
            cfg.jitter_buffer_s,
            self.stats,
            clock,
            cfg.deterministic,
            cfg.frames_per_tick if cfg.cuda_graphs else None,
        )
        page_size = cfg.page_size if self.cache.shares_prefixes else None
        self.scheduler = Scheduler(cfg.prefill_budget, cfg.background_budget, cfg.frame_s, page_size)
        lane_rounds = cfg.frames_per_tick if self.duplex_lane else 0
        self.lane = DuplexLane(mcfg.delays, self.bound, lane_rounds, self.user_rows, self.model_rows, self.kv.tables)
        self.rounds = Rounds(self.scheduler, self.lane, self.kv, cfg)
        self.cost = CostModel()
        self.admission = Admission(
            self.cost,
            cfg.max_conversations,
            self.kv.capacity,
            cfg.frames_per_tick,
            cfg.tick_s,
            cfg.admission_headroom,
            self.bound.most_seen(self.bound.sink_pages(1)),
        )
        self.sessions: dict[str, Session] = {}  # live, in the order they opened: the engine thread's alone
        self.voices: dict[str, Prompt] = {}  # named voice prompts
        self.registry = Registry(
            mcfg, self.admission, self.bound, cfg.max_conversations, cfg.frame_size, self.stats, clock
        )
        self.resumable = Resumable(cfg.resumable_conversations, cfg.resumable_bytes, cfg.session_ttl_s, clock)
        self._commands: queue.SimpleQueue[tuple[object, Session]] = queue.SimpleQueue()  # (message, its session)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by `end_turn` (the engine thread ticks at once) and `stop`
        self._checked_idle = True  # `_check_when_idle` has run since the last conversation went
        self._turn_mode_sessions: list[Session] = []  # this tick's live sessions in turn mode
        calibrate(self)
        self._publish()

    # ---- public API: any thread, never waits for a tick ---------------------------------------------------------

    def add_voice(self, name: str, prompt: Prompt | np.ndarray | torch.Tensor) -> None:
        """Register a voice prompt under `name` (the codec's codes `[K, P]`, or a `Prompt` of both streams);
        conversations opened with `prompt=name` share its prefix."""
        prompt = checked_prompt(self.model.config, prompt, "voice codes")
        self.bound.check_positions(self.bound.sink_pages(prompt.frames), self.model.config.max_position_embeddings)
        self.voices[name] = prompt

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

        `resume=True` reopens the closed session `session_id`, closed with `keep=True` (`Resumable` says how long
        that is kept), with its whole context; the prefix cache gives back whatever of it is still cached.
        `admit=False` skips the cost check (the engine's own calibration only)."""
        if self.model.config.text_stream and mode != "duplex":
            raise ValueError(
                f"this model (with a text stream: Moshi's family) serves duplex conversations only, not {mode}"
            )
        if isinstance(prompt, str):
            if prompt not in self.voices:
                raise KeyError(f"no voice prompt named {prompt!r}; known: {sorted(self.voices)}")
            prompt = self.voices[prompt]
        elif prompt is not None:
            prompt = checked_prompt(self.model.config, prompt, "prompt codes")
            self.bound.check_positions(self.bound.sink_pages(prompt.frames), self.model.config.max_position_embeddings)
        if resume and session_id not in self.resumable:
            raise KeyError(f"no closed session {session_id!r} to resume (not kept, or no longer)")
        s = self.registry.admit(mode, sampling or SamplingParams(), session_id, admit)
        self._commands.put((Open(s.id, prompt, resume), s))
        return s.id

    def admission_problem(self, count: bool = False) -> str | None:
        """Why `open` would refuse a conversation now, or None: for a server that refuses before it accepts a
        connection (`count`: that refusal counts in `stats.refused`), and for its health check."""
        return self.registry.problem(count)

    def submit(self, command: Command) -> None:
        """Check `command` in the caller's thread (a ValueError for a bad argument or a call its conversation's mode
        cannot take, a KeyError for a conversation not open) and queue it for the next tick, after every earlier
        call's."""
        command = command.checked(self.model.config, self.tok is not None)
        if isinstance(command, Close):
            self.registry.close(command.cid, then=lambda s: self._queue_close(command, s))
            return
        s = self.registry.get(command.cid)
        command.check_mode(s.mode)
        if isinstance(command, Push):
            self.registry.fed(command.cid, command.kind)
            command = dataclasses.replace(command, pushed_at=self.clock())
        self._commands.put((command, s))
        if command.wakes:
            self._wake.set()

    def _queue_close(self, command: Close, s: Session) -> None:
        if command.keep:  # its place first: an `open(resume=True)` right after this call is admitted
            self.resumable.put(s.id)
        self._commands.put((command, s))

    def discard(self, cid: str) -> None:
        """Drop a session at once, keeping and caching nothing (calibration's). Only from the thread that calls
        `step()`, with no loop running."""
        s = self.registry.close(cid)
        self.scheduler.forget(cid)
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
        """One tick: ingest, then each round schedule, run and postprocess, then emit."""
        with self.runner.on_device():
            start, rounds = self.clock(), []
            self._ingest()
            for i in range(self.cfg.frames_per_tick):  # each round: one step of every due session
                if not (batch := self._schedule(i)):
                    break
                self._postprocess(batch, self._run(batch))
                rounds.append(batch)
            self._emit()
            self._record(start, rounds)

    def _ingest(self) -> None:
        self._apply_commands()
        self.resumable.expire()
        self._timed("encode", self.audio.encode, self.sessions.values())
        self._turn_mode_sessions = [s for s in self.sessions.values() if s.mode == "turn"]  # (the tick's own loops)
        for s in self._turn_mode_sessions:
            if s.end_of_turn_at is not None and not s.paused and s.start_reply(self.clock()):
                self._sample([s])  # the user's last step is already computed: sample at once
        self.kv.rematch(self.sessions.values())
        self.lane.take(list(self.sessions.values()))

    def _schedule(self, index: int) -> RoundBatch:
        t = self.clock()
        batch = self.rounds.schedule(index, list(self.sessions.values()), t)
        self.stats.phase_seconds["schedule"] += self.clock() - t
        return batch

    def _run(self, batch: RoundBatch) -> torch.Tensor | None:
        """The round's forward, then its sampling (which waits for the forward, on a GPU): the codes it drew."""
        t = self.clock()
        logits = self.runner.forward(batch)
        self.rounds.computed(batch, logits, self.clock())
        codes = self.runner.sample(batch)
        self.stats.phase_seconds["model"] += self.clock() - t
        return codes

    def _postprocess(self, batch: RoundBatch, codes: torch.Tensor | None) -> None:
        """The round's codes into the lane's rows and the sessions; a turn's first audio goes out at once (the
        tick's later rounds would delay it)."""
        t = self.clock()
        self.rounds.accept(batch, codes, t)
        for s in self._turn_mode_sessions:  # (a duplex session never replies by turn)
            if s.phase is Phase.REPLY:
                s.fill_reply_silence()
        self.stats.phase_seconds["model"] += self.clock() - t
        self._timed("decode", self.audio.decode, self.lane.others, first_audio_only=True)

    def _sample(self, sessions: list[Session]) -> None:
        """Sample each session's next codes from its last logits (a reply that starts on a step computed before)."""
        batch = RoundBatch([], sampled=to_sample(sessions))
        self.rounds.accept(batch, self.runner.sample(batch), self.clock())

    def _emit(self) -> None:
        """The tick's end: the lane's steps go back to their sessions, every session's new frames go out, and
        replies that are over end."""
        self.rounds.end_tick()
        self._timed("decode", self.audio.decode, self.sessions.values())
        self._finish_replies()
        self._check_when_idle()

    def _finish_replies(self) -> None:
        for s in self._turn_mode_sessions:
            if s.reply_over():
                data = s.finish_reply(self.clock())
                self._rewind(s, s.computed)
                self.kv.insert(s, lock=True)
                s.events.put(MetaEvent(s.id, data["turn"], data))
                self._release_held(s)

    def _record(self, start: float, rounds: list[RoundBatch]) -> None:
        decode, prefill = sum(b.decode_steps for b in rounds), sum(b.prefill_steps for b in rounds)
        elapsed = self.clock() - start
        keys = sum(b.keys for b in rounds)
        self.cost.observe(len(rounds), decode, prefill, elapsed, keys)  # the whole tick: what must fit the frame budget
        self.stats.record_tick(elapsed, prefill)
        self._publish()

    def _check_when_idle(self) -> None:
        """Once each time the last conversation has gone, `KVManager.check_idle`: a failure is counted and logged,
        and the engine goes on."""
        if self.sessions or self._checked_idle:
            self._checked_idle = not self.sessions
            return
        self._checked_idle = True
        self.stats.kv_checks += 1
        try:
            self.kv.check_idle(self.user_rows, self.model_rows)
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
