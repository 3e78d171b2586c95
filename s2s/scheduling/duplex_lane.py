"""DuplexLane: a tick's steady duplex conversations, stepped through its rounds as rows of arrays.

A duplex conversation in its steady state takes one decode step a round: step t's codes are all known, and sampling
the logits of step t fills step t + 1's model codes. Which steps a tick computes for it is known when the tick
starts: user frames come in only then (commands apply at the start of a tick), and nothing but its own sampling
writes its model stream meanwhile. So each such conversation gets a row when a tick starts, holding its step tokens
for the tick (`[rounds + 1, 2K]`, UNKNOWN where sampling is to fill a code) and its page table. Each round then reads
its rows' tokens, page tables and positions, and writes their sampled codes, by whole-array operations: not a
scheduler pick, a page reservation, a `Work` and an `accept` per conversation, which is what made the engine's host
work per round grow with N (`s2s bench host-overhead`). Only a row whose step starts a page (one round in 16) is
handled on its own, before the round: its steps so far go back to its session, and the scheduler picks its step and
reserves its page with everyone else's, in deadline order, preempting as it would; it steps in the lane if it got
its page, and leaves the lane if not.
When the tick ends, or when another conversation preempts one mid-tick, the rows' sampled frames, step counts and
last logits go back to their sessions, which the rest of the engine reads.

A row computes what `Scheduler.pick` picks for its session, round by round: a step whose codes are all known, whose
sampling fills some model code of the next step (`tests/test_duplex_lane.py` runs engines with and without the
lane side by side). Conversations in any other state (a prompt or a turn to prefill, turn mode, a sink recomputed
after a gap, a pool too short for their pages) go through the scheduler as before.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from s2s.engine.frames import UNKNOWN, FrameRows
from s2s.engine.session import Session
from s2s.runner.sampling import RandomStream, SamplingParams
from s2s.runner.transfers import HostCopy
from s2s.scheduling.context import ContextBound
from s2s.scheduling.page_tables import PageTables
from s2s.scheduling.round_batch import LaneRound
from s2s.scheduling.scheduler import Work


class DuplexLane:
    def __init__(
        self, delays: list[int], bound: ContextBound, rounds: int, user: FrameRows, model: FrameRows, tables: PageTables
    ):
        """`rounds`: a tick's rounds (0: the lane takes no rows); `user`, `model`: every live session's recent frames,
        which rows are read from and written to, and `tables` its page table (`KVManager`'s), each session's its
        own row (`Session.row`)."""
        self.delays, self.bound, self.rounds = np.asarray(delays), bound, rounds
        self.user_rows, self.model_rows, self.page_tables = user, model, tables
        self.max_delay = int(self.delays.max())
        self.sessions: list[Session] = []  # the rows' sessions
        self.others: list[Session] = []  # the tick's other sessions, in the order they opened: the scheduler's
        self._all: list[Session] = []
        self._in_lane = np.zeros(0, dtype=bool)  # rows still stepping or holding steps to give back
        self._ids: dict[str, int] | None = None  # those rows by session id, once asked (`_row_of`)
        self.ahead = False  # after a tick: some row could take another step now (input came ahead of real time)
        self.rest: list[Session] = []  # after a tick: the sessions it did not end as rows
        self.stalled: list[Session] = []  # after a tick: rows that met a step not known (`Scheduler.forget` them)
        self._needy: dict[str, int] = {}

    def take(self, sessions: list[Session]) -> None:
        """This tick's rows: each steady duplex session that has a step to take."""
        self._all, self.sessions, self._in_lane, self._ids = sessions, [], np.zeros(0, dtype=bool), None
        self.start = self.sink = self.dropped = self.session_rows = self.page_round = np.zeros(0, dtype=np.int64)
        if self.rounds:
            self._take_rows(sessions)
        rows = self.sessions
        if not rows or len(rows) < len(sessions):
            self.others = [s for s in sessions if s.id not in self._row_of()] if rows else list(sessions)
        else:
            self.others = []  # (every session is a row)
        self.params: list[SamplingParams] = [s.sampling for s in rows]
        self.streams: list[RandomStream] = [s.generator for s in rows]
        self.done = np.zeros(len(rows), dtype=np.int64)  # rounds each row has stepped
        self._pending: tuple[np.ndarray, int, torch.Tensor, HostCopy] | None = None  # the last round's codes, unwritten
        self.given = np.zeros(len(rows), dtype=np.int64)  # of those, steps given back to its session
        self._logits: list[tuple[torch.Tensor, np.ndarray, float]] = []  # each round's: rows' logits, rows, when

    def _take_rows(self, sessions: list[Session]) -> None:
        sessions = [s for s in sessions if s.mode == "duplex" and not s.paused]
        if not sessions:
            return
        computed = np.array([s.computed for s in sessions], dtype=np.int64)
        sink = np.array([s.sink for s in sessions], dtype=np.int64)
        dropped = np.array([s.dropped for s in sessions], dtype=np.int64)
        prompt_frames = np.array([s.prompt_frames for s in sessions], dtype=np.int64)
        row = np.array([s.row for s in sessions], dtype=np.int64)
        width = self.max_delay + self.rounds + 2
        first = computed - self.max_delay  # the first frame its steps of the tick read
        user_at, model_at = first - self.user_rows.start[row], first - self.model_rows.start[row]
        candidates = np.flatnonzero(
            self.user_rows.holding[row]  # its frames are in the rows
            & self.model_rows.holding[row]
            & (np.minimum(user_at, model_at) >= 0)  # reads only recent frames
            & ~((dropped > 0) & (computed < sink * self.bound.page_size))  # not recomputing its sink (a gap)
            & (np.maximum(user_at, model_at) + width <= self.user_rows.limit)  # (else it leaves its rows)
        )
        if not len(candidates):
            return
        users = self.user_rows.read(row[candidates], user_at[candidates], width)
        models = self.model_rows.read(row[candidates], model_at[candidates], width)
        all_tokens = self._steps(users, models)
        run, wanted, known = self._plan(computed[candidates], prompt_frames[candidates], all_tokens)
        steps = np.minimum(run, self.rounds)
        kept = np.flatnonzero(steps)
        taken = candidates[kept]
        self.sessions = sessions if len(taken) == len(sessions) else [sessions[i] for i in taken.tolist()]
        self._in_lane = np.ones(len(taken), dtype=bool)
        self.steps, self.wanted, self.tokens = steps[kept], wanted[kept], all_tokens[kept]
        self.more = run[kept] > self.rounds  # it could step once more after the tick
        self.stopped_unknown = ~known[kept, steps[kept]]  # the step it stopped at is not known
        self.start, self.sink, self.dropped = computed[taken], sink[taken], dropped[taken]
        self.session_rows = row[taken]  # its session's row (frames, page table)
        self.page_round = self._page_due(np.arange(len(taken)), 0)

    def _steps(self, users: np.ndarray, models: np.ndarray) -> np.ndarray:
        """Step tokens `[n, rounds + 2, 2K]` from each row's frames `[n, width, K]` from its first step's less the
        largest delay on: step j + first holds codebook k of frame j + first - delays[k]."""
        frames = np.arange(self.rounds + 2)[:, None] + self.max_delay - self.delays[None, :]
        codebooks = np.arange(len(self.delays))[None, :]
        return np.concatenate([users[:, frames, codebooks], models[:, frames, codebooks]], axis=2)

    def _plan(
        self, computed: np.ndarray, prompt_frames: np.ndarray, tokens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """How many steps each could take in a row, up to one past the tick's rounds, and which model codes sampling
        fills (`[n, rounds + 2, K]`, by step): the leading run of steps known by their round whose sampling fills
        some model code of the next step (`Scheduler.pick`'s decode step, from `Session.wanted_after`); and whether
        each step is known by its round (`[n, rounds + 2]`)."""
        k = len(self.delays)
        # [2K, steps, n]: every operation then runs along the rows, not along K codebooks (numpy's loops over an
        # innermost axis of 2 cost five times as much)
        codes = np.ascontiguousarray(tokens.transpose(2, 1, 0))
        step = np.arange(self.rounds + 2)
        frames = computed[None, None, :] + (step[None, :, None] - self.delays[:, None, None])  # each model code's frame
        unknown = codes[k:] == UNKNOWN
        wanted = unknown & (frames >= np.maximum(prompt_frames, 1)[None, None, :])
        model_known = np.logical_and.reduce(~unknown | (wanted & (step >= 1)[None, :, None]))  # by its round
        known = np.logical_and.reduce(codes[:k] != UNKNOWN) & model_known
        takes = known[:-1] & np.logical_or.reduce(wanted[:, 1:])
        return np.cumprod(takes, axis=0).sum(0), wanted.transpose(2, 1, 0), known.T

    def schedulable(self, index: int, grow: Callable[[list[Session]], bool]) -> list[Session]:
        """Who `Scheduler.pick` sees before round `index`, in the order they opened: the sessions without a row, and
        the rows whose step needs a new page or whose window has left a page behind. Those get their steps so far
        back, and `grow` gives them their pages at once where the pool has room for everyone's step (returning
        True); if not, the scheduler picks their step and reserves its page with everyone else's, earliest deadline
        first, preempting as it would, and `keep_reserved` takes back the ones that got their pages."""
        self._needy: dict[str, int] = {}
        self._index = index
        if not self.sessions:
            return self.others
        needy = np.flatnonzero((self.page_round == index) & (self.steps > index)).tolist()
        if not needy:
            return self.others
        self._give_steps(needy)
        if grow(sessions := [self.sessions[row] for row in needy]):
            self._paged(needy)
            return self.others
        self._needy = {s.id: row for row, s in zip(needy, sessions, strict=True)}
        row_of = self._row_of()
        return [s for s in self._all if s.id not in row_of or s.id in self._needy]

    def _row_of(self) -> dict[str, int]:
        """The rows still in the lane, by session id: made when first asked in a tick (one where no row needs the
        scheduler, nobody is preempted and every session is a row never does)."""
        if self._ids is None:
            self._ids = {self.sessions[r].id: r for r in np.flatnonzero(self._in_lane).tolist()}
        return self._ids

    def _page_due(self, rows: np.ndarray, first: int) -> np.ndarray:
        """Each row's first round from `first` on whose step needs a new page, or slides its window past a page
        (`KVManager.slide`'s), with its page table as it is now; `rounds` where none does. Only `schedulable`
        changes a row's table in a tick, and it asks again for the rows it gave pages."""
        if first >= self.rounds:
            return np.full(len(rows), self.rounds)
        ps, sink, dropped = self.bound.page_size, self.sink[rows], self.dropped[rows]
        lengths = self.page_tables.lengths[self.session_rows[rows]]
        computed = self.start[rows] + np.arange(first, self.rounds)[:, None]  # [rounds, n]: operations along rows
        need = -(-(computed + 1) // ps) - (lengths + np.where(lengths >= sink, dropped, 0))
        drop = np.maximum(computed // ps - self.bound.window_pages + 1 - sink, 0) - dropped
        due = (need > 0) | ((drop > 0) & (lengths >= sink + drop))
        return np.where(np.logical_or.reduce(due), first + due.argmax(0), self.rounds)

    def _paged(self, rows: list[int]) -> None:
        """The rows' steps of this round have their pages: their gaps as they are now, and their next rounds due."""
        for row in rows:
            self.dropped[row] = self.sessions[row].dropped
        rows = np.array(rows, dtype=np.int64)
        self.page_round[rows] = self._page_due(rows, self._index + 1)

    def keep_reserved(self, work: list[Work]) -> list[Work]:
        """The scheduler's reserved work less the steps of rows from `schedulable`: a row whose step kept its place
        (its pages reserved) steps in the lane; one whose step did not (the pool is short, or it was preempted)
        leaves it, and the scheduler has it from now on."""
        if not self._needy:
            return work
        kept, paged = [], []
        for w in work:
            if (row := self._needy.pop(w.session.id, None)) is not None and w.session.id in self._row_of():
                paged.append(row)
            else:
                kept.append(w)
        self._paged(paged)
        for cid, row in self._needy.items():
            if cid in self._row_of():
                self._leave(row)
        return kept

    def _leave(self, row: int) -> None:
        """The row steps no more this tick: the scheduler has its session from now on."""
        self.steps[row] = self.done[row]
        del self._row_of()[self.sessions[row].id]
        self._in_lane[row] = False
        self.others = [s for s in self._all if s.id not in self._ids]

    def _stepping(self, index: int) -> np.ndarray:
        return np.flatnonzero(self.steps > index) if self.sessions else np.zeros(0, dtype=np.int64)

    def round(self, index: int) -> LaneRound | None:
        """Round `index`'s steps, or None when no row steps in it."""
        rows = self._stepping(index)
        if not len(rows):
            return None
        ps, at = self.bound.page_size, self._at(rows)
        computed, sink, dropped = self.start[at] + index, self.sink[at], self.dropped[at]
        # `Session.visible`, for rows past their sink: the sink's pages, then the window's
        hidden = np.maximum(np.maximum(computed // ps - self.bound.window_pages + 1 - sink, 0), dropped)
        skip = np.where(hidden > 0, hidden - dropped, 0)  # table pages before the window, after the sink
        table, lengths = self.page_tables.read(self.session_rows[at])
        if skip.any():  # (the usual round has every row's window slid as its step was scheduled)
            columns = np.arange(table.shape[1])
            source = np.where(columns < sink[:, None], columns, columns + skip[:, None])
            lengths = lengths - skip
            pages = np.take_along_axis(table, np.minimum(source, table.shape[1] - 1), axis=1)
            table = np.where(columns < lengths[:, None], pages, 0).astype(np.int32)
        tokens, fill = self.tokens[at, index].copy(), None
        if self._pending is not None:  # the last round's codes are still on the device: the forward takes them there
            stepped, nxt, codes, _ = self._pending
            if nxt != index:
                raise AssertionError(f"round {index} after the codes of round {nxt - 1} were left unwritten")
            # (a row steps in a round only if it stepped in the one before)
            places = np.searchsorted(stepped, rows) if len(rows) < len(stepped) else None
            wanted = self.wanted[at, index]
            tokens[:, len(self.delays) :][wanted] = 0
            fill = (wanted, codes, places)
        params, streams = self.params, self.streams
        if len(rows) < len(params):  # (else every row steps, in order)
            picked = rows.tolist()
            params, streams = [params[i] for i in picked], [streams[i] for i in picked]
        return LaneRound(
            index, rows, tokens, computed - hidden * ps, table, lengths, hidden * ps, params, streams, fill
        )

    def _at(self, rows: np.ndarray) -> np.ndarray | slice:
        """`rows` as an index into the lane's arrays: every row (in order) as a slice, which indexes without a
        gather."""
        return slice(None) if len(rows) == len(self.steps) else rows

    def accept(self, r: LaneRound, codes: torch.Tensor, logits: torch.Tensor, now: float) -> None:
        """The round's sampled codes `[n, K]` fill what each row's next step wanted; `logits` `[n, K, V]`.

        The codes (on the device) start their copy to the host at once (`HostCopy`) and are written into the
        tokens only when next read (`_write_pending`: by the next round's `accept`, or a give-back), while the next
        round takes them on the device (`LaneRound.fill`). With its inputs staged in without waiting (`Staging`),
        the host prepares round i + 1 while the device computes round i, and waits for round i's codes only then,
        as SGLang's overlap scheduler and vLLM's async scheduling overlap a step's host work with the last step."""
        self._write_pending()
        self._pending = (r.rows, r.index + 1, codes, HostCopy(codes))
        self.done[self._at(r.rows)] = r.index + 1
        self._logits.append((logits, r.rows, now))

    def _write_pending(self) -> None:
        if self._pending is not None:
            stepped, nxt, _, copied = self._pending
            self._pending, k, at = None, len(self.delays), self._at(stepped)
            codes = copied.numpy()  # (waits for the round that sampled them only)
            self.tokens[at, nxt, k:] = np.where(self.wanted[at, nxt], codes, self.tokens[at, nxt, k:])

    def give_back(self, s: Session) -> None:
        """The session's steps so far go back to it, and it steps no more this tick (another preempts it)."""
        if (row := self._row_of().get(s.id)) is not None:
            self._give_steps([row])
            self._leave(row)

    def give_back_all(self) -> None:
        """The tick is over: every row's steps go back to its session."""
        self._write_pending()
        rows = np.flatnonzero(self._in_lane)
        self.ahead, self.rest, self.stalled = False, self.others, []
        if len(rows):
            self._give_steps(rows)
            self.ahead = bool(self.more[rows].any())
            stalled = rows[(self.steps[rows] < self.rounds) & self.stopped_unknown[rows]]
            self.stalled = [self.sessions[r] for r in stalled.tolist()]
        self.sessions, self._in_lane, self._ids = [], self._in_lane[:0], None
        self._logits, self._all, self.others = [], [], []

    def _give_steps(self, rows: list[int] | np.ndarray) -> None:
        """Each row's steps not yet given back go to its session, with the logits of its last step."""
        self._write_pending()
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows[self.done[rows] > self.given[rows]]
        if not len(rows):
            return
        self._write_model_codes(rows)
        done = self.done[rows]
        for index in np.unique(done).tolist():  # by the round of each one's last step
            logits, stepped, now = self._logits[index - 1]
            last = rows[done == index]
            if len(last) == len(self.sessions):  # (every row, in order: its own row of the logits too)
                sessions, logits_rows = self.sessions, range(len(last))
            else:
                sessions = [self.sessions[row] for row in last.tolist()]
                logits_rows = np.searchsorted(stepped, last).tolist()
            computed = (self.start[last] + index).tolist()
            Session.record_steps(sessions, computed, logits, logits_rows, now)
        self.given[rows] = self.done[rows]

    def _write_model_codes(self, rows: np.ndarray) -> None:
        """The model codes of the rows' steps not yet given back, into their sessions' model frames: step
        `start + j`'s codebook k is frame `start + j - delays[k]`'s."""
        k, session_rows = len(self.delays), self.session_rows[rows]
        if not self.model_rows.holding[session_rows].all():
            raise AssertionError("a lane row's model frames left the engine's rows")
        step = np.arange(1, self.rounds + 1)[:, None]
        step, at = np.nonzero((step > self.given[rows]) & (step <= self.done[rows]))  # (by step: along the rows)
        step += 1
        model_start = self.model_rows.start[session_rows]
        offsets = ((self.start[rows] - model_start)[at] + step) - self.delays[:, None]  # [K, steps]
        if offsets.min() < 0:
            raise AssertionError("a lane step's model code falls in forgotten frames")
        held_to = self.start[rows] + self.done[rows] + 2 - model_start  # room as `accept` makes (`Session._ensure`)
        self.model_rows.room(session_rows, held_to)
        self.model_rows.write(session_rows[at], offsets.T, self.tokens[rows[at], step, k:], np.arange(k))
