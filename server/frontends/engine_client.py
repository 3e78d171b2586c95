"""EngineClient: the engine's public interface (`s2s/engine/engine.py`) in a front-end process, to the `EngineCore`
over ZeroMQ (`server/frontends/engine_core.py`), so that `ChatServer` serves the same protocols in front ends as in
one process.

Calls that change a conversation are the engine's commands (`s2s/engine/commands.py`), checked here by the same code
as in the engine (a turn-mode call on a duplex conversation, samples out of range, an unknown conversation raise
here), then sent and never waited on, as the engine's own calls never wait for a tick. `open` and the admission
questions wait for the core's answer. Events come back in batches and go into each conversation's own `EventQueue`,
which the server reads as it reads the engine's; the engine's snapshot comes at most `SNAPSHOT_S` old.

`CoreClients` is the server's `PerClient` with its counts in the core: one count per client for the whole server.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import threading
from collections.abc import Iterable
from types import SimpleNamespace

import numpy as np
import torch
import zmq

from s2s import EngineSnapshot, SamplingParams
from s2s.engine.commands import Calls, Close, Command, not_open
from s2s.engine.events import EventQueue
from s2s.models.moshi.text import TextPieces
from server.connection import PerClient

ANSWER_TIMEOUT_S = 30.0  # a core that takes longer is gone (`s2s serve` then stops every process)


class EngineClient(Calls):
    def __init__(self, address: str, identity: bytes):
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(address)
        self._lock = threading.RLock()  # the socket's: the endpointers' threads read the snapshot
        self._requests = itertools.count()
        self._queues: dict[str, EventQueue] = {}  # conversation -> its events, until the last
        self._modes: dict[str, str] = {}  # open conversation -> its mode
        self._loop: asyncio.AbstractEventLoop | None = None
        hello = self.query("hello")
        pieces = hello["text_pieces"]  # with a text stream (Moshi's): the sentencepiece file and padding ids
        self.model = SimpleNamespace(config=hello["model_config"], text_pieces=TextPieces(*pieces) if pieces else None)
        self.cfg = hello["engine_config"]  # with its codec's frame size, which this process cannot import
        self._has_codec, self._snapshot = hello["has_codec"], hello["snapshot"]

    # ---- the engine's interface --------------------------------------------------------------------------------

    def start(self) -> None:
        """Read the core's messages on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.socket.getsockopt(zmq.FD), self._drain)
        self._drain()

    def stop(self) -> None:
        """The core outlives its front ends: nothing to stop here."""

    def open(
        self,
        mode: str = "duplex",
        prompt: np.ndarray | torch.Tensor | str | None = None,
        sampling: SamplingParams | None = None,
        session_id: str | None = None,
        resume: bool = False,
    ) -> str:
        if prompt is not None and not isinstance(prompt, str):
            prompt = self.model.config.checked_codes(prompt, "prompt codes")
        with self._lock:  # its queue is there before the loop can read its first events
            cid = self.query("open", mode, prompt, sampling or SamplingParams(), session_id, resume)
            self._queues[cid], self._modes[cid] = EventQueue(self.cfg.frame_size), mode
        return cid

    def admission_problem(self, count: bool = False) -> str | None:
        return self.query("admission_problem", count)

    def submit(self, command: Command) -> None:
        """Check `command` here, as the engine would in the caller's thread, and send it to the core; nothing waits
        for it."""
        command = command.checked(self.model.config, self._has_codec)
        command.check_mode(self._modes[self._held(command.cid)])
        self._send(command)
        if isinstance(command, Close):
            del self._modes[command.cid]

    def event_queue(self, cid: str) -> EventQueue:
        return self._queues[self._held(cid)]

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    @property
    def voices(self) -> frozenset[str]:
        """The voice prompts' names, asked of the core each time: voices may be added while it serves."""
        return frozenset(self.query("voices"))

    # ---- the socket --------------------------------------------------------------------------------------------

    def _held(self, cid: str) -> str:
        if cid not in self._modes:
            raise not_open(cid)
        return cid

    def tell(self, method: str, *args) -> None:
        """Ask the core (`engine_core.QUERIES`) without waiting for its answer, which it does not send."""
        self._send((None, method, args))

    def query(self, method: str, *args):
        """The core's answer (`engine_core.QUERIES`), or its exception, raised here. Messages that come before it
        are dispatched."""
        with self._lock:
            request = next(self._requests)
            self._send((request, method, args))
            while True:
                if not self.socket.poll(ANSWER_TIMEOUT_S * 1000):
                    raise RuntimeError(f"the engine core did not answer {method} in {ANSWER_TIMEOUT_S:g} s")
                message = pickle.loads(self.socket.recv())
                if message[0] == "reply" and message[1] == request:
                    break
                self._dispatch(message)
            self._read_soon()
        ok, value = message[2:]
        if not ok:
            raise value
        return value

    def _send(self, message: tuple) -> None:
        with self._lock:
            self.socket.send(pickle.dumps(message, protocol=5))
            self._read_soon()

    def _read_soon(self) -> None:
        """After a send or a receive outside `_drain`: the socket's descriptor signals a change only, so messages
        that came in meanwhile would wait, unread, for the next one."""
        if self._loop is not None and self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            while self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._dispatch(pickle.loads(self.socket.recv(zmq.NOBLOCK)))

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "events":
            for cid, event in message[1]:
                self._queues[cid].put(event)
                if event is None:
                    del self._queues[cid]
        elif kind == "snapshot":
            self._snapshot = message[1]


class CoreClients(PerClient):
    """`PerClient` whose counts are the engine core's: a client's connections may reach any front end."""

    def __init__(self, core: EngineClient, limit: int, proxies: Iterable[str] = ()):
        super().__init__(limit, proxies)
        self.core = core

    def problem(self, client: str) -> str | None:
        return self.core.query("client_problem", client)

    def take(self, client: str) -> None:
        self.core.query("client_take", client)

    def give_back(self, client: str) -> None:
        self.core.tell("client_give_back", client)
