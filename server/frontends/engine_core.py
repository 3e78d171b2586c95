"""EngineCore: one engine served over ZeroMQ to the front-end processes of `s2s serve --frontends N`.

Each front end holds one DEALER socket to the core's ROUTER (`server/frontends/engine_client.py`), so what one front
end sends arrives in the order it sent it: a conversation's open, its audio, its close. A message is pickled: an
engine command (`s2s/engine/commands.py`: audio in, turn ends, close), which the core submits to its engine if that
front end holds the conversation, or a query `(request_id, method, args)` (`QUERIES`), answered unless its id is
None. The core sends a front end `("reply", id, ok, value)`, `("events", [(cid, event), ...])` (every event its
conversations had since the last batch, in one message) and `("snapshot", s)`: the engine's last snapshot, at most
every `SNAPSHOT_S`, for its /metrics and its turn gate.

How many conversations one client holds is counted here, for the whole server: a client's connections may land on
any front end (SO_REUSEPORT spreads them by hash).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable

import zmq

from s2s import Engine, Refused
from s2s.engine.commands import Close, Command
from s2s.engine.events import EventQueue
from server.connection import PerClient

log = logging.getLogger("s2s.core")

SNAPSHOT_S = 0.1  # how stale a front end's snapshot may be
QUERIES = frozenset(
    {"hello", "open", "voices", "admission_problem", "client_problem", "client_take", "client_give_back"}
)


class EngineCore:
    def __init__(self, engine: Engine, address: str, clients: PerClient):
        self.engine, self.clients = engine, clients
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # events wait in memory for a busy front end; never dropped
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.bind(address)
        self.frontends: set[bytes] = set()
        self.held: dict[str, bytes] = {}  # open conversation -> its front end
        self.forwarding: dict[str, tuple[bytes, EventQueue]] = {}  # conversation -> where its events go, until the last
        self._due: set[str] = set()  # conversations with events to forward (added to by the engine thread)
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._snapshot_sent: object = None

    def run(self, stop: Callable[[], bool]) -> None:
        """Serve until `stop()` is true (asked at least every `SNAPSHOT_S`)."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last = 0.0
        while not stop():
            ready = dict(poller.poll(SNAPSHOT_S * 1000))
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
                self._forward_events()
            if self.socket in ready:
                self._receive()
            if time.monotonic() - last >= SNAPSHOT_S:
                last = time.monotonic()
                self._send_snapshot()
        self.socket.close(linger=0)

    def _receive(self) -> None:
        while True:
            try:
                frontend, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = pickle.loads(payload)
            if isinstance(message, Command):
                self._command(frontend, message)
            else:
                self._query(frontend, *message)

    def _query(self, frontend: bytes, request: int | None, method: str, args: tuple) -> None:
        if method not in QUERIES:
            reply = (False, ValueError(f"unknown query {method!r}"))
        else:
            try:
                reply = (True, getattr(self, f"_{method}")(frontend, *args))
            except (Refused, KeyError, ValueError) as e:  # the caller's to handle: refused, an unknown voice
                reply = (False, e)
        if request is not None:
            self._send(frontend, ("reply", request, *reply))
        elif not reply[0]:
            log.warning("%s%r: %s", method, args, reply[1])

    def _command(self, frontend: bytes, command: Command) -> None:
        if self.held.get(command.cid) != frontend:
            log.warning("%s(%s) from a front end that does not hold it: ignored", command.call, command.cid)
            return
        if isinstance(command, Close):
            del self.held[command.cid]
        try:
            self.engine.submit(command)
        except (KeyError, ValueError) as e:  # the front end checks what it can; the rest is logged
            log.warning("%s(%s): %s", command.call, command.cid, e)

    def _hello(self, frontend: bytes) -> dict:
        self.frontends.add(frontend)
        engine = self.engine
        pieces = getattr(engine.model, "text_pieces", None)  # (its tokenizer, by path: a front end loads its own)
        return {
            "model_config": engine.model.config,
            "text_pieces": None
            if pieces is None
            else (str(pieces.path), (pieces.padding_id, *sorted(pieces.padding_ids - {pieces.padding_id}))),
            "engine_config": engine.cfg,
            "has_codec": engine.tok is not None,
            "snapshot": engine.snapshot(),
        }

    def _open(self, frontend: bytes, mode: str, prompt, sampling, session_id, resume) -> str:
        cid = self.engine.open(mode, prompt=prompt, sampling=sampling, session_id=session_id, resume=resume)
        events = self.engine.event_queue(cid)
        self.held[cid], self.forwarding[cid] = frontend, (frontend, events)
        events.on_put = lambda: self._due_now(cid)
        return cid

    def _voices(self, frontend: bytes) -> list[str]:
        return sorted(self.engine.voices)

    def _admission_problem(self, frontend: bytes, count: bool) -> str | None:
        return self.engine.admission_problem(count)

    def _client_problem(self, frontend: bytes, client: str) -> str | None:
        return self.clients.problem(client)

    def _client_take(self, frontend: bytes, client: str) -> None:
        self.clients.take(client)

    def _client_give_back(self, frontend: bytes, client: str) -> None:
        self.clients.give_back(client)

    def _due_now(self, cid: str) -> None:
        """From the engine thread: `cid` has events. One wake-up of the core's loop for a tick's burst."""
        with self._lock:
            first = not self._due
            self._due.add(cid)
        if first:
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the pipe is full of wake-ups: the loop wakes anyway
                pass

    def _forward_events(self) -> None:
        with self._lock:
            due, self._due = self._due, set()
        batches: dict[bytes, list] = {}
        for cid in due:
            if cid not in self.forwarding:
                continue
            frontend, events = self.forwarding[cid]
            batch = batches.setdefault(frontend, [])
            while True:
                try:
                    event = events.get_nowait()
                except queue.Empty:
                    break
                batch.append((cid, event))
                if event is None:  # its last: the conversation is closed
                    del self.forwarding[cid]
                    break
        for frontend, batch in batches.items():
            self._send(frontend, ("events", batch))

    def _send_snapshot(self) -> None:
        snapshot = self.engine.snapshot()
        if snapshot is self._snapshot_sent or not self.frontends:
            return
        self._snapshot_sent = snapshot
        payload = pickle.dumps(("snapshot", snapshot), protocol=5)
        for frontend in self.frontends:
            self.socket.send_multipart([frontend, payload])

    def _send(self, frontend: bytes, message: tuple) -> None:
        self.socket.send_multipart([frontend, pickle.dumps(message, protocol=5)])
