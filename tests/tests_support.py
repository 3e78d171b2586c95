"""Helpers shared by the tests: a server on a thread of its own, and waits on what a test checks (a condition, or
the engine's own state read on its thread) instead of fixed sleeps."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from s2s import Engine
from s2s.engine.commands import PushAudio
from server.app import ChatServer, ServerOptions
from server.frontends.processes import Frontends

FRONTENDS = int(os.environ.get("S2S_TEST_FRONTENDS", "0"))  # the server tests through this many front-end processes


class ServerThread:
    """The server on its own event loop in a thread, so a browser process can talk to it; with `FRONTENDS`, the
    engine behind that many front-end processes instead."""

    def __init__(self, engine: Engine, options: ServerOptions):
        self.engine, self.options = engine, options
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.frontends: Frontends | None = None

    def __enter__(self) -> int:
        if FRONTENDS:
            self.frontends = Frontends(self.engine, self.options, FRONTENDS)
            return self.frontends.start()
        self.server = ChatServer(self.engine, self.options)
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def __exit__(self, *exc) -> None:
        if self.frontends is not None:
            return self.frontends.stop()
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def spy_pushes(engine) -> list[int]:
    """The length of every PCM array the server hands the engine: every call reaches `engine.submit` as a command,
    in one process (`Engine.push_audio`) and through front ends (`EngineCore`). Called on the server's side: this list
    is the server's record, not the engine's state."""
    pushed, submit = [], engine.submit

    def spy(command) -> None:
        if isinstance(command, PushAudio):
            pushed.append(len(command.pcm))
        submit(command)

    engine.submit = spy
    return pushed


def wait_until(
    predicate: Callable[[], Any],
    timeout_s: float = 30.0,
    what: str | Callable[[], str] = "",
    *,
    interval_s: float = 0.02,
) -> Any:
    """Poll `predicate()` until it returns something truthy, and return that; `AssertionError` naming `what` (a
    string, or a function of no arguments called for one, to say what there was instead) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what() if callable(what) else what}")
        time.sleep(interval_s)
    return value


async def until(
    predicate: Callable[[], Any],
    timeout_s: float = 30.0,
    what: str | Callable[[], str] = "",
    *,
    interval_s: float = 0.02,
) -> Any:
    """`wait_until` for a coroutine: `predicate` may be a coroutine function (an HTTP scrape, say); the event loop
    runs meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what() if callable(what) else what}")
        await asyncio.sleep(interval_s)


# ---- the engine's live state, read on its own thread ------------------------------------------------------------
# While an engine runs its loop, its sessions, cache and stats are its thread's alone (s2s/engine/engine.py); other
# threads read `engine.snapshot()`. What the snapshot does not publish (a session's turns, its frames, its codes), a
# test reads with these: the function runs on the engine thread right after a tick, and hands back copies or plain
# values, never a live object to look at later. With no loop running, it runs at once, in the caller's thread.


def _probes(engine) -> queue.SimpleQueue:
    """The engine's queue of (function, future, repeat) that its thread runs after each tick (installed once, by
    wrapping the engine's `step`: its loop calls `self.step()` every tick). A probe runs after a whole tick that began
    once it was queued: that tick applied every command queued before it (a push, a close)."""
    probes = engine.__dict__.get("_test_probes")
    if probes is None:
        probes = engine.__dict__["_test_probes"] = queue.SimpleQueue()
        step = engine.step

        def step_then_probe() -> None:
            due = []
            while True:
                try:
                    due.append(probes.get_nowait())
                except queue.Empty:
                    break
            step()
            for fn, future, repeat in due:
                if future.cancelled():  # (its test gave up waiting)
                    continue
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # (cancelled meanwhile)
                    try:
                        value = fn()
                    except BaseException as e:  # to the test's thread: the engine thread goes on
                        future.set_exception(e)
                        continue
                    if value or not repeat:
                        future.set_result(value)
                    else:
                        probes.put((fn, future, repeat))

        engine.step = step_then_probe
    return probes


def _engine_runs(engine) -> bool:
    thread = getattr(engine, "_thread", None)
    return thread is not None and thread.is_alive()


def on_engine_thread(engine, fn: Callable[[], Any], repeat: bool = False) -> concurrent.futures.Future:
    """A future of `fn()` run on the engine's thread after the next tick that begins from now (`repeat`: after every
    tick until it returns something truthy)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if not _engine_runs(engine):
        value = fn()
        if value or not repeat:
            future.set_result(value)
            return future
    _probes(engine).put((fn, future, repeat))
    return future


def _timed_out(future: concurrent.futures.Future, timeout_s: float, what: str) -> AssertionError:
    future.cancel()
    return AssertionError(f"not within {timeout_s:g} s: {what}")


def engine_read(engine, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """`fn()` on the engine's thread, between two ticks; what it returned."""
    future = on_engine_thread(engine, fn)
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        raise _timed_out(future, timeout_s, "the engine ran no tick to read its state on") from None


def engine_wait(engine, predicate: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> Any:
    """Until `predicate()`, evaluated on the engine's thread after each tick, is truthy; that value."""
    future = on_engine_thread(engine, predicate, repeat=True)
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        raise _timed_out(future, timeout_s, what) from None


async def engine_read_async(engine, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """`engine_read` for a coroutine (its event loop goes on meanwhile)."""
    future = on_engine_thread(engine, fn)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except TimeoutError:
        raise _timed_out(future, timeout_s, "the engine ran no tick to read its state on") from None


async def engine_until(engine, predicate: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> Any:
    """`engine_wait` for a coroutine."""
    future = on_engine_thread(engine, predicate, repeat=True)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except TimeoutError:
        raise _timed_out(future, timeout_s, what) from None


async def snapshot_until(engine, predicate: Callable[[Any], Any], timeout_s: float = 30.0, what: str = "") -> Any:
    """Until `predicate(engine.snapshot())` holds; that snapshot (the published one: any thread may read it)."""

    def holds() -> Any:
        snapshot = engine.snapshot()
        return snapshot if predicate(snapshot) else None

    return await until(holds, timeout_s, what)


async def next_snapshot(engine, timeout_s: float = 30.0):
    """A snapshot the engine publishes after this call: one of a tick that ends later, so it holds what other threads
    did to the engine before the call (a refusal counted, a command queued: applied by then)."""
    ticks = engine.snapshot().stats.ticks
    return await snapshot_until(engine, lambda s: s.stats.ticks > ticks + 1, timeout_s, "the engine stopped ticking")


async def served(engine: Engine, body: Callable[[str], Any], frontends: int = FRONTENDS) -> Any:
    """`await body(url)` against a server on `engine` started for it (behind `frontends` front-end processes where
    more than 0), stopped after."""
    if frontends:
        group = Frontends(engine, ServerOptions(port=0), frontends)
        port = await asyncio.to_thread(group.start)
        try:
            return await body(f"ws://127.0.0.1:{port}")
        finally:
            await asyncio.to_thread(group.stop)
    server = ChatServer(engine, ServerOptions(port=0))
    port = await server.start()
    try:
        return await body(f"ws://127.0.0.1:{port}")
    finally:
        await server.stop()
