"""`s2s serve --frontends N`: the engine in this process, behind its `EngineCore`, and the websocket endpoints in N
front-end processes listening on one port (SO_REUSEPORT: the kernel spreads connections over them). A front end does
what costs CPU per stream (websockets, Opus, base64 and JSON, the VAD) without the engine thread's GIL, as vLLM's API
server and SGLang's tokenizer manager do beside their schedulers.

The processes are one server: SIGTERM (or Ctrl-C) stops them all, SIGUSR1 drains every front end, and if one dies the
rest are stopped and the command exits with an error, for whatever supervises it to restart the whole (a front end's
conversations cannot move to another); a front end whose parent is killed stops itself. A start that fails, at any
step, leaves no process, folder or socket behind. Each front end's /metrics reads the same engine snapshot and the
same per-turn figures (prometheus-client's multiprocess mode, files in a private folder).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import uvloop

from server.app import ChatServer, ServerOptions, serving_line
from server.connection import PerClient
from server.frontends.engine_client import CoreClients, EngineClient
from server.gc_pause import freeze_startup_heap
from server.ports import reserve

if TYPE_CHECKING:
    from s2s import Engine

log = logging.getLogger("s2s.frontends")

MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"
CORES_PER_FRONTEND = 8  # the default: one front end for this many cores (none below: the engine needs them)


def default_frontends() -> int:
    return len(os.sched_getaffinity(0)) // CORES_PER_FRONTEND  # (the cores this process may run on)


class Frontends:
    """The engine core (a thread of this process) and `count` front-end processes listening on one port."""

    def __init__(self, engine: Engine, options: ServerOptions, count: int):
        # (here, not above: a front end imports this module, and the core would bring it the engine's imports)
        from server.frontends.engine_core import EngineCore

        if count < 1:
            raise ValueError(f"front ends: at least 1, got {count}")
        self.engine, self.count = engine, count
        with contextlib.ExitStack() as undo:  # what is made here is unmade if a later step fails
            self._held = undo.enter_context(reserve(options.host, options.port))  # first: nothing made yet
            self.options = replace(options, port=self._held.getsockname()[1])  # one port for all, even asked for 0
            self.folder = tempfile.mkdtemp(prefix="s2s-")
            undo.callback(shutil.rmtree, self.folder, ignore_errors=True)
            self._metrics = os.path.join(self.folder, "metrics")
            os.mkdir(self._metrics)
            address = f"ipc://{self.folder}/engine"
            self.clients = PerClient(options.limits.max_conversations_per_client, options.forwarded_allow_ips)
            self.core = EngineCore(engine, address, self.clients)
            self._undo = undo.pop_all()  # now `stop`'s
        spawn = multiprocessing.get_context("spawn")
        self._ready: multiprocessing.Queue = spawn.Queue()
        self.children = [
            spawn.Process(
                target=run_frontend,
                args=(address, self.options, i, self._ready),
                name=f"s2s-frontend-{i}",
                daemon=True,
            )
            for i in range(count)
        ]
        self._stop = threading.Event()
        self._core = threading.Thread(target=self.core.run, args=(self._stop.is_set,), name="s2s-core", daemon=True)

    def start(self, timeout_s: float = 120.0) -> int:
        """Start the engine, the core and the front ends; returns the port once every front end listens on it. A
        start that fails stops what it started (`stop`) before it raises."""
        try:
            self._launch()
            self._wait_listening(timeout_s)
        except BaseException:
            self.stop()
            raise
        self._held.close()
        return self.options.port

    def _launch(self) -> None:
        self.engine.start()
        self._core.start()
        before = os.environ.get(MULTIPROC)
        os.environ[MULTIPROC] = self._metrics  # the children's, read as they import prometheus-client
        try:
            for child in self.children:
                child.start()
        finally:
            if before is None:
                del os.environ[MULTIPROC]
            else:
                os.environ[MULTIPROC] = before

    def _wait_listening(self, timeout_s: float) -> None:
        deadline, listening = time.monotonic() + timeout_s, set()
        while len(listening) < self.count:
            if (dead := self.dead()) is not None:
                raise RuntimeError(f"{dead} exited as it started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.count - len(listening)} front ends did not listen in {timeout_s:g} s")
            try:
                listening.add(self._ready.get(timeout=0.2))
            except queue.Empty:
                pass

    def dead(self) -> str | None:
        """What has ended that should not have: a front end (by name), or the engine core's thread."""
        if self._core.ident is not None and not self._core.is_alive() and not self._stop.is_set():
            return "the engine core"  # (its log says why)
        return next((c.name for c in self.children if c.exitcode is not None), None)

    def drain(self) -> None:
        """Every front end takes no new conversation (`ChatServer.drain`)."""
        for child in self.children:
            if child.pid is not None:
                os.kill(child.pid, signal.SIGUSR1)

    def stop(self) -> None:
        for child in self.children:
            if child.exitcode is None and child.pid is not None:
                child.terminate()
        for child in self.children:
            if child.pid is not None:
                child.join(20)
                if child.exitcode is None:
                    child.kill()
                    child.join()
        self._stop.set()
        if self._core.is_alive():
            self._core.join()
        self.engine.stop()
        self._undo.close()  # the port's socket, the folder


def serve_with_frontends(engine: Engine, options: ServerOptions, count: int) -> int:
    """`s2s serve --frontends COUNT`: serve until SIGTERM or Ctrl-C; returns the exit status (1: a front end died).
    `PortInUse` if something else listens on the port."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # (first: a stop asked for while it starts is no kill)
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    group = Frontends(engine, options, count)
    signal.signal(signal.SIGUSR1, lambda *_: group.drain())
    try:
        port = group.start()
        print(f"{count} front-end processes, the engine in process {os.getpid()}")
        print(serving_line(options, port), flush=True)
        while not stop.wait(0.2):
            if (dead := group.dead()) is not None:
                log.error("%s exited: stopping the server", dead)
                return 1
        return 0
    finally:
        group.stop()


def run_frontend(address: str, options: ServerOptions, index: int, ready: multiprocessing.Queue) -> None:
    """A front-end process: `ChatServer` on the core's engine, on the shared port, until SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops everyone
    uvloop.run(_frontend(address, options, index, ready))  # libuv's event loop: less CPU a message than asyncio's
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # stopped cleanly: skip the interpreter's teardown, where Triton's bindings report false leaks


async def _frontend(address: str, options: ServerOptions, index: int, ready: multiprocessing.Queue) -> None:
    engine = EngineClient(address, f"frontend-{index}".encode())
    limits = options.limits
    clients = CoreClients(engine, limits.max_conversations_per_client, options.forwarded_allow_ips)
    server = ChatServer(engine, options, clients=clients, reuse_port=True)
    stop, loop = asyncio.Event(), asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(multiprocessing.parent_process().sentinel, stop.set)  # the parent killed: no SIGTERM comes
    loop.add_signal_handler(signal.SIGUSR1, server.drain)
    await server.start()
    freeze_startup_heap()
    ready.put(index)
    try:
        await stop.wait()
    finally:
        await server.stop()
