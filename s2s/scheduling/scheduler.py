"""Scheduler: what each round's single batched forward computes, whose pages go when the pool runs short, whom
the engine admits, and the one deadline every duplex frame is held to.

Every session whose next step is known and leads to a sampled frame decodes one step (duplex steps and turn replies:
these are the deadlines, and admission keeps them affordable), earliest deadline first. Prefill (voice prompts, a
turn's user frames) shares a per-tick step budget. Urgent prefill goes first, longest waiting first: a turn whose
user has stopped speaking (its time to first audio is running) and a duplex stream already live (its frame deadlines
are). The rest is background (a prompt or a turn's speech computed while the user still talks, which the speech
hides): most cached steps first, with aging so that a cold session is not starved by a stream of warm ones (sglang
#31954). In a tick someone waits on (urgent prefill, or a turn's reply before its first audio has left), background
prefill gets at most `background_budget` steps: that tick's length is someone's time to first audio, and work the
speech hides can wait one tick (vLLM caps long prefills per step for the same reason, `long_prefill_token_threshold`).
Where the cache shares prefixes (`page_size` given), of the sessions about to compute the same next page on the same
cached prefix only the first goes this tick: the others take its pages from the cache next tick instead of computing
them again (SGLang's in-batch prefix caching).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from s2s.engine.metrics import CostModel
from s2s.engine.session import Session
from s2s.engine.turns import Phase

AGING_STEPS_PER_S = 2000.0  # a second of waiting counts like this many cached steps


@dataclass
class Work:
    session: Session
    tokens: np.ndarray  # [n, 2K] step tokens to compute
    decode: bool  # one step whose logits are sampled (a frame deadline depends on it)
    wanted: list[tuple[int, int]] | None = None  # a decode step's: what sampling its logits fills (`wanted_after(1)`)


def frame_deadline(
    arrived: float | np.ndarray, frame: int | np.ndarray, frame_s: float, jitter_buffer_s: float
) -> float | np.ndarray:
    """When a duplex stream's model frame `frame` (counted from the end of its voice prompt) must be sent: its user
    frame's arrival time, one frame (`frame_s`, the codec's) later, plus the jitter buffer; `arrived`: when the user's
    first frame came in. Scalars, or numpy arrays along sessions or frames alike."""
    return arrived + (frame + 1) * frame_s + jitter_buffer_s


class Scheduler:
    def __init__(self, prefill_budget: int, background_budget: int, frame_s: float, page_size: int | None = None):
        """`frame_s`: a frame's duration (the codec's), which the deadlines count in."""
        if min(prefill_budget, background_budget) < 1:
            raise ValueError(
                f"prefill_budget and background_budget must be >= 1, got {prefill_budget} and {background_budget}"
            )
        self.prefill_budget, self.background_budget, self.page_size = prefill_budget, background_budget, page_size
        self.frame_s = frame_s
        self._waiting_since: dict[str, float] = {}

    def forget(self, cid: str) -> None:
        """A closed session waits no longer."""
        self._waiting_since.pop(cid, None)

    def deadline(self, s: Session) -> float:
        """The deadline of the first frame the session's next step completes, less the jitter buffer (the same for
        every session: it does not change the order)."""
        if s.first_frame_at is None:
            return math.inf
        return frame_deadline(s.first_frame_at, s.computed + 1 - s.cfg.max_delay - s.prompt_frames, self.frame_s, 0.0)

    def pick(self, sessions: Sequence[Session], now: float, prefill: bool = True) -> list[Work]:
        """This round's work; `prefill=False` for the extra rounds of a multi-frame tick (decode steps only)."""
        decode, waiting = [], []
        for s in sessions:
            if s.waiting:  # paused, or preempted while idle: nothing to compute until it goes on
                self._waiting_since.pop(s.id, None)
                continue
            tokens = s.ready_steps(self.prefill_budget if prefill else 2)
            if not len(tokens):
                self._waiting_since.pop(s.id, None)
                continue
            if len(tokens) == 1 and (wanted := s.wanted_after(1)):
                decode.append(Work(s, tokens, True, wanted))
            elif prefill:
                waiting.append((s, tokens))
        decode.sort(key=lambda w: self.deadline(w.session))
        work = list(decode)
        for s, _ in waiting:
            self._waiting_since.setdefault(s.id, now)

        def order(st: tuple[Session, np.ndarray]) -> tuple[bool, float]:
            s, waited = st[0], now - self._waiting_since[st[0].id]
            if urgent(s):
                return False, -waited
            return True, -(s.computed + AGING_STEPS_PER_S * waited)

        waiting.sort(key=order)
        waited_on = any(urgent(s) for s, _ in waiting) or any(first_audio_due(w.session) for w in decode)
        budget = self.prefill_budget
        leaders: set[tuple] = set()
        for s, tokens in waiting:
            if waited_on and not urgent(s):  # the urgent work is all taken (it sorts first)
                budget, waited_on = min(budget, self.background_budget), False
            if budget <= 0:
                break
            if self.page_size is not None and len(tokens) > self.page_size:  # as `KVManager.rematch` requires
                shared = (
                    s.computed,
                    tuple(s.pages[: s.computed // self.page_size]),
                    tokens[: self.page_size].tobytes(),
                )
                if shared in leaders:
                    continue  # another session computes this page now; this one re-matches it next tick
                leaders.add(shared)
            take = tokens[:budget]
            budget -= len(take)
            work.append(Work(s, take, False))
            if len(take) == len(tokens):
                self._waiting_since.pop(s.id, None)
        return work

    @staticmethod
    def victim(s: Session, sessions: Sequence[Session], busy: set[str]) -> Session | None:
        """Whose pages `s` may take when the pool runs short (`sessions` in the order they opened); None: it waits.
        Pages held only through a cache lock count too: unlocked, they become evictable.

        First a paused one (least recently active first: its user asked it to wait), then a listener between turns
        (its last turn answered, nothing to compute), least recently active first: nothing needs its K/V soon. A
        user mid-utterance with nothing to compute until their next 80 ms block would recompute the whole
        conversation before their answer, so only a session someone is waiting on (its reply, or a live duplex
        stream: `urgent`) takes theirs; the recompute then partly hides behind the rest of their speech. Otherwise
        vLLM's order, first come first served: the one opened last, if it opened after `s` (`s` may hold no pages:
        one preempted earlier whose user now speaks). The one opened last never preempts itself: every older
        session that needs its pages takes them, and it would only compute them again into the same
        short pool the next tick."""
        others = [o for o in sessions if o.pages and o is not s]
        paused = [o for o in others if o.paused and o.id not in busy]
        if paused:
            return min(paused, key=lambda o: o.last_active)
        listening = [
            o
            for o in others
            if o.id not in busy and o.mode == "turn" and o.phase is Phase.LISTEN and not o.step_known(o.computed)
        ]
        between = [o for o in listening if o.answered()]
        if between or (listening and urgent(s)):
            return min(between or listening, key=lambda o: o.last_active)
        order = {o.id: i for i, o in enumerate(sessions)}
        others = [o for o in others if not (o.phase is Phase.REPLY and o.turns[-1].reply_end is not None)]
        newest = max(others, key=lambda o: order[o.id], default=None)  # (a reply that has ended finishes first)
        return newest if newest is not None and order[newest.id] > order[s.id] else None


class Admission:
    """Whether another session fits: under the session count and the K/V capacity, and a predicted tick within
    `headroom` of the frame budget (codec rows are the `Registry`'s).

    A session is charged what it costs: a real-time stream (one step per frame, and its audio through the codec)
    while its user's audio comes in or it replies (`Session.streaming`), nothing while it sits silent or paused,
    which is when an idle socket would otherwise hold a speaker's worst case. The newcomer counts as a stream. Turn
    sessions count like duplex ones when they stream: counting only duplex let 16 turn sessions starve together. Each
    stream's steps are charged the keys of a full window and its sink, whatever its context now: the cost model's
    `key_seconds`: a conversation admitted at its first step may talk until its window is full. Admitting on the
    cost of the contexts of the moment, the engine let in 4 to 7 clients of 15 s of speech that then fell hundreds
    to thousands of frames behind as their contexts grew (bench/RESULTS.md, issue 48). An idle engine always admits
    one: nothing else would ever correct a pessimistic cost model."""

    def __init__(
        self,
        cost: CostModel,
        max_sessions: int,
        kv_capacity: int | None,
        frames_per_tick: int,
        tick_s: float,
        headroom: float,
        window_keys: int,
    ):
        """`kv_capacity`: sessions whose pages, reserved at open, fit the pool (naive mode), or None (no bound);
        `tick_s`: the `frames_per_tick` frames' duration, the budget a tick must fit; `window_keys`: the most steps a
        newcomer's step attends to (a one-page sink: its voice prompt is not known yet)."""
        self.cost, self.max_sessions, self.kv_capacity = cost, max_sessions, kv_capacity
        self.frames_per_tick, self.tick_s, self.headroom = frames_per_tick, tick_s, headroom
        self.window_keys = window_keys

    def problem(self, sessions: int, streams: int, keys: int) -> str | None:
        """Why a session cannot be admitted beside `sessions` others, `streams` of them streaming, whose steps see at
        most `keys` steps of context together, or None."""
        if sessions >= self.max_sessions:
            return f"the engine holds its maximum of {self.max_sessions} conversations"
        if self.kv_capacity is not None and sessions >= self.kv_capacity:
            return (
                f"no K/V memory for another conversation: each reserves its whole context at open, and the pool "
                f"holds {self.kv_capacity}"
            )
        if not sessions:
            return None
        streams += 1
        steps = streams * self.frames_per_tick
        keys = self.frames_per_tick * (keys + self.window_keys)
        predicted = self.cost.predict(self.frames_per_tick, steps, keys=keys)
        budget = self.tick_s * self.headroom
        if predicted is not None and predicted > budget:
            return (
                f"admitting another conversation would make a tick take {predicted * 1000:.1f} ms, over "
                f"the {budget * 1000:.1f} ms budget: admitted conversations would miss their frame deadlines"
            )
        return None


def urgent(s: Session) -> bool:
    """Someone is waiting on this session's prefill: a turn that is to be answered, or a live duplex stream."""
    if s.mode == "duplex":
        return s.first_frame_at is not None
    return s.phase is Phase.REPLY


def first_audio_due(s: Session) -> bool:
    """A turn's reply is computing towards its first audio: the user is waiting for it."""
    return s.mode == "turn" and s.phase is Phase.REPLY and s.emitted == s.turns[-1].reply_start
