"""Helpers shared by the server tests."""

from __future__ import annotations

import asyncio
import os
import threading

from s2s import Engine
from server.app import ChatServer, ServerOptions
from server.frontends import Frontends

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
