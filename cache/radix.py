"""RadixCache: SGLang's radix tree over step tokens, shared across every live and finished conversation.

The tree is page-granular: an edge is a run of whole pages, a split never cuts a page, and children are keyed by the
step tokens of their first page. A match that ends inside a child's first page says so (`MatchResult.partial`):
the caller copies those steps instead of computing them, which a hash chain over whole pages cannot offer.

Locks (`lock_ref`) walk from a node to the root, so a locked node's whole prefix is protected. Eviction takes least
recently used unlocked leaves, from their tail page backwards, off a heap kept across calls: each node has at most
one entry, stale entries are dropped or re-pushed when popped, and a node is pushed again when it becomes an
evictable leaf (unlocked, last child evicted, last page released).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np

from cache.base import Handle, MatchResult, PrefixCache, as_key, page_tokens
from cache.pool import PagePool

PARTIAL_CANDIDATES = 16


class Node:
    """An edge of whole pages: `tokens[i]` holds page i's step tokens (bytes), `pages[i]` its page id."""

    __slots__ = (
        "parent",
        "children",
        "by_first_step",
        "tokens",
        "pages",
        "start",
        "lock_ref",
        "last_access",
        "in_heap",
    )

    def __init__(self, parent: Node | None, tokens: list[bytes], pages: list[int], start: int, last_access: int):
        self.parent = parent
        self.children: dict[bytes, Node] = {}  # by their first page's step tokens
        self.by_first_step: dict[bytes, list[Node]] = {}  # the same children by their first step: partial matches
        self.tokens = tokens
        self.pages = pages
        self.start = start  # pages from the root to this edge
        self.lock_ref = 0
        self.last_access = last_access
        self.in_heap = False

    @property
    def end(self) -> int:
        """Pages from the root to the end of this edge."""
        return self.start + len(self.pages)


class RadixCache(PrefixCache):
    def __init__(self, pool: PagePool):
        super().__init__(pool)
        self.root = Node(None, [], [], 0, 0)
        self._node_of: dict[int, Node] = {}  # every cached page -> the node holding it
        self._locked_pages = 0
        self._heap: list[tuple[int, int, Node]] = []  # (last_access when pushed, tie-break, node)
        self._tiebreak = itertools.count()
        self._clock = 0

    def _match(self, key: np.ndarray) -> MatchResult:
        node, pages = self._walk(page_tokens(key, self.page_size, len(key) // self.page_size))
        steps = node.end * self.page_size
        return MatchResult(steps, pages, Handle(node, steps), self._partial(node, key[steps : steps + self.page_size]))

    def _partial(self, node: Node, rest: np.ndarray) -> tuple[int, int] | None:
        """The child page of `node` whose leading steps match the most of `rest` (the key's steps after `node`, fewer
        than a page or a page that differs): (page, steps), or None when no child starts with rest's first step. Of
        many children that start alike (cached sessions that all began with the same silent frame), only the newest
        `PARTIAL_CANDIDATES` are compared: the most a partial page saves is a page's steps minus one."""
        if not len(rest):
            return None
        want = rest.tobytes()
        step_bytes = len(want) // len(rest)
        best, best_steps = None, 0
        for child in node.by_first_step.get(want[:step_bytes], [])[-PARTIAL_CANDIDATES:]:
            first = child.tokens[0]
            page = np.frombuffer(first, dtype=np.int64)[: rest.size].reshape(rest.shape)
            differs = np.flatnonzero((page != rest).any(axis=1))
            steps = int(differs[0]) if len(differs) else len(rest)
            if steps > best_steps:
                best, best_steps = child, steps
        if best is None:
            return None
        best.last_access = self._clock  # used: copied from
        return best.pages[0], best_steps

    def insert(self, key: Any, pages: list[int]) -> Handle:
        key = as_key(key)
        n = self._full_pages(key, pages)
        tokens = page_tokens(key, self.page_size, n)
        node, _ = self._walk(tokens)
        start = node.end
        new = list(pages[start:n])
        if 0 in new:
            new = new[: new.index(0)]
        for p in new:
            if p in self._node_of:
                raise ValueError(f"page {p} already caches another prefix; a page holds the K/V of one prefix")
            if not 0 < p < self.pool.num_pages or self.pool.refcount(p) == 0:
                raise ValueError(f"page {p} is not held by the caller")
        if len(set(new)) != len(new):
            raise ValueError(f"a page is given twice for one key: {new}")
        if new:
            self.pool.incref(new)
            leaf = Node(node, tokens[start : start + len(new)], new, start, self._clock)
            self._add_child(node, leaf)
            self._node_of.update((p, leaf) for p in new)
            self._push(leaf)
            node = leaf
        return Handle(node, node.end * self.page_size)

    def evict(self, num_pages: int) -> int:
        freed = 0
        while freed < num_pages and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            node.in_heap = False
            if node.parent is None or node.children or node.lock_ref:
                continue  # gone, or not an evictable leaf now: pushed again when it becomes one
            if stamp != node.last_access:
                self._push(node)  # used since it was pushed: back in at its new time
                continue
            k = 0
            while k < min(len(node.pages), num_pages - freed) and self.pool.refcount(node.pages[-1 - k]) == 1:
                k += 1
            if k == 0:
                continue  # a caller still references its last page: pushed again when released
            first = node.tokens[0]
            dropped = node.pages[-k:]
            del node.pages[-k:], node.tokens[-k:]
            for p in dropped:
                del self._node_of[p]
            freed += self._record_eviction(dropped)
            if node.pages:
                self._push(node)
                continue
            parent = node.parent
            self._remove_child(parent, node, first)
            node.parent = None
            if not parent.children and not parent.lock_ref:
                self._push(parent)
        return freed

    def forget_past(self, handle: Handle, keep: Handle) -> None:
        """Eviction takes leaves only: a path whose head nobody uses while a caller holds its tail would stay. Its
        nodes below `keep`'s go now, deepest first, up to one someone locks or another path branches from."""
        node, removed = handle.target, False
        while node is not keep.target and node.parent is not None and not node.lock_ref and not node.children:
            parent = node.parent
            self._remove_child(parent, node, node.tokens[0])
            node.parent = None
            for p in node.pages:
                del self._node_of[p]
            self.pool.decref(node.pages)
            removed |= node.in_heap
            node = parent
        if removed:  # once a conversation: the heap holds no removed node (`check`)
            self._heap = [entry for entry in self._heap if entry[2].parent is not None]
            heapq.heapify(self._heap)
        if node.parent is not None and not node.children and not node.lock_ref:
            self._push(node)

    def release(self, pages: list[int]) -> None:
        super().release(pages)
        for p in pages:
            node = self._node_of.get(p)
            if node is not None and not node.children and not node.lock_ref:
                self._push(node)

    def _lock(self, handle: Handle) -> None:
        node = handle.target
        if (node is not self.root and node.parent is None) or node.end * self.page_size != handle.steps:
            raise ValueError("the handle's prefix was evicted since match/insert returned it: lock right away")
        while node is not None:
            if node.lock_ref == 0:
                self._locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def _unlock(self, handle: Handle) -> None:
        node = handle.target
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_pages -= len(node.pages)
                if not node.children:
                    self._push(node)
            node = node.parent

    def _cached_counts(self) -> tuple[int, int]:
        return len(self._node_of) - self._locked_pages, self._locked_pages

    def _cached_pages(self) -> Iterable[int]:
        return self._node_of.keys()

    def _walk(self, tokens: list[bytes]) -> tuple[Node, list[int]]:
        """Descend along `tokens` (page tokens), marking the path used; split the last edge where the match ends
        inside it. Returns the deepest node and the pages from the root to it."""
        self._clock += 1
        node, i, pages = self.root, 0, []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            j = 1
            while j < len(child.tokens) and i + j < len(tokens) and child.tokens[j] == tokens[i + j]:
                j += 1
            if j < len(child.tokens):
                child = self._split(child, j)
            child.last_access = self._clock
            pages += child.pages
            node, i = child, i + j
        return node, pages

    def _split(self, child: Node, j: int) -> Node:
        """Cut `child`'s edge after its j-th page; the new upper node takes the first j pages and `child` keeps its
        identity (handles to it stay valid) as the lower part."""
        upper = Node(child.parent, child.tokens[:j], child.pages[:j], child.start, child.last_access)
        upper.lock_ref = child.lock_ref
        parent = child.parent
        self._remove_child(parent, child, child.tokens[0])
        self._add_child(parent, upper)
        self._node_of.update((p, upper) for p in upper.pages)
        child.tokens, child.pages, child.start, child.parent = child.tokens[j:], child.pages[j:], child.start + j, upper
        self._add_child(upper, child)
        return upper

    def _first_step(self, page: bytes) -> bytes:
        return page[: len(page) // self.page_size]

    def _add_child(self, parent: Node, child: Node) -> None:
        parent.children[child.tokens[0]] = child
        parent.by_first_step.setdefault(self._first_step(child.tokens[0]), []).append(child)

    def _remove_child(self, parent: Node, child: Node, first: bytes) -> None:
        """Unlink `child`, whose first page's tokens were `first` (an evicted leaf has no pages left)."""
        del parent.children[first]
        step = self._first_step(first)
        siblings = parent.by_first_step[step]
        siblings.remove(child)
        if not siblings:
            del parent.by_first_step[step]

    def _push(self, node: Node) -> None:
        if not node.in_heap and node is not self.root:
            heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))
            node.in_heap = True

    def check(self) -> None:
        super().check()
        in_heap = [entry[2] for entry in self._heap]
        assert len({id(n) for n in in_heap}) == len(in_heap), "a node twice in the heap"
        assert all(n.in_heap and n.parent is not None for n in in_heap), "a removed or unflagged node in the heap"
        assert not self.root.pages and self.root.parent is None
        cached = locked = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0, "lock_ref below children"
            by_step = {self._first_step(first): [] for first in node.children}
            for first, child in node.children.items():
                by_step[self._first_step(first)].append(child)
            assert {k: set(map(id, v)) for k, v in by_step.items()} == {
                k: set(map(id, v)) for k, v in node.by_first_step.items()
            }, "children by first step"
            for first, child in node.children.items():
                assert child.parent is node and child.tokens and child.tokens[0] == first
                assert len(child.tokens) == len(child.pages) and child.start == node.end
                stack.append(child)
            if node is self.root:
                continue
            assert all(self._node_of.get(p) is node for p in node.pages), "page -> node map"
            cached += len(node.pages)
            locked += len(node.pages) if node.lock_ref else 0
            if not node.children and not node.lock_ref and self.pool.refcount(node.pages[-1]) == 1:
                assert node.in_heap, "an evictable leaf that evict cannot find"
        assert cached == len(self._node_of) and locked == self._locked_pages, (cached, locked, self._locked_pages)
