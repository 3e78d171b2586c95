"""Helpers shared by the server tests."""

from __future__ import annotations

import asyncio
import threading

from server.app import ChatServer


class ServerThread:
    """The server on its own event loop in a thread, so a browser process can talk to it."""

    def __init__(self, server: ChatServer):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> int:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
