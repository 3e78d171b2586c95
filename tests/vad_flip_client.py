"""Flips a Realtime session's server_vad setting: `python tests/vad_flip_client.py URL SECONDS` (issue 45's probe).

100 messages a second, inside the server's message bound: a `session.update` that flips `server_vad`'s threshold and
a 480-byte `input_audio_buffer.append`, in turn, reading what comes back; then it waits for the last update's answer
and leaves. Run as its own process by test_realtime_flood.py, so its CPU stands in for another machine's. Prints the
updates it sent, those answered and the errors it was told; exits 0 if every update was answered.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time

from websockets.asyncio.client import connect

RATE = 100.0  # messages a second
APPEND = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(480)).decode()})


def update(threshold: float) -> str:
    vad = {"type": "server_vad", "threshold": threshold}
    session = {"type": "realtime", "audio": {"input": {"turn_detection": vad}}}
    return json.dumps({"type": "session.update", "session": session})


async def main(url: str, seconds: float) -> int:
    sent, updates, answered, errors = 0, 0, 0, []
    async with connect(f"{url}/v1/realtime?model=s2s", max_size=None) as ws:

        async def read() -> None:
            nonlocal answered
            async for message in ws:
                event = json.loads(message)
                if event["type"] == "session.updated":
                    answered += 1
                elif event["type"] == "error":
                    errors.append(event["error"]["message"])

        reader = asyncio.create_task(read())
        start = time.monotonic()
        while (now := time.monotonic()) < start + seconds:
            if sent % 2:
                await ws.send(APPEND)
            else:
                await ws.send(update(0.5 if sent % 4 else 0.6))
                updates += 1
            sent += 1
            await asyncio.sleep(max(0.0, start + sent / RATE - now))
        deadline = time.monotonic() + 60
        while answered < updates and time.monotonic() < deadline and not reader.done():
            await asyncio.sleep(0.05)
        reader.cancel()
    print(f"sent {updates} updates; {answered} answered; errors: {errors}")
    return 0 if answered == updates else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], float(sys.argv[2]))))
