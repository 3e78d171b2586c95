"""KVManager: the sole owner of every session's page table, own pages and cache handle (see `cache/base.py` for
who holds a reference on a page).

- A session matches the prefix cache when it opens (`attach`), and again whenever it has a page or more of prefill
  waiting and the cache has gained pages since it last looked (`rematch`). Full pages go into the cache after every
  prefill chunk (`insert`).
- A match never covers a key's last step: its logits are what the session predicts from. With the radix cache, a
  key that leaves a cached prefix inside a page also gets that page's shared steps, copied into a page of its own
  (`private_copy`): a cached page is never written into. A rewind whose cut falls inside a cached page copies its
  steps before the cut the same way (`trim`).
- When the pool runs out, `reserve` preempts the session the scheduler names (`Scheduler.victim`): its full pages go
  to the cache, and it gets back on its next match whatever was not evicted meanwhile.
- A conversation's context is bounded (`ContextBound`): before each chunk, `slide` gives back the pages that left
  its window, and forgets their frames. The first time, its cache lock moves to its sink: the prefix cache keeps
  what it has up to the gap, and nothing after it (no cached prefix can be what a conversation has past a gap). One
  with a gap that is preempted recomputes its sink and its kept window, each step seeing what is kept before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from cache import MatchResult, OutOfPages, PagePool, make_cache
from s2s.engine.frames import FrameRows
from s2s.engine.metrics import EngineStats
from s2s.engine.session import Session
from s2s.engine.turns import Phase
from s2s.scheduling.context import ContextBound
from s2s.scheduling.page_tables import PageTables
from s2s.scheduling.scheduler import Work


class KVManager:
    def __init__(self, pool: PagePool, cache_mode: str, bound: ContextBound, stats: EngineStats, rows: int):
        """`rows`: sessions' rows (`Session.row`) in `tables`, which mirrors each session's `pages`."""
        self.pool, self.cache, self.stats, self.bound = pool, make_cache(cache_mode, pool), stats, bound
        self.tables = PageTables(rows)
        self.page_size = pool.page_size
        self.reserves = self.cache.pages_on_open(1) > 0  # naive: every page a session may hold, at open
        self.inserts = 0  # prefix-cache inserts so far: a session re-matches only after new ones

    @property
    def capacity(self) -> int | None:
        """Sessions that fit when each reserves its pages at open (naive; counted for a one-page sink and turn mode,
        the most), else None (no fixed bound)."""
        return self.pool.num_usable // self.bound.max_pages(1, "turn") if self.reserves else None

    def check_idle(self, *rows: FrameRows) -> None:
        """With no conversation open: every page free or cached, the pool's counts consistent (`PrefixCache.check`),
        no page table or frame row still held. An AssertionError says what is not."""
        self.cache.check()
        c = self.cache.stats()
        assert c.private == c.cached_locked == 0, f"pages held with no conversation open: {c}"
        assert not self.tables.lengths.any(), "a page table left with no conversation open"
        assert not any(r.attached for r in rows), "frame rows held by no conversation"

    def attach(self, s: Session) -> None:
        """Match the longest cached prefix of what the session knows so far and lock it; reserve pages up front
        where the mode does (raises `OutOfPages`, with nothing held)."""
        key = s.known_key()
        s.open_key_steps, s.seen_inserts = len(key), self.inserts
        m = self.cache.match(key) if len(key) else None
        if m is not None:
            if m.cached_steps:
                self.cache.lock(m.handle)
                s.handle = m.handle
            s.pages, s.computed = self._matched_table(m)
            s.own_pages += s.pages[len(m.pages) :]
            self.cache.record_hits(s.computed - m.cached_steps, s.computed - m.cached_steps)
            s.cached_at_open = s.computed
            self.tables.set(s.row, s.pages)
        if self.reserves:
            try:
                s.own_pages += self.cache.alloc(max(0, self.bound.max_pages(s.sink, s.mode) - len(s.pages)))
            except OutOfPages:
                self.detach(s)
                raise

    def detach(self, s: Session) -> None:
        self.cache.release(s.own_pages)
        s.own_pages, s.pages = [], []
        self.tables.set(s.row, [])
        if s.handle is not None:
            self.cache.unlock(s.handle)
            s.handle = None

    def insert(self, s: Session, lock: bool) -> None:
        """Cache the session's full pages (up to its gap, if it has one); with `lock`, it keeps them locked (it goes
        on using them)."""
        full = s.computed // self.page_size * self.page_size
        if s.dropped:
            full = min(full, s.sink * self.page_size)
            if s.handle is not None and s.handle.steps >= full:
                return  # it holds all it can cache
        if full == 0:
            return
        self.inserts += 1
        handle = self.cache.insert(s.key(full), s.pages[: full // self.page_size])
        if lock:
            self.cache.lock(handle)
        if s.handle is not None:
            self.cache.unlock(s.handle)
        s.handle = handle if lock else None

    def rematch(self, sessions: Iterable[Session]) -> None:
        """A session with prefill waiting takes what the cache gained since it last looked: the pages another one
        has just computed for the same prefix (vLLM and SGLang match when they schedule, not only on arrival).
        Sessions that arrive together thus compute a shared prefix once; the scheduler holds back all but one of
        those about to compute the same page (`Scheduler` with `page_size`)."""
        if not self.cache.shares_prefixes:
            return
        for s in sessions:
            if s.seen_inserts == self.inserts:
                continue  # nothing new in the cache
            ahead = s.computed + self.page_size
            if ahead > s.sink * self.page_size if s.dropped else not s.step_known(ahead):
                continue  # less than a page of prefill waiting (past a gap: of its sink, all it can match)
            if s.waiting:
                continue  # locking its old pages again would take them from whoever preempted it
            s.seen_inserts = self.inserts
            m = self.cache.match(s.known_key(), record=False)
            if m.cached_steps + (m.partial[1] if m.partial else 0) <= s.computed:
                continue
            self.cache.lock(m.handle)
            table, cached = self._matched_table(m)
            if cached <= s.computed:  # the copy it counted on could not be made
                self.cache.unlock(m.handle)
                continue
            if s.handle is not None:
                self.cache.unlock(s.handle)
            s.handle = m.handle
            kept = set(table)
            dropped = [p for p in s.pages if p not in kept]
            if not set(dropped) <= set(s.own_pages):
                raise AssertionError(f"{s.id}: a matched page left its table on a re-match")
            self.cache.release(dropped)
            gone = set(dropped)
            s.own_pages = [p for p in s.own_pages if p not in gone] + table[len(m.pages) :]
            self.cache.record_hits(cached - s.computed, max(0, min(cached, s.open_key_steps) - s.computed))
            s.pages, s.computed, s.last_logits = table, cached, None
            self.tables.set(s.row, s.pages)

    def trim(self, s: Session) -> None:
        """After a rewind (`Session.rewind`): the pages past `computed` go back to the pool, and a page the cut falls
        in that others hold is replaced by a copy of its steps before the cut (or they are computed again). A rewind
        into the sink closes the gap."""
        if not s.can_rewind(s.computed + 1):
            raise AssertionError(f"{s.id}: rewound to step {s.computed}, whose window has left its table")
        if s.dropped and s.user_frames <= s.sink * self.page_size:
            s.dropped = 0  # the rewind reached into the sink (its frames are one piece again: `Frames.truncate`)
        keep = math.ceil(s.computed / self.page_size)
        if keep > s.sink:
            keep -= s.dropped  # its index in the table, past the gap
        if s.computed % self.page_size and len(s.pages) >= keep:
            last = s.pages[keep - 1]
            if last not in s.own_pages or self.pool.refcount(last) > 1:
                copy = self._private_copy(last, s.computed % self.page_size)
                if copy is None:
                    keep -= 1
                    s.computed = (keep + s.dropped) * self.page_size
                    s.last_logits = None
                else:
                    s.pages[keep - 1] = copy
                    s.own_pages.append(copy)
                    if last in s.own_pages:
                        s.own_pages.remove(last)
                        self.cache.release([last])
        if not self.reserves and len(s.pages) > keep:
            owned = set(s.own_pages)
            released = [p for p in s.pages[keep:] if p in owned]
            s.pages = s.pages[:keep]
            gone = set(released)
            s.own_pages = [p for p in s.own_pages if p not in gone]
            self.cache.release(released)
        self.tables.set(s.row, s.pages)

    def slide(self, s: Session) -> None:
        """Give back the pages that left the session's window (`ContextBound.keep_from`) and forget their frames.
        Naive mode keeps them among its own, reserved: its next pages come from there."""
        ps = self.page_size
        drop = self.bound.keep_from(s.sink, s.computed, s.mode) - (s.sink + s.dropped)
        if drop <= 0 or len(s.pages) < s.sink + drop:
            return
        if not s.dropped and s.handle is not None and s.handle.steps > s.sink * ps:
            self._lock_sink_only(s)
        gone = s.pages[s.sink : s.sink + drop]
        del s.pages[s.sink : s.sink + drop]
        self.tables.delete(s.row, s.sink, drop)
        s.dropped += drop
        if not self.reserves:
            released = [p for p in gone if p in s.own_pages]  # (a page or two a slide: list scans, not sets)
            for p in released:
                s.own_pages.remove(p)
            self.cache.release(released)
        first = (s.sink + s.dropped) * ps - s.cfg.max_delay  # the first frame its steps from there read
        s.user.forget(s.sink * ps, first)
        s.model.forget(s.sink * ps, first)

    def _lock_sink_only(self, s: Session) -> None:
        """The first time pages leave its window: its lock moves to its sink, pages it had matched past the sink are
        held as its own (no lock keeps them now), and the cache forgets what it held of its steps past the sink that
        nobody else uses: a prefix whose head is going matches nothing, and would pin its tail until it all left."""
        old = s.handle
        s.handle = self.cache.insert(s.key(s.sink * self.page_size), s.pages[: s.sink])  # what it holds of the sink
        self.cache.lock(s.handle)
        owned = set(s.own_pages)
        matched = [p for p in s.pages[s.sink :] if p not in owned]
        self.cache.hold(matched)
        s.own_pages += matched
        self.cache.unlock(old)
        self.cache.forget_past(old, s.handle)

    def reserve(self, work: list[Work], victim: Callable[[Session, set[str]], Session | None]) -> list[Work]:
        """Pages for this round's work. When the pool runs short, a session preempts the one `victim` names; a
        prefill shrinks to what fits; otherwise it waits a tick. Without this, sessions that each hold some pages
        and each need one more, or listeners holding theirs while another cannot start its turn, would wait on each
        other for ever."""
        kept: list[Work] = []
        busy = {w.session.id for w in work}
        preempted: set[str] = set()
        for w in work:
            s = w.session
            if s.id in preempted:
                continue
            self.slide(s)
            while True:
                try:
                    self._grow(s, len(w.tokens))
                except OutOfPages:
                    self.stats.out_of_pages += 1
                    if not self.reserves and (v := victim(s, busy - preempted)) is not None:
                        self.preempt(v)
                        preempted.add(v.id)
                        kept = [k for k in kept if k.session is not v]
                        continue
                    c = self.cache.stats()
                    fit = (s.table_pages + c.free + c.cached_evictable) * self.page_size - s.computed
                    if not w.decode and 0 < fit < len(w.tokens):
                        w = Work(s, w.tokens[:fit], False)
                        continue
                    break  # this session waits a tick
                kept.append(w)
                break
        return kept

    def grow_steps(self, sessions: list[Session], spare: int) -> bool:
        """Pages for one step of each session at once (the window slid first, as `reserve` does), where the free
        pages cover them and one more for each of `spare` others: no step is short then, whatever order `reserve`
        would take them in. False, with nothing done, if they do not. The pages are taken in one `alloc`, the same
        ones, in the same order, as one each would take."""
        ps = self.page_size
        need = [max(0, -(-(s.computed + 1) // ps) - s.table_pages) for s in sessions]  # (a slide keeps these)
        if max(need, default=0) > 1:
            raise AssertionError("a session is more than a page short of its next step: it is not one step's growth")
        if sum(need) + spare > self.pool.num_free:
            return False
        for s in sessions:
            self.slide(s)
        if self.reserves:  # naive: from the pages reserved at open
            for s in sessions:
                self._grow(s, 1)
            return True
        growing = [s for s, n in zip(sessions, need, strict=True) if n]
        pages = self.cache.alloc(len(growing))
        self.tables.append_each(np.array([s.row for s in growing], dtype=np.int64), pages)
        for s, page in zip(growing, pages, strict=True):
            s.pages.append(page)
            s.own_pages.append(page)
        return True

    def _grow(self, s: Session, steps: int) -> None:
        """Pages for `steps` steps from `computed`, or `OutOfPages` with nothing taken."""
        need = math.ceil((s.computed + steps) / self.page_size) - s.table_pages
        if need <= 0:
            return
        take = []
        if self.reserves:  # naive: its pages were reserved at open
            in_table = set(s.pages)
            take = [p for p in s.own_pages if p not in in_table][:need]
        new = self.cache.alloc(need - len(take)) if need > len(take) else []
        s.pages += take + new
        s.own_pages += new
        self.tables.append(s.row, take + new)

    def preempt(self, s: Session) -> None:
        """Give back a session's pages and recompute its K/V later (its frames are kept). Its full pages go to the
        prefix cache first, so what is not evicted meanwhile comes back on its next match."""
        if s.mode == "turn" and s.phase is Phase.LISTEN and not s.step_known(s.computed):
            s.idle_frames = s.user_frames  # all it had is computed: nothing to do until its user speaks
        self.insert(s, lock=False)
        self.detach(s)
        s.computed, s.last_logits = 0, None
        s.seen_inserts, s.open_key_steps = -1, 0  # re-match at once; what it gets back counts as hits
        self.stats.preempted += 1

    def _matched_table(self, m: MatchResult) -> tuple[list[int], int]:
        """The page table and the steps a match gives: its pages, and a private copy of its partial page's steps
        when a page can be had for it (the copy is the caller's own). Lock `m.handle` first: the copy may evict."""
        table, steps = list(m.pages), m.cached_steps
        if m.partial and (copy := self._private_copy(*m.partial)) is not None:
            table.append(copy)
            steps += m.partial[1]
        return table, steps

    def _private_copy(self, page: int, steps: int) -> int | None:
        """Copy-on-write: a new page of the caller's own holding the first `steps` steps of `page`, which the cache
        or another session holds (never written into); None when no page can be had (compute them instead)."""
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
