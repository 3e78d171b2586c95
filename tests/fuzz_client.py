"""Sends hypothesis-made messages (50 a second) on one connection: `python tests/fuzz_client.py URL SECONDS`.

Run as its own process by test_server.py, so its CPU stands in for another machine's, not the server's. Exits 0 if
the connection still takes messages and answers after all of it.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from server.moshi import protocol

KINDS = st.sampled_from([b"\x00", b"\x01", b"\x02", b"\x03", b"\x04", b"\x05", b"\x06", b"\x07", b"\xff", b""])
MESSAGE = st.one_of(st.binary(max_size=200), st.builds(lambda k, b: k + b, KINDS, st.binary(max_size=64)))


def main(url: str, seconds: float) -> None:
    loop = asyncio.new_event_loop()  # one connection, kept open across hypothesis examples
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def open_ws():
        return await connect(f"{url}/api/chat?mode=turn&codec=opus", max_size=None)

    ws = run(open_ws())
    sent = 0

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(messages=st.lists(MESSAGE, max_size=20))
    def fuzz(messages: list[bytes]) -> None:
        nonlocal sent

        async def send() -> None:
            for m in messages:  # 50 a second: under the server's flood bound, which test_limits checks
                await ws.send(m)
                await asyncio.sleep(0.02)

        run(send())
        sent += len(messages)

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        fuzz()

    async def still_answers() -> bytes:
        await ws.send(bytes([protocol.Kind.CONTROL]) + b"alive!42")  # a bad control message: the error quotes it
        while True:
            reply = await asyncio.wait_for(ws.recv(), 10)
            if reply[:1] == bytes([protocol.Kind.ERROR]) and b"alive!42" in reply:
                return reply

    run(still_answers())
    run(ws.close())
    print(f"fuzzed {sent} messages; the connection still answers")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
