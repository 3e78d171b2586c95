"""Conversation scripts against one engine, driven by hand: each script yields a condition to wait for; between
rounds of scripts the engine takes one tick (`engine.step()` as fast as it goes, the wall clock as its clock)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field

import numpy as np

from bench.prefix.engine_reads import pages_held, session_ids
from codec.pcm import SAMPLE_RATE
from s2s.engine.engine import AudioEvent, Engine, MetaEvent, Refused
from server.moshi.client import BLOCK  # user audio in 80 ms blocks when streamed

BARGE_IN_FRAMES = 11  # frames of the reply the user hears before speaking over it (not a page boundary)

Wait = Callable[[], bool]
Script = Generator[Wait, None, None]


def at(t: float) -> Wait:
    return lambda: time.perf_counter() >= t


@dataclass
class Driver:
    """Runs conversation scripts against one engine. Records TTFA per label, audio out, refusals, peak K/V."""

    engine: Engine | None  # None once its run is over
    ttfa: dict[str, list[float]] = field(default_factory=dict)
    stages: list[tuple[float, float, float]] = field(default_factory=list)  # (encode+queue, prefill, to audio)
    expecting: dict[str, tuple[float, str]] = field(default_factory=dict)  # cid -> (end of turn, label)
    replies_done: dict[str, int] = field(default_factory=dict)
    heard: dict[str, int] = field(default_factory=dict)  # frames of the current reply received
    frames_out: int = 0
    refusals: int = 0
    peak_pages: int = 0
    stalled: int = 0
    t0: float = 0.0
    opened: int = 0
    last_arrival: float = 0.0  # seconds after the start; no stall is called before it
    streamed: bool = True  # user turns arrive in real time (`say`)

    def after(self, seconds: float) -> Wait:
        """Wait until `seconds` after the run started (arrival times)."""
        return lambda: time.perf_counter() - self.t0 >= seconds

    def run(self, scripts: Iterable[Script], stall_s: float = 4.0) -> float:
        """Run every script to its end; returns the wall seconds. A run where no audio comes out and no conversation
        opens for `stall_s` stops, and counts the scripts left as stalled."""
        live: list[tuple[Script, Wait | None]] = [(s, None) for s in scripts]
        self.t0 = last_progress = time.perf_counter()
        while live:
            kept = []
            for script, wait in live:
                try:
                    while wait is None or wait():
                        wait = next(script)
                    kept.append((script, wait))
                except StopIteration:
                    pass
            live = kept
            frames, opened = self.frames_out, self.opened
            self.engine.step()
            self._drain()
            self.peak_pages = max(self.peak_pages, pages_held(self.engine))
            now = time.perf_counter()
            if self.frames_out > frames or self.opened > opened or now - self.t0 < self.last_arrival:
                last_progress = now
            elif now - last_progress > stall_s:
                self.stalled = len(live)
                break
        return time.perf_counter() - self.t0

    def _drain(self) -> None:
        for cid in session_ids(self.engine):
            q = self.engine.event_queue(cid)
            while not q.empty():
                event = q.get()
                if isinstance(event, AudioEvent):
                    frames = len(event.pcm) // self.engine.cfg.frame_size
                    self.frames_out += frames
                    self.heard[cid] = self.heard.get(cid, 0) + frames
                    if cid in self.expecting:
                        end, label = self.expecting.pop(cid)
                        t = event.times
                        self.ttfa.setdefault(label, []).append(t["first_audio_out"] - end)
                        start, prefilled = t["reply_start"], t.get("prefill_done", t["reply_start"])
                        self.stages.append((start - end, prefilled - start, t["first_audio_out"] - prefilled))
                elif isinstance(event, MetaEvent) and event.data.get("event") == "reply_done":
                    self.replies_done[cid] = self.replies_done.get(cid, 0) + 1

    # ---- steps a script is made of (each a generator: `yield from`) --------------------------------------------

    def open(self, **kwargs) -> Generator[Wait, None, str]:
        """Open a turn-mode conversation; a refused open is counted and retried every 50 ms."""
        while True:
            try:
                cid = self.engine.open("turn", **kwargs)
                self.opened += 1
                return cid
            except Refused:
                self.refusals += 1
                yield at(time.perf_counter() + 0.05)

    def speak(self, cid: str, pcm: np.ndarray, label: Callable[[], str] | str) -> Script:
        """The user's turn (see `say`); wait for the whole reply."""
        done = self.replies_done.get(cid, 0)
        yield from self.say(cid, pcm, label)
        yield lambda: self.replies_done.get(cid, 0) > done

    def say(self, cid: str, pcm: np.ndarray, label: Callable[[], str] | str) -> Script:
        """The user's turn reaches the engine, whole (pushed at once, as SGLang sends a request) or streamed (80 ms
        blocks, each once its last sample has been spoken, as `s2s client` and a microphone send them); then
        `end_turn`, from which TTFA runs."""
        if self.streamed:
            start = time.perf_counter()
            for a in range(0, len(pcm), BLOCK):
                block = pcm[a : a + BLOCK]
                yield at(start + (a + len(block)) / SAMPLE_RATE)
                self.engine.push_audio(cid, block)
        else:
            self.engine.push_audio(cid, pcm)
        self.engine.end_turn(cid)
        self.expect(cid, label if isinstance(label, str) else label())

    def expect(self, cid: str, label: str) -> None:
        self.expecting[cid] = (time.perf_counter(), label)
        self.heard[cid] = 0

    def regenerate(self, cid: str, label: str) -> Script:
        done = self.replies_done.get(cid, 0)
        self.engine.regenerate(cid)
        self.expect(cid, label)
        yield lambda: self.replies_done.get(cid, 0) > done

    def barge_in(self, cid: str, pcm: np.ndarray, label: str) -> Script:
        """Speak, and cut the reply once `BARGE_IN_FRAMES` frames of it were heard."""
        yield from self.say(cid, pcm, label)
        yield lambda: self.heard[cid] >= BARGE_IN_FRAMES
        self.engine.interrupt(cid, played_frames=BARGE_IN_FRAMES)
