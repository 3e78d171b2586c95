"""One simulated user over Moshi's protocol (pcm16), following a `Plan`: a microphone that streams 80 ms blocks in
real time (speech when the user talks, silence otherwise, nothing while muted), turns, barge-ins, and a close frame or
an aborted connection at the end. What happens to it goes into a shared `Events` log, stamped with time.monotonic().
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.soak.plans import Plan
from codec.pcm import SAMPLE_RATE, to_pcm16
from server.moshi import protocol
from server.moshi.client import refusal_of
from server.moshi.protocol import BLOCK, Control, Kind, metadata_of

REFUSED = (429, 503)  # the HTTP statuses of a refused upgrade: the server is full or drains (503), or 429 for a
# client at its limit of conversations; the body is "refused: REASON"


@dataclass(frozen=True)
class Event:
    t: float  # time.monotonic()
    kind: str
    value: float | str | None = None
    mode: str = ""


# Event kinds: "opened", "refused" (the reason, told before the upgrade or after it), "error" (an error message, or
# an error event), "dropped" (the server closed the connection: code and reason), "failed" (no websocket), "latency"
# (end of speech to the first reply audio, s), "server_ttfa" (the server's stamps: end of turn to first audio out,
# s), "no_reply", "barge_in", "barge_in_missed" (the reply it spoke over played to its end), "silent", "left" (close
# or abort), "audio_s" (reply audio received over the conversation), "client_bug".
class Events(list):
    def add(self, kind: str, value: float | str | None = None, mode: str = "") -> None:
        self.append(Event(time.monotonic(), kind, value, mode))

    def between(self, t0: float, t1: float) -> list[Event]:
        return [e for e in self if t0 <= e.t < t1]


class Microphone:
    """80 ms blocks at real time, as a browser's microphone sends them: queued speech, else silence; nothing at all
    while `muted`. A block goes once its last sample has been spoken."""

    def __init__(self, send: Callable[[bytes], object]):
        self.send = send
        self.queue: deque[tuple[np.ndarray, asyncio.Future]] = deque()
        self.offset = 0  # samples of the first queued clip already sent
        self.muted = False
        self.blocks = 0

    async def say(self, pcm: np.ndarray) -> float:
        """Queue `pcm`; returns when its last block went out (the end of speech), as time.monotonic()."""
        done = asyncio.get_running_loop().create_future()
        self.queue.append((pcm, done))
        return await done

    def next_block(self) -> tuple[np.ndarray, asyncio.Future | None]:
        """The next block (speech, zero-padded at a clip's end, or silence), and the clip it finishes, if any."""
        if not self.queue:
            return np.zeros(BLOCK, dtype=np.float32), None
        pcm, done = self.queue[0]
        block = pcm[self.offset : self.offset + BLOCK]
        self.offset += BLOCK
        if self.offset < len(pcm):
            return block, None
        self.queue.popleft()
        self.offset = 0
        return np.pad(block, (0, BLOCK - len(block))), done

    async def run(self) -> None:
        start = time.monotonic()
        while True:
            self.blocks += 1
            await asyncio.sleep(max(0.0, start + self.blocks * BLOCK / SAMPLE_RATE - time.monotonic()))
            if self.muted:
                continue
            block, done = self.next_block()
            await self.send(protocol.audio(to_pcm16(block)))
            if done is not None and not done.done():
                done.set_result(time.monotonic())


class SoakClient:
    """Runs one `Plan`. `run(leave)` returns how the conversation went: "refused", "failed", "dropped" (the server
    closed it) or "left"; when `leave` is set the user leaves at once, the way the plan says."""

    def __init__(self, url: str, plan: Plan, clips: list[np.ndarray], events: Events, reply_timeout_s: float = 15.0):
        self.url, self.plan, self.clips, self.events = url, plan, clips, events
        self.reply_timeout_s = reply_timeout_s
        self.ws: ClientConnection | None = None
        self.opened = self.refused = False
        self.arrivals: list[float] = []  # time of each reply audio message
        self.samples = 0
        self.replies_done = 0
        self._changed = asyncio.Event()  # set on every message read

    def _add(self, kind: str, value: float | str | None = None) -> None:
        self.events.add(kind, value, self.plan.mode)

    async def run(self, leave: asyncio.Event) -> str:
        try:
            self.ws = await connect(f"{self.url}/api/chat?{self.plan.query()}", max_size=None, open_timeout=20)
        except InvalidStatus as e:
            if e.response.status_code in REFUSED:  # the server is full (or drains): told before the upgrade
                self.refused = True
                self._add("refused", refusal_of(e))
                return "refused"
            self._add("failed", repr(e))
            return "failed"
        except Exception as e:  # noqa: BLE001 - whatever stops the websocket is the outcome
            self._add("failed", repr(e))
            return "failed"
        reader = asyncio.create_task(self._read())
        if not await self._until(lambda: self.opened or reader.done(), 20.0) or not self.opened:
            await self._abort(reader)
            return "refused" if self.refused else "failed"
        self._add("opened")
        mic = Microphone(self.ws.send)
        tasks = [asyncio.create_task(t) for t in (mic.run(), self._script(mic), leave.wait())]
        await asyncio.wait([reader, *tasks], return_when=asyncio.FIRST_COMPLETED)
        failures = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for e in failures:
            if not isinstance(e, ConnectionClosed):
                self._add("client_bug", repr(e))
        self._add("audio_s", self.samples / SAMPLE_RATE)
        if reader.done() or failures:  # the server closed it (or this client broke: cut it)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), 5)
            if reader.done():
                self._add("dropped", f"{self.ws.close_code} {self.ws.close_reason}".strip())
                return "dropped"
            await self._abort(reader)
            return "failed"
        if self.plan.leave == "abort":
            await self._abort(reader)
        else:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                await self.ws.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reader, 5)
        self._add("left", self.plan.leave)
        return "left"

    async def _abort(self, reader: asyncio.Task) -> None:
        """The TCP connection cut, no close frame."""
        self.ws.transport.abort()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reader, 5)

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in self.ws:
                kind = message[0]
                if kind == Kind.AUDIO:
                    self.arrivals.append(time.monotonic())
                    self.samples += (len(message) - 1) // 2
                elif kind == Kind.METADATA:
                    self._metadata(metadata_of(message))
                elif kind == Kind.ERROR:
                    text = message[1:].decode(errors="replace")
                    self.refused = self.refused or text.startswith("refused")
                    self._add("refused" if text.startswith("refused") else "error", text)
                self._changed.set()
        self._changed.set()

    def _metadata(self, data: dict) -> None:
        event = data.get("event")
        if event is None and not self.opened:  # the first: the conversation is open
            self.opened = True
        elif event == "reply_done":
            self.replies_done += 1
            times = data.get("times", {})
            if "first_audio_out" in times and "end_of_turn" in times:
                self._add("server_ttfa", times["first_audio_out"] - times["end_of_turn"])
        elif event == "error":
            self._add("error", str(data.get("message")))

    async def _until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `done()` (checked after each message read), at most `timeout_s`; `done()` then."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not done():
                    self._changed.clear()
                    await self._changed.wait()
        return done()

    async def _script(self, mic: Microphone) -> None:
        plan = self.plan
        barged: int | None = None  # after a barge-in: the replies done when the user started speaking over one
        for i, turn in enumerate(plan.turns):
            if plan.silent_before == i:
                self._add("silent", plan.silent_s)
                mic.muted = plan.mute
                await asyncio.sleep(plan.silent_s)
                mic.muted = False
            if barged is None:  # a barge-in speaks at once, over the reply
                await asyncio.sleep(turn.gap_s)
            ended = await mic.say(self.clips[turn.utterance])
            if barged is not None and self.replies_done > barged:  # the reply played to its end: not cut
                self._add("barge_in_missed")
            barged = None
            if plan.mode == "duplex":
                continue
            heard, replies = len(self.arrivals), self.replies_done
            await self.ws.send(protocol.control(Control.END_TURN))
            if not await self._until(lambda heard=heard: len(self.arrivals) > heard, self.reply_timeout_s):
                self._add("no_reply")
                continue
            self._add("latency", self.arrivals[heard] - ended)
            if i == len(plan.turns) - 1 and plan.leave_mid_reply:
                await asyncio.sleep(0.3)
                return
            if turn.barge_in_s is not None:
                await asyncio.sleep(turn.barge_in_s)
                self._add("barge_in")
                barged = self.replies_done
            else:
                await self._until(lambda replies=replies: self.replies_done > replies, self.reply_timeout_s)
        await asyncio.sleep(0.5 if plan.mode == "duplex" else 0.0)  # a duplex user hears the end of the reply
