"""What the engine hands its callers: a conversation's events, in a queue an asyncio reader can wait on."""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import repeat
from typing import NamedTuple

import numpy as np


class _NoTimes(Mapping[str, float]):
    """An empty mapping that cannot change (shared by every event made without times) and, unlike a
    `MappingProxyType`, pickles: events cross to the front-end processes."""

    def __getitem__(self, key: str) -> float:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


NO_TIMES = _NoTimes()


class AudioEvent(NamedTuple):
    session: str
    turn: int
    first_frame: int
    pcm: np.ndarray  # float32, 24 kHz
    times: Mapping[str, float] = NO_TIMES  # the turn's stage times, on its first audio (`NO_TIMES` after)
    text: np.ndarray | None = None  # with a text stream (Moshi's): the text id of each of its frames


class CodesEvent(NamedTuple):
    """Model frames `[K, n]` from `first_frame` on, as sampled ids (codec-free engines emit these instead of PCM)."""

    session: str
    turn: int
    first_frame: int
    codes: np.ndarray
    times: Mapping[str, float] = NO_TIMES  # (as `AudioEvent.times`)


class MetaEvent(NamedTuple):
    session: str
    turn: int
    data: dict


def made(kind: type[AudioEvent | CodesEvent], *fields: Iterable) -> Iterator[AudioEvent | CodesEvent]:
    """Events of `kind` from one iterable per field, in order, each made without a Python call (the decoder makes
    every conversation's each tick: a tuple's own constructor, not the class's)."""
    return map(tuple.__new__, repeat(kind), zip(*fields, strict=True))


class EventQueue:
    """A conversation's events, ended by None. An asyncio reader sets `on_put` to wake itself instead of polling.

    Bounded, and never a wait for the engine thread: a reader more than `max_frames` frames of output behind (its
    client does not keep up) finds the queue `overflowed`, emptied, and dropping all but the end; `on_overflow`
    tells the reader at once.

    `queue.Queue`'s interface for one writer (the engine thread, which also drops audio) and its readers, without
    its cost per put: the engine puts every conversation's events every tick. A put takes no lock (a deque's
    append is atomic; each side counts the frames it moved, so neither writes what the other does); it takes the
    lock only to wake a reader waiting in `get`, which looks at the queue again after it says it waits, or to empty
    the queue on an overflow."""

    max_frames = 1500  # a turn reply of the default longest (750 frames), made at once, fits twice
    on_put: Callable[[], None] | None = None
    on_overflow: Callable[[], None] | None = None

    def __init__(self, frame_size: int):
        """`frame_size`: samples in a frame of its `AudioEvent`s (the engine's codec's)."""
        self.frame_size = frame_size
        self.queue: collections.deque = collections.deque()
        self.mutex = threading.Lock()
        self._ready = threading.Condition(self.mutex)
        self._waiting = 0  # readers blocked in `get`
        self._frames_put = self._frames_got = 0  # the writer's count and the readers' (the lock's)
        self.overflowed = False

    def put(self, item: AudioEvent | CodesEvent | MetaEvent | None, frames: int | None = None) -> None:
        """`frames`: the item's frames of output, where the writer knows them (else counted here)."""
        if item is not None:
            if self.overflowed:
                return
            self._frames_put += self.frames_of(item) if frames is None else frames
            if self._frames_put - self._frames_got > self.max_frames:
                with self.mutex:
                    self.queue.clear()
                    self._frames_put, self.overflowed = self._frames_got, True
                if self.on_overflow is not None:
                    self.on_overflow()
                return
        self.queue.append(item)
        if self._waiting:
            with self.mutex:
                self._ready.notify()
        if self.on_put is not None:
            self.on_put()

    def frames_of(self, event: AudioEvent | CodesEvent | MetaEvent | None) -> int:
        """The event's frames of output."""
        if isinstance(event, AudioEvent):
            return len(event.pcm) // self.frame_size
        return event.codes.shape[-1] if isinstance(event, CodesEvent) else 0

    @property
    def frames(self) -> int:
        """Frames of output put and not yet read."""
        return self._frames_put - self._frames_got

    def get(self, block: bool = True, timeout: float | None = None) -> AudioEvent | CodesEvent | MetaEvent | None:
        """The next event; `queue.Empty` if there is none (`block`: after waiting up to `timeout` seconds)."""
        with self.mutex:
            if block and not self.queue:
                self._waiting += 1
                try:
                    self._ready.wait_for(lambda: self.queue, timeout)
                finally:
                    self._waiting -= 1
            if not self.queue:
                raise queue.Empty
            item = self.queue.popleft()
            self._frames_got += self.frames_of(item)
            return item

    def get_nowait(self) -> AudioEvent | CodesEvent | MetaEvent | None:
        return self.get(block=False)

    def qsize(self) -> int:
        return len(self.queue)

    def empty(self) -> bool:
        return not self.queue

    def drop_turn_audio(self, turn: int) -> None:
        """Take a cancelled turn's audio the reader has not read yet out of the queue; keep everything else. The
        writer's call (no put runs meanwhile)."""
        with self.mutex:
            kept = [e for e in self.queue if not (isinstance(e, AudioEvent | CodesEvent) and e.turn == turn)]
            self.queue.clear()
            self.queue.extend(kept)
            self._frames_put = self._frames_got + sum(map(self.frames_of, kept))
