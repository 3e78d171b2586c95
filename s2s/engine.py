"""Engine: every live conversation advanced by one batched model forward and one batched codec call per tick.

`Engine.step()` is one tick and can be driven directly (tests, with a simulated clock); `Engine.start()` runs it in
a thread every `tick_s`. Callers on other threads use the public methods (they take the engine's lock, except
`push_audio` and `push_codes`, which only append to a deque) and read per-conversation event queues (`s2s.facade`
wraps that for asyncio). A tick:

1. encode new user audio, all conversations in one `StreamingEncoder` call;
2. pick the work (`Scheduler`): due duplex steps, turn replies, chunked prefill within the step budget; steps 2-4
   repeat `frames_per_tick` times;
3. one `S2SModel.forward_paged` over all of it, K/V through the prefix cache's pages;
4. sample the next model codes of every conversation at its frontier (seeded per conversation);
5. decode the model frames that became complete, all conversations in one `StreamingDecoder` call, and emit them.

Without a codec (`Engine(model, None)`, e.g. a text model over one codebook of bytes) conversations are fed codes
(`push_codes`) and emit `CodesEvent`s: steps 1 and 5 pass codes through. A codec engine takes `push_codes` too (a
conversation is fed either audio or codes, not both).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from cache import MatchResult, OutOfPages, PagePool, make_cache
from codec import EncodecTokenizer
from s2s.batch import PagedBatch
from s2s.conversation import UNKNOWN, Conversation, Phase, Turn
from s2s.cuda_graphs import DecodeGraphs
from s2s.metrics import CostModel, EngineStats
from s2s.model import S2SModel
from s2s.sampling import SamplingParams, sample
from s2s.scheduler import Scheduler, Work, first_audio_due, urgent

FRAME_S = 320 / 24000
# frames at each calibration size the cost model does not learn from: first calls at a new batch size, and the
# codec's streams starting (the encoder holds its first codes for 7 frames, then the decoder re-decodes 7)
CALIBRATION_WARMUP_FRAMES = 16


@dataclass
class EngineConfig:
    cache_mode: str = "radix"
    page_size: int = 16
    kv_budget_bytes: int | None = None
    num_pages: int | None = 4096  # used when kv_budget_bytes is None
    max_conversations: int = 32
    max_context: int = 4096  # steps; naive mode reserves this much per conversation
    frames_per_tick: int = 1  # duplex steps per conversation per tick: the codec works on chunks this long
    prefill_budget: int = 256  # prefill steps per tick, all conversations together
    background_budget: int = 16  # of those, for work nobody waits on, in a tick someone waits on (`Scheduler`)
    jitter_buffer_s: float | None = None  # default: 80 ms (clients send 80 ms blocks) + one tick
    max_reply_frames: int = 750
    session_ttl_s: float = 300.0  # a closed conversation can be resumed by id this long
    admission_headroom: float = 0.75  # admit while the predicted tick time stays under this share of tick_s
    calibration_ticks: int = 16  # ticks run at start on 1, 2 and 4 silent duplex conversations to seed the cost model
    cuda_graphs: bool = True  # on a GPU, replay single-step rounds from CUDA graphs (vLLM's default; off: eager)

    def __post_init__(self) -> None:
        if self.frames_per_tick < 1:
            raise ValueError(f"frames_per_tick must be >= 1, got {self.frames_per_tick}")
        if self.jitter_buffer_s is None:
            self.jitter_buffer_s = 0.08 + self.tick_s

    @property
    def tick_s(self) -> float:
        return self.frames_per_tick * FRAME_S


@dataclass
class AudioEvent:
    session: str
    turn: int
    first_frame: int
    pcm: np.ndarray  # float32, 24 kHz
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class CodesEvent:
    """Model frames `[K, n]` from `first_frame` on, as sampled ids (codec-free engines emit these instead of PCM)."""

    session: str
    turn: int
    first_frame: int
    codes: np.ndarray
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class MetaEvent:
    session: str
    turn: int
    data: dict


class EventQueue(queue.Queue):
    """A conversation's events. An asyncio reader sets `on_put` to wake itself instead of polling."""

    on_put: Callable[[], None] | None = None

    def _put(self, item) -> None:
        super()._put(item)
        if self.on_put is not None:
            self.on_put()


@dataclass
class EngineSnapshot:
    """The engine's state at one moment, copied under its lock: what readers on other threads (/metrics) see."""

    conversations: int
    cache: object  # cache.CacheStats
    stats: EngineStats
    sessions: list[dict]


class Refused(RuntimeError):
    """The engine cannot take this conversation now (full, or it would make admitted ones miss deadlines)."""


class Engine:
    def __init__(
        self,
        model: S2SModel,
        tokenizer: EncodecTokenizer | None,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.model, self.tok = model, tokenizer
        self.cfg = config or EngineConfig()
        self.clock = clock
        mcfg = model.config
        if tokenizer is not None and mcfg.num_codebooks != tokenizer.num_codebooks:
            raise ValueError(
                f"model uses {mcfg.num_codebooks} codebooks but the codec {tokenizer.num_codebooks}: pick the "
                "codec bandwidth that matches"
            )
        self.pool = PagePool(
            mcfg.num_hidden_layers,
            mcfg.num_key_value_heads,
            mcfg.head_dim,
            self.cfg.page_size,
            num_pages=None if self.cfg.kv_budget_bytes else self.cfg.num_pages,
            budget_bytes=self.cfg.kv_budget_bytes,
            dtype=next(model.parameters()).dtype,
            device=next(model.parameters()).device,
        )
        self.cache = make_cache(self.cfg.cache_mode, self.pool)
        self.graphs = (
            DecodeGraphs(
                model,
                self.pool.k,
                self.pool.v,
                self.cfg.page_size,
                self.cfg.max_conversations,
                max_pages=math.ceil(mcfg.max_position_embeddings / self.cfg.page_size),
            )
            if self.cfg.cuda_graphs and self.pool.k[0].is_cuda
            else None
        )
        n = self.cfg.max_conversations
        self.encoder = tokenizer.streaming_encoder(n) if tokenizer else None
        self.decoder = tokenizer.streaming_decoder(n) if tokenizer else None
        self.free_rows = list(range(n - 1, -1, -1))
        self.convs: dict[str, Conversation] = {}
        self.events: dict[str, EventQueue] = {}
        self.pending_input: dict[str, deque[np.ndarray]] = {}  # PCM or codes; appended without the lock
        self.input_kind: dict[str, str] = {}  # "audio" or "codes", fixed by a conversation's first push
        self.pending_end: dict[str, float] = {}  # turn mode: when each waiting reply's end of turn came
        self._closed: dict[str, tuple[dict, float]] = {}  # closed sessions' context, for resume within the TTL
        self.voices: dict[str, np.ndarray] = {}  # named voice prompts (codes [K, P])
        self.scheduler = Scheduler(
            self.cfg.prefill_budget,
            self.cfg.background_budget,
            self.cfg.page_size if self.cache.shares_prefixes else None,
        )
        self._inserts = 0  # prefix-cache inserts so far: a conversation re-matches only after new ones
        self.cost = CostModel()
        self.stats = EngineStats()
        if tokenizer is not None:
            silence = tokenizer.encode(np.zeros(320 * 16, dtype=np.float32))[0, :, -1]
            self.silence_codes = silence.cpu().numpy()  # what EnCodec makes of digital silence
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by `end_turn`: the engine thread ticks at once
        self._lock = threading.RLock()  # guards conversation state against calls from other threads
        if self.pool.k[0].is_cuda:
            with self._on_device():
                self.warm_up_prefill()
        self._calibrate()

    def add_voice(self, name: str, codes: np.ndarray | torch.Tensor) -> None:
        """Register a voice prompt under `name`; conversations opened with `prompt=name` share its prefix."""
        self.voices[name] = self._checked_codes(codes, "voice codes")

    def _checked_codes(self, codes: np.ndarray | torch.Tensor, what: str) -> np.ndarray:
        """`codes` as int64 `[K, n >= 1]` with every id a real code, or a ValueError saying what is wrong."""
        cfg = self.model.config
        codes = np.asarray(torch.as_tensor(codes).cpu(), dtype=np.int64)
        if codes.ndim != 2 or codes.shape[0] != cfg.num_codebooks or codes.shape[1] == 0:
            raise ValueError(f"{what} must be [K={cfg.num_codebooks}, n >= 1], got {codes.shape}")
        if codes.min() < 0 or codes.max() >= cfg.codebook_size:
            raise ValueError(f"{what} must lie in [0, {cfg.codebook_size})")
        return codes

    @torch.inference_mode()
    def warm_up_prefill(self) -> None:
        """Run the attention kernel's prefill variants once, storing nothing: Triton builds a kernel the first time
        it sees a tile shape, which takes seconds, and a turn's prefill in service must not wait for it (decode
        rounds warm up with the graphs and in calibration). The tile's rows are new steps per sequence times the
        query heads sharing a K/V head, rounded to 16, 32 or 64: these three step counts reach each of them."""
        device, ps = self.pool.k[0].device, self.cfg.page_size
        group = self.model.config.num_attention_heads // self.model.config.num_key_value_heads
        for steps in (1, max(1, 32 // group), 64):
            batch = PagedBatch(
                positions=torch.arange(steps, device=device),
                slot_mapping=torch.full((steps,), -1, dtype=torch.long, device=device),
                page_table=torch.zeros(1, -(-steps // ps), dtype=torch.int32, device=device),
                cu_seqlens_q=torch.tensor([0, steps], dtype=torch.int32, device=device),
                seqlens_k=torch.tensor([steps], device=device),
                page_size=ps,
                cached_lens=[0],
                new_lens=[steps],
                pages=[[0] * -(-steps // ps)],
            )
            tokens = torch.zeros(steps, self.model.config.step_width, dtype=torch.long, device=device)
            self.model.forward_paged(tokens, batch, self.pool.k, self.pool.v)

    def _calibrate(self) -> None:
        """Seed the cost model with real ticks (codec and model) on silent duplex conversations, like vLLM's
        profiling run, so that admission is right from the first burst; then forget them."""
        # each conversation brings a tick's worth of frames, as in service: ticks of frames_per_tick rounds
        frames = self.cfg.frames_per_tick
        silence = np.zeros(320 * frames, dtype=np.float32)
        zeros = np.zeros((self.model.config.num_codebooks, frames), dtype=np.int64)
        for n in (1, 1, 2, 4):  # the first pass only warms up (kernel builds, allocators) and is forgotten
            if n == 1 and self.cost.samples:
                self.cost = CostModel()
            if n > self.cfg.max_conversations or not self.cfg.calibration_ticks:
                break
            cids = [self.open("duplex", sampling=SamplingParams(seed=i), admit=False) for i in range(n)]
            kept = len(self.cost.samples)
            warmup = math.ceil(CALIBRATION_WARMUP_FRAMES / frames)
            for tick in range(warmup + self.cfg.calibration_ticks):
                for cid in cids:
                    if self.tok is None:
                        self.push_codes(cid, zeros)
                    else:
                        self.push_audio(cid, silence)
                self.step()
                if tick < warmup:
                    self.cost.forget_after(kept)
            for cid in cids:
                self._detach(self.convs.pop(cid))
                del self.pending_input[cid], self.events[cid]
                self.input_kind.pop(cid, None)
        self.cost.pin()  # several batch sizes: service ticks alone may not tell rounds from steps
        self.stats = EngineStats()

    # ---- public API (thread-safe) ------------------------------------------------------------------------------

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
        prefix cache gives back whatever of it is still cached. `admit=False` skips admission control (the
        engine's own calibration only)."""
        with self._lock:
            self._forget_expired()
            if isinstance(prompt, str):
                if prompt not in self.voices:
                    raise KeyError(f"no voice prompt named {prompt!r}; known: {sorted(self.voices)}")
                prompt = self.voices[prompt]
            if resume and session_id not in self._closed:
                raise KeyError(f"no closed session {session_id!r} to resume (never opened, or older than the TTL)")
            reason = self._admission_problem(mode) if admit else None
            if reason:
                self.stats.refused += 1
                raise Refused(reason)
            cid = session_id or f"s{next(self._ids)}"
            if cid in self.convs:
                raise ValueError(f"session {cid!r} is already open")
            row = self.free_rows.pop()
            conv = Conversation(cid, mode, self.model.config, sampling or SamplingParams(), row, self.clock())
            if resume:
                conv.restore(self._closed.pop(session_id)[0])
            elif prompt is not None:
                conv.set_prompt(self._checked_codes(prompt, "prompt codes"))
            self._attach_cache(conv)
            reserve = self.cache.pages_on_open(self.cfg.max_context)
            if reserve:
                try:
                    conv.own_pages = self.cache.alloc(max(0, reserve - len(conv.pages)))
                except OutOfPages as e:
                    self._detach(conv)
                    self.stats.refused += 1
                    raise Refused(f"no K/V memory for another conversation: {e}") from e
            self._reset_codec(row)
            self.convs[cid] = conv
            self.events[cid] = EventQueue()
            self.pending_input[cid] = deque()
            if not conv.turns and (mode == "duplex" or conv.prompt_frames):
                conv.turns.append(Turn(0, conv.prompt_frames))
            return cid

    def push_audio(self, cid: str, pcm: np.ndarray) -> None:
        """User PCM (float32, 24 kHz, any length); encoded in the next tick with everyone else's. Does not wait for
        the tick in progress (no lock: a deque append is atomic)."""
        if self.tok is None:
            raise ValueError("this engine has no codec: feed it codes with push_codes")
        self._pending(cid, "audio").append(np.asarray(pcm, dtype=np.float32).reshape(-1))

    def push_codes(self, cid: str, codes: np.ndarray | torch.Tensor) -> None:
        """User frames given as codes `[K, n]` (ids below `codebook_size`), taken in the next tick as they are: the
        input of a codec-free engine, or text bytes fed to a speech model as its user stream."""
        self._pending(cid, "codes").append(self._checked_codes(codes, "codes"))

    def _pending(self, cid: str, kind: str) -> deque[np.ndarray]:
        parts = self.pending_input.get(cid)
        if parts is None:
            raise KeyError(f"no open session {cid!r}")
        if self.input_kind.setdefault(cid, kind) != kind:
            raise ValueError(f"session {cid!r} is fed {self.input_kind[cid]}, not {kind}")
        return parts

    def end_turn(self, cid: str) -> None:
        """Turn mode: the user finished speaking; the reply starts once their audio is in."""
        with self._lock:
            conv = self._conv(cid)
            if conv.mode != "turn":
                raise ValueError("end_turn is for turn mode")
            answered = conv.turns and conv.turns[-1].reply_start is not None and not self.pending_input[cid]
            if conv.phase is Phase.REPLY or answered:
                return  # no new speech since the last reply (a second end of turn, from VAD and the client both)
            # stamped on the turn when its reply starts: the turn itself may not exist yet (audio still queued)
            self.pending_end.setdefault(cid, self.clock())
            self._wake.set()

    def interrupt(self, cid: str, played_frames: int) -> None:
        """Barge-in: cancel the reply and keep in the context only the `played_frames` frames the user heard."""
        with self._lock:
            conv = self._conv(cid)
            if conv.phase is not Phase.REPLY:
                return
            turn = conv.turns[-1]
            cut = turn.reply_start + max(0, min(played_frames, conv.complete_model_frames() - turn.reply_start))
            turn.reply_end = cut
            turn.times["interrupted"] = self.clock()
            self._rewind(conv, cut)
            if self.decoder is not None:
                self.decoder.reset(conv.row)
            conv.phase = Phase.LISTEN
            conv.emitted = cut
            self._drop_queued_audio(conv, turn.id)

    def close(self, cid: str) -> None:
        """End the conversation: its context goes into the prefix cache, its private pages are freed."""
        with self._lock:
            conv = self._conv(cid)
            self._insert(conv, lock=False)
            self._detach(conv)
            self._closed[cid] = (conv.snapshot(), self.clock())
            del self.convs[cid], self.pending_input[cid]
            self.input_kind.pop(cid, None)
            self.pending_end.pop(cid, None)
            self.events.pop(cid).put(None)

    def regenerate(self, cid: str) -> None:
        """Turn mode: drop the last reply and generate it again (a new draw unless sampling is greedy or seeded);
        everything before the reply keeps its K/V."""
        with self._lock:
            conv = self._conv(cid)
            if conv.mode != "turn" or conv.phase is not Phase.LISTEN or not conv.turns:
                raise ValueError("regenerate needs a turn-mode conversation that has finished a reply")
            turn = conv.turns[-1]
            if turn.reply_start is None:
                raise ValueError("the last turn has no reply to regenerate")
            self._rewind(conv, turn.reply_start)
            turn.reply_start = turn.reply_end = None
            turn.times = {"regenerate": self.clock()}
            self.pending_end[cid] = turn.times["regenerate"]

    def _drop_queued_audio(self, conv: Conversation, turn_id: int) -> None:
        """Take the cancelled turn's audio the caller has not read yet out of its queue; keep everything else."""
        q = self.events[conv.id]
        kept = []
        while True:
            try:
                event = q.get_nowait()
            except queue.Empty:
                break
            if not (isinstance(event, AudioEvent | CodesEvent) and event.turn == turn_id):
                kept.append(event)
        for event in kept:
            q.put(event)

    def _forget_expired(self) -> None:
        now = self.clock()
        for cid in [c for c, (_, t) in self._closed.items() if now - t > self.cfg.session_ttl_s]:
            del self._closed[cid]

    def conversation_stats(self) -> list[dict]:
        """Per live conversation, for the server's /metrics."""
        with self._lock:
            return [
                {
                    "session": c.id,
                    "mode": c.mode,
                    "phase": c.phase.value,
                    "turn": c.turns[-1].id if c.turns else 0,
                    "steps": c.computed,
                    "pages": len(c.pages),
                    "own_pages": len(c.own_pages),
                    "cached_steps_at_open": c.cached_at_open,
                    "frames_out": c.emitted,
                    "deadline_misses": c.deadline_misses,
                }
                for c in self.convs.values()
            ]

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            stats = copy.copy(self.stats)
            stats.tick_seconds, stats.phase_seconds = deque(self.stats.tick_seconds), dict(self.stats.phase_seconds)
            return EngineSnapshot(len(self.convs), self.cache.stats(), stats, self.conversation_stats())

    def event_queue(self, cid: str) -> EventQueue:
        return self.events[cid]

    def start(self) -> None:
        """Run `step()` every `tick_s` in a thread until `stop()`."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="s2s-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ---- the tick ----------------------------------------------------------------------------------------------

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
        """A duplex conversation still has a step it could take now: its input came in faster than a tick's worth
        (clients send 80 ms blocks), so the next tick starts at once instead of waiting for its slot."""
        with self._lock:
            return any(
                c.mode == "duplex" and c.step_token(c.computed) is not None and c.wanted_after(1)
                for c in self.convs.values()
            )

    def _on_device(self) -> contextlib.AbstractContextManager:
        """The pool's GPU as the thread's current one: Triton launches and CUDA graphs go to the current device,
        which is per thread and cuda:0 unless set."""
        device = self.pool.k[0].device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def step(self) -> None:
        with self._lock, self._on_device():
            start = self.clock()
            phases = self.stats.phase_seconds
            self._encode()
            t_encoded = self.clock()
            self._start_replies()
            self._rematch()
            decode_steps = prefill_steps = rounds = 0
            for i in range(self.cfg.frames_per_tick):  # each round: one step of every due conversation
                t = self.clock()
                work = self.scheduler.pick(list(self.convs.values()), start, self._deadline, prefill=i == 0)
                work = self._reserve_pages(work)
                if not work:
                    break
                t_picked = self.clock()
                self._forward(work)
                self._sample([w.conv for w in work])  # waits for the forward: on a GPU its time lands here
                t_sampled = self.clock()
                self._advance_replies()
                t_decode = self.clock()
                self._decode_audio(first_audio_only=True)  # a turn's first audio leaves now, not after the tick
                phases["decode"] += self.clock() - t_decode
                rounds += 1
                decode_steps += sum(1 for w in work if w.decode)
                prefill_steps += sum(len(w.tokens) for w in work if not w.decode)
                phases["schedule"] += t_picked - t
                phases["model"] += t_sampled - t_picked
            t_decode = self.clock()
            self._decode_audio()
            phases["decode"] += self.clock() - t_decode
            self._finish_replies()
            elapsed = self.clock() - start
            phases["encode"] += t_encoded - start
            # the whole tick, codec included: that is what must fit the frame budget
            self.cost.observe(rounds, decode_steps, prefill_steps, elapsed)
            self.stats.record_tick(elapsed, decode_steps, prefill_steps, len(self.convs), self.cache.stats())

    def _encode(self) -> None:
        """New user frames: pushed audio through the streaming encoder (one call), pushed codes as they are."""
        rows, chunks, owners, direct = [], [], [], []
        for cid, parts in self.pending_input.items():
            taken = []
            while parts:
                taken.append(parts.popleft())
            if not taken:
                continue
            conv = self.convs[cid]
            if self.input_kind[cid] == "codes":
                direct.append((conv, np.concatenate(taken, axis=1)))
            else:
                rows.append(conv.row)
                chunks.append(np.concatenate(taken))
                owners.append(conv)
        if rows:
            encoded = zip(owners, (c.cpu().numpy() for c in self.encoder.push(chunks, rows)), strict=True)
            direct += [(conv, codes) for conv, codes in encoded if codes.shape[-1]]
        now = self.clock()
        for conv, codes in direct:
            if conv.first_frame_at is None:
                conv.first_frame_at = now
            if conv.mode == "turn" and (not conv.turns or conv.turns[-1].reply_start is not None):
                if conv.phase is Phase.LISTEN:
                    conv.turns.append(Turn(len(conv.turns), conv.user_frames, times={"first_audio_in": now}))
            conv.add_user_frames(codes)

    def _start_replies(self) -> None:
        """Turn mode: once a finished turn's audio is all encoded, the model stream becomes predicted."""
        for cid in list(self.pending_end):
            conv = self.convs[cid]
            if self.pending_input[cid] or conv.phase is Phase.REPLY or not conv.turns:
                continue
            ended = self.pending_end.pop(cid)
            turn = conv.turns[-1]
            turn.times.setdefault("end_of_turn", ended)
            turn.reply_start = conv.user_frames
            turn.times["reply_start"] = self.clock()
            conv.phase = Phase.REPLY
            conv.emitted = turn.reply_start
            self._fill_reply_silence(conv)
            if conv.computed == turn.reply_start and conv.last_logits is not None:
                turn.times["prefill_done"] = turn.times["reply_start"]
                self._sample([conv])  # the user's last step is already computed: sample at once

    def _fill_reply_silence(self, conv: Conversation) -> None:
        """While replying, the user stream is silent; after the reply's end, the model stream is too."""
        turn = conv.turns[-1]
        horizon = conv.computed + int(conv.delays.max()) + 2
        conv._ensure(horizon + 1)
        silent = self.model.config.silent_id
        for f in range(turn.reply_start, horizon):
            if conv.user[f, 0] == UNKNOWN:
                conv.user[f] = silent
        conv.user_frames = max(conv.user_frames, horizon)
        if turn.reply_end is not None:
            block = conv.model[turn.reply_end : horizon]
            block[block == UNKNOWN] = silent

    def _advance_replies(self) -> None:
        for conv in self.convs.values():
            if conv.phase is Phase.REPLY:
                self._fill_reply_silence(conv)

    def _finish_replies(self) -> None:
        """A reply is over once every codebook of its frames is known and decoded: back to listening."""
        for conv in self.convs.values():
            if conv.phase is not Phase.REPLY:
                continue
            turn = conv.turns[-1]
            if turn.reply_end is None or conv.emitted < turn.reply_end:
                continue
            turn.times["reply_done"] = self.clock()
            self._rewind(conv, conv.computed)
            conv.phase = Phase.LISTEN
            self._insert(conv, lock=True)
            frames = int(turn.reply_end - turn.reply_start)
            self._emit_meta(conv, {"event": "reply_done", "turn": turn.id, "frames": frames, "times": dict(turn.times)})

    def _rewind(self, conv: Conversation, frame: int) -> None:
        """Forget everything from `frame` on (both streams); K/V of later steps are dropped."""
        conv.idle_frames = -1  # it is no longer what was preempted (`Conversation.dormant`)
        conv.user[frame:] = UNKNOWN
        conv.model[frame:] = UNKNOWN
        conv.user_frames = frame
        if conv.computed > frame:
            # the stored logits belong to a forgotten step: recompute step frame - 1 to predict frame again
            conv.computed = max(0, frame - 1)
            conv.last_logits = None
        keep = math.ceil(conv.computed / self.cfg.page_size)
        if conv.computed % self.cfg.page_size and len(conv.pages) >= keep:
            last = conv.pages[keep - 1]
            if last not in conv.own_pages or self.pool.refcount(last) > 1:
                # the cut falls inside a page the prefix cache holds: never write into it; copy the steps before
                # the cut into a page of its own, or recompute them if there is none to be had
                copy = self._private_copy(last, conv.computed % self.cfg.page_size)
                if copy is None:
                    keep -= 1
                    conv.computed = keep * self.cfg.page_size
                    conv.last_logits = None
                else:
                    conv.pages[keep - 1] = copy
                    conv.own_pages.append(copy)
                    if last in conv.own_pages:
                        conv.own_pages.remove(last)
                        self.cache.release([last])
        if self.cache.pages_on_open(self.cfg.max_context) == 0 and len(conv.pages) > keep:
            owned = set(conv.own_pages)
            own = [p for p in conv.pages[keep:] if p in owned]
            conv.pages = conv.pages[:keep]
            released = set(own)
            conv.own_pages = [p for p in conv.own_pages if p not in released]
            self.cache.release(own)

    def _deadline(self, conv: Conversation) -> float:
        """When the output frame the next step leads to must be sent (duplex), for earliest-deadline-first."""
        if conv.first_frame_at is None:
            return math.inf
        frame = conv.computed - conv.prompt_frames
        return conv.first_frame_at + frame * FRAME_S + self.cfg.jitter_buffer_s

    def _reserve_pages(self, work: list[Work]) -> list[Work]:
        """Pages for this round's work. When the pool runs short, a conversation preempts another (`_victim` says
        which: a listener between turns first, a newer one at the end); a prefill shrinks to what fits; otherwise
        it waits a tick. Without this, conversations that each hold some pages and each need one more, or
        listeners holding theirs while another cannot start its turn, would wait on each other for ever."""
        kept: list[Work] = []
        busy = {w.conv.id for w in work}
        preempted: set[str] = set()
        for w in work:
            conv = w.conv
            if conv.id in preempted:
                continue
            while (need := math.ceil((conv.computed + len(w.tokens)) / self.cfg.page_size) - len(conv.pages)) > 0:
                in_table = set(conv.pages)
                take = [p for p in conv.own_pages if p not in in_table][:need]  # naive: reserved up front
                try:
                    new = take + (self.cache.alloc(need - len(take)) if need > len(take) else [])
                except OutOfPages:
                    self.stats.out_of_pages += 1
                    victim = self._victim(conv, busy - preempted)
                    if victim is not None:
                        self._preempt(victim)
                        preempted.add(victim.id)
                        kept = [k for k in kept if k.conv is not victim]
                        continue
                    s = self.cache.stats()
                    fit = (len(conv.pages) + s.free + s.cached_evictable) * self.cfg.page_size - conv.computed
                    if not w.decode and 0 < fit < len(w.tokens):
                        w = Work(conv, w.tokens[:fit], False)
                        continue
                    break  # this conversation waits a tick
                conv.pages += new
                owned = set(conv.own_pages)
                conv.own_pages += [p for p in new if p not in owned]
            else:
                kept.append(w)
        return kept

    def _victim(self, conv: Conversation, busy: set[str]) -> Conversation | None:
        """Whose pages `conv` may take (see `_reserve_pages`); None: it waits. Pages held only through a cache lock
        count too: unlocked, they become evictable.

        First a listener between turns (its last turn answered, nothing to compute), least recently active first:
        nothing needs its K/V soon. A user mid-utterance with nothing to compute until their next 80 ms block would
        recompute the whole conversation before their answer, so only a conversation someone is waiting on (its
        reply, or a live duplex stream: `urgent`) takes theirs; the recompute then partly hides behind the rest of
        their speech. Otherwise vLLM's order, first come first served: the one opened last, if it opened after `conv`
        (a conversation with no pages too: one preempted earlier whose user now speaks). The one opened last never
        preempts itself: every older conversation that needs its pages takes them, and it would only compute them
        again into the same short pool the next tick."""
        if self.cache.pages_on_open(self.cfg.max_context):
            return None  # naive reserved every page at open: it never runs short
        others = [c for c in self.convs.values() if c.pages and c is not conv]
        listening = [
            c
            for c in others
            if c.id not in busy and c.mode == "turn" and c.phase is Phase.LISTEN and c.step_token(c.computed) is None
        ]
        between = [c for c in listening if self._answered(c)]
        if between or (listening and urgent(conv)):
            return min(between or listening, key=lambda c: c.last_active)
        order = {cid: i for i, cid in enumerate(self.convs)}  # `convs` keeps the order they opened in
        newest = max(others, key=lambda c: order[c.id], default=None)
        return newest if newest is not None and order[newest.id] > order[conv.id] else None

    @staticmethod
    def _answered(conv: Conversation) -> bool:
        """Its last turn has its reply (not cut by a barge-in, whose speech is on its way), or no speech yet."""
        if not conv.turns:
            return True
        turn = conv.turns[-1]
        if turn.reply_start is None:
            return conv.user_frames == turn.first_frame  # the turn opened with a voice prompt, before any speech
        return "interrupted" not in turn.times

    def _preempt(self, conv: Conversation) -> None:
        """Give back a conversation's pages and recompute its K/V later (its frames are kept). Its full pages go to
        the prefix cache first, so what is not evicted meanwhile comes back on its next match."""
        if conv.mode == "turn" and conv.phase is Phase.LISTEN and conv.step_token(conv.computed) is None:
            conv.idle_frames = conv.user_frames  # all it had is computed: nothing to do until its user speaks
        self._insert(conv, lock=False)
        self.cache.release(conv.own_pages)
        if conv.handle is not None:
            self.cache.unlock(conv.handle)
        conv.own_pages, conv.pages, conv.handle = [], [], None
        conv.computed, conv.last_logits = 0, None
        conv.seen_inserts, conv.open_key_steps = -1, 0  # re-match at once; what it gets back counts as hits
        self.stats.preempted += 1

    def _forward(self, work: list[Work]) -> None:
        convs = [w.conv for w in work]
        tokens = np.concatenate([w.tokens for w in work])
        pages = [c.pages for c in convs]
        if self.graphs is not None and len(tokens) == len(work) and self.graphs.fits(len(work), pages):
            logits = self.graphs.run(tokens, [c.computed for c in convs], pages)
        else:
            batch = PagedBatch.build(
                [c.computed for c in convs],
                [len(w.tokens) for w in work],
                pages,
                self.cfg.page_size,
                device=self.pool.k[0].device,
            )
            device_tokens = torch.from_numpy(tokens).to(self.pool.k[0].device)
            logits = self.model.forward_paged(device_tokens, batch, self.pool.k, self.pool.v).logits
        now = self.clock()
        for i, w in enumerate(work):
            w.conv.last_active = now
            w.conv.computed += len(w.tokens)
            w.conv.last_logits = logits[i]
            turn = w.conv.turns[-1] if w.conv.turns else None
            if turn is not None and turn.reply_start is not None and w.conv.computed >= turn.reply_start:
                turn.times.setdefault("prefill_done", now)
            if not w.decode:
                self._insert(w.conv, lock=True)  # a prefill chunk: conversations behind it can share it next tick

    def _sample(self, convs: list[Conversation]) -> None:
        todo = [c for c in convs if c.last_logits is not None and c.wanted()]
        if not todo:
            return
        logits = torch.stack([c.last_logits for c in todo])
        codes = sample(logits, [c.sampling for c in todo], [c.generator for c in todo], self.model.config.pad_id)
        now = self.clock()
        end = self.model.config.end_id
        for conv, c in zip(todo, codes.cpu().numpy(), strict=True):
            filled = conv.accept(c)
            if conv.phase is not Phase.REPLY:
                continue
            turn = conv.turns[-1]
            turn.times.setdefault("first_step", now)
            for f, k in filled:
                if (
                    k == 0
                    and turn.reply_end is None
                    and (conv.model[f, 0] == end or f - turn.reply_start + 1 >= self.cfg.max_reply_frames)
                ):
                    turn.reply_end = f + 1 if conv.model[f, 0] != end else f
            if turn.reply_end is not None:
                self._fill_reply_silence(conv)

    def _decode_audio(self, first_audio_only: bool = False) -> None:
        """Decode and send every conversation's newly complete frames (one decoder call per chunk length).
        `first_audio_only`: only turns whose reply has its first frame complete and nothing sent yet; the rest
        of the tick's rounds would otherwise delay that first audio (the user is waiting on it)."""
        groups: dict[int, list[tuple[Conversation, int, int]]] = {}
        for conv in self.convs.values():
            if first_audio_only and not first_audio_due(conv):
                continue
            start, stop = self._sendable(conv)
            if stop > start:
                groups.setdefault(stop - start, []).append((conv, start, stop))
        cfg = self.model.config
        for items in groups.values():
            codes = np.stack([conv.model[a:b].T for conv, a, b in items])
            if self.decoder is None:
                out = codes  # codec-free: the sampled ids themselves
            else:
                codes = np.where(codes < cfg.codebook_size, codes, self.silence_codes[None, :, None])
                out = self.decoder.push(torch.from_numpy(codes), [conv.row for conv, _, _ in items]).cpu().numpy()
            now = self.clock()
            for (conv, a, b), audio in zip(items, out, strict=True):
                conv.emitted = b
                turn = conv.turns[-1]
                turn.times.setdefault("first_audio_out", now)
                if conv.mode == "duplex":
                    for f in range(a, b):
                        if (
                            now
                            > conv.first_frame_at + (f - conv.prompt_frames + 1) * FRAME_S + self.cfg.jitter_buffer_s
                        ):
                            self.stats.deadline_misses += 1
                event = AudioEvent if self.decoder is not None else CodesEvent
                self.events[conv.id].put(event(conv.id, turn.id, a, audio, dict(turn.times)))

    def _sendable(self, conv: Conversation) -> tuple[int, int]:
        complete = conv.complete_model_frames()
        if conv.mode == "duplex":
            start = max(conv.emitted, conv.prompt_frames)
            return start, complete if conv.first_frame_at is not None else start
        if conv.phase is not Phase.REPLY:
            return conv.emitted, conv.emitted
        turn = conv.turns[-1]
        stop = complete if turn.reply_end is None else min(complete, turn.reply_end)
        return conv.emitted, max(conv.emitted, stop)

    # ---- cache bookkeeping -------------------------------------------------------------------------------------

    def _attach_cache(self, conv: Conversation) -> None:
        """Match the longest cached prefix of what the conversation knows so far and lock it."""
        key = conv.known_key()
        conv.open_key_steps, conv.seen_inserts = len(key), self._inserts
        m = self.cache.match(key) if len(key) else None
        if m is None:
            return
        if m.cached_steps:
            self.cache.lock(m.handle)
            conv.handle = m.handle
        conv.pages, conv.computed = self._matched_table(m)
        conv.own_pages += conv.pages[len(m.pages) :]
        self.cache.record_hits(conv.computed - m.cached_steps, conv.computed - m.cached_steps)
        conv.cached_at_open = conv.computed

    def _matched_table(self, m: MatchResult) -> tuple[list[int], int]:
        """The page table and the steps a match gives: its pages, and a private copy of its partial page's steps when
        a page can be had for it (the copy is the caller's own). Lock `m.handle` first: the copy's page may evict."""
        table, steps = list(m.pages), m.cached_steps
        if m.partial and (copy := self._private_copy(*m.partial)) is not None:
            table.append(copy)
            steps += m.partial[1]
        return table, steps

    def _private_copy(self, page: int, steps: int) -> int | None:
        """Copy-on-write: a new page of the caller's own holding the first `steps` steps of `page`, which the cache
        or another conversation holds (never written into); None when no page can be had (compute them instead)."""
        self.cache.hold([page])  # keeps it alive while `alloc` evicts
        try:
            (copy,) = self.cache.alloc(1)
        except OutOfPages:
            return None
        else:
            self.pool.copy_steps(page, copy, steps)
            self.stats.copied_steps += steps
            return copy
        finally:
            self.cache.release([page])

    def _rematch(self) -> None:
        """A conversation with prefill waiting takes what the cache gained since it last looked: the pages another
        conversation has just computed for the same prefix (vLLM and SGLang match when they schedule, not only on
        arrival). Conversations that arrive together thus compute a shared prefix once; the scheduler holds back all
        but one of those about to compute the same page (`Scheduler` with `page_size`)."""
        if not self.cache.shares_prefixes:
            return
        page = self.cfg.page_size
        for conv in self.convs.values():
            if conv.seen_inserts == self._inserts or conv.step_token(conv.computed + page) is None:
                continue  # nothing new in the cache, or less than a page of prefill waiting
            if conv.dormant:
                continue  # locking its old pages again would take them from whoever preempted it
            conv.seen_inserts = self._inserts
            m = self.cache.match(conv.known_key(), record=False)
            if m.cached_steps + (m.partial[1] if m.partial else 0) <= conv.computed:
                continue
            self.cache.lock(m.handle)
            table, cached = self._matched_table(m)
            if cached <= conv.computed:  # the copy it counted on could not be made
                self.cache.unlock(m.handle)
                continue
            if conv.handle is not None:
                self.cache.unlock(conv.handle)
            conv.handle = m.handle
            kept = set(table)
            dropped = [p for p in conv.pages if p not in kept]
            if not set(dropped) <= set(conv.own_pages):
                raise AssertionError(f"{conv.id}: a matched page left its table on a re-match")
            self.cache.release(dropped)
            gone = set(dropped)
            conv.own_pages = [p for p in conv.own_pages if p not in gone] + table[len(m.pages) :]
            self.cache.record_hits(cached - conv.computed, max(0, min(cached, conv.open_key_steps) - conv.computed))
            conv.pages, conv.computed, conv.last_logits = table, cached, None

    def _insert(self, conv: Conversation, lock: bool) -> None:
        full = conv.computed // self.cfg.page_size * self.cfg.page_size
        if full == 0:
            return
        self._inserts += 1
        handle = self.cache.insert(conv.key(full), conv.pages[: full // self.cfg.page_size])
        if lock:
            self.cache.lock(handle)
        if conv.handle is not None:
            self.cache.unlock(conv.handle)
        conv.handle = handle if lock else None

    def _detach(self, conv: Conversation) -> None:
        self.cache.release(conv.own_pages)
        conv.own_pages, conv.pages = [], []
        if conv.handle is not None:
            self.cache.unlock(conv.handle)
            conv.handle = None
        self._reset_codec(conv.row)
        self.free_rows.append(conv.row)

    def _reset_codec(self, row: int) -> None:
        if self.encoder is not None:
            self.encoder.reset(row)
            self.decoder.reset(row)

    # ---- admission ---------------------------------------------------------------------------------------------

    def _admission_problem(self, mode: str) -> str | None:
        if mode not in ("duplex", "turn"):
            raise ValueError(f"mode must be duplex or turn, got {mode!r}")
        if not self.free_rows or len(self.convs) >= self.cfg.max_conversations:
            return f"the engine holds its maximum of {self.cfg.max_conversations} conversations"
        if not self.convs:
            return None  # an idle engine always takes one: nothing else would ever correct a pessimistic cost model
        # Every conversation counts as a real-time stream: a turn-mode one replies one step per frame, like duplex,
        # and all of them may reply at once. Counting only duplex let 16 turn conversations starve together.
        streams = len(self.convs) + 1
        predicted = self.cost.predict(self.cfg.frames_per_tick, streams * self.cfg.frames_per_tick)
        budget = self.cfg.tick_s * self.cfg.admission_headroom
        if predicted is not None and predicted > budget:
            return (
                f"admitting another conversation would make a tick take {predicted * 1000:.1f} ms, over "
                f"the {budget * 1000:.1f} ms budget: admitted conversations would miss their frame deadlines"
            )
        return None

    def _conv(self, cid: str) -> Conversation:
        conv = self.convs.get(cid)
        if conv is None:
            raise KeyError(f"no open session {cid!r}")
        return conv

    def _emit_meta(self, conv: Conversation, data: dict) -> None:
        self.events[conv.id].put(MetaEvent(conv.id, data.get("turn", 0), data))
