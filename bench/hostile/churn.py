"""Churn (issue 45): what conversations that come and go leave in the server, and what a Realtime client that flips
its VAD setting costs a healthy duplex conversation beside it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import urllib.error
import urllib.request

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.common import scrape
from bench.concurrency_bench import rss_bytes, utterances
from codec.pcm import SAMPLE_RATE, to_pcm16
from server.moshi import protocol
from server.moshi.client import refusal_of, talk
from server.moshi.protocol import Kind

REPLY_WAIT_S = 20.0  # a cycle waits this long at most for the first reply audio
BETA = {"OpenAI-Beta": "realtime=v1"}  # the beta's session.update names `turn_detection` at the top


async def moshi_cycle(url: str, pcm: bytes) -> str:
    """One Moshi-protocol conversation: open, send `pcm` (pcm16) in one message, wait for the first reply audio (the
    engine has taken the audio in), close. What it got: "ok", "refused" or "no reply"."""
    try:
        async with connect(f"{url}/api/chat?codec=pcm16", max_size=None) as ws:
            await ws.send(protocol.audio(pcm))
            async with asyncio.timeout(REPLY_WAIT_S):
                async for message in ws:
                    if message[0] == Kind.AUDIO:
                        return "ok"
    except InvalidStatus as e:
        return f"refused: {refusal_of(e)}"
    except (TimeoutError, ConnectionClosed):
        pass
    return "no reply"


async def realtime_cycle(url: str, audio_b64: str) -> str:
    """One Realtime API conversation: open, append the audio, commit, ask for a response, wait for its first audio,
    close."""
    try:
        async with connect(f"{url}/v1/realtime?model=s2s", additional_headers=BETA, max_size=None) as ws:
            for event in (
                {"type": "session.update", "session": {"turn_detection": None}},
                {"type": "input_audio_buffer.append", "audio": audio_b64},
                {"type": "input_audio_buffer.commit"},
                {"type": "response.create"},
            ):
                await ws.send(json.dumps(event))
            async with asyncio.timeout(REPLY_WAIT_S):
                async for message in ws:
                    if json.loads(message)["type"] in ("response.audio.delta", "response.output_audio.delta"):
                        return "ok"
    except InvalidStatus as e:
        return f"refused: {refusal_of(e)}"
    except (TimeoutError, ConnectionClosed):
        pass
    return "no reply"


async def cycles(url: str, pid: int, cycle, payload, warm: int, n: int, parallel: int = 2) -> tuple[float, str]:
    """RSS growth per conversation (bytes) over `n` cycles after `warm` of them, `parallel` at a time; and what the
    measured cycles got."""

    async def run(count: int) -> list[str]:
        todo, got = iter(range(count)), []

        async def worker() -> None:
            for _ in todo:
                got.append(await cycle(url, payload))

        await asyncio.gather(*(worker() for _ in range(parallel)))
        return got

    await run(warm)
    before = rss_bytes(pid)
    got = await run(n)
    return (rss_bytes(pid) - before) / n, "; ".join(f"{got.count(o)} x {o}" for o in sorted(set(got)))


async def churn(url: str, pid: int, quick: bool) -> dict[str, object]:
    """After one 12 s duplex conversation (a server's rows of frames are as wide as the longest conversation it has
    had, and the code before kept a copy of a closed conversation's whole row), the RSS each short one leaves. Run
    the server with `MALLOC_MMAP_THRESHOLD_=65536`: glibc otherwise serves those copies from space a tick freed, and
    hides them for hundreds of conversations (`tests/test_churn.py`)."""
    await talk(url, utterances(12.0, 1)[0], mode="duplex", codec="pcm16", listen_s=0.5)
    pcm = to_pcm16(utterances(2.0, 1)[0])
    warm, n = (30, 150) if quick else (100, 600)
    per, got = await cycles(url, pid, moshi_cycle, pcm, warm, n)
    out: dict[str, object] = {
        f"churn: RSS growth per Moshi conversation (KB), {n} after a 12 s one and {warm}, 2 s of audio each": per / 1e3,
        "churn: the Moshi conversations got": got,
    }
    n_rt = n // 4
    per, got = await cycles(url, pid, realtime_cycle, base64.b64encode(pcm).decode(), warm // 4, n_rt)
    out[f"churn: RSS growth per Realtime conversation (KB), {n_rt} after {warm // 4}"] = per / 1e3
    out["churn: the Realtime conversations got"] = got
    return out


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks (USER_HZ 100)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.replace("ws://", "http://") + "/healthz", timeout=5):
            return True
    except (urllib.error.URLError, OSError):
        return False


async def vad_flipper(url: str, seconds: float, rate: float) -> int:
    """A Realtime client that sends, `rate` messages a second, a `session.update` flipping `server_vad`'s threshold
    and a 480-byte append in turn, for `seconds`, reading whatever comes back; then leaves. How many it sent."""
    append = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(480)).decode()})
    sent = 0
    async with connect(f"{url}/v1/realtime?model=s2s", additional_headers=BETA, max_size=None) as ws:

        async def drain() -> None:
            with contextlib.suppress(ConnectionClosed):
                async for _ in ws:
                    pass

        reader = asyncio.create_task(drain())
        start = time.monotonic()
        while (now := time.monotonic()) < start + seconds and not reader.done():
            if sent % 2:
                await ws.send(append)
            else:
                vad = {"type": "server_vad", "threshold": 0.5 if sent % 4 else 0.6}
                await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": vad}}))
            sent += 1
            await asyncio.sleep(max(0.0, start + sent / rate - now))
        reader.cancel()
    return sent


async def backlog(url: str, messages: int = 2000) -> dict[str, object]:
    """A Realtime client that sends `messages` 480-byte appends as fast as it can (for at most 5 s: the server stops
    reading past its message limit) and drops its socket: how long its conversation outlives the socket."""
    append = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(480)).decode()})
    ws = await connect(f"{url}/v1/realtime?model=s2s", additional_headers=BETA, max_size=None)
    await ws.recv()  # session.created: the conversation is open
    sent = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5.0):
            for _ in range(messages):
                await ws.send(append)
                sent += 1
    ws.transport.abort()
    left = time.monotonic()
    while scrape(url)["s2s_conversations"] and time.monotonic() < left + 60:
        await asyncio.sleep(0.05)
    return {
        "backlog: appends sent before the socket dropped": sent,
        "backlog: its conversation ends, s after the socket": time.monotonic() - left,
    }


async def vad_flood(url: str, pid: int, seconds: float = 8.0, rate: float = 100.0) -> dict[str, object]:
    """A healthy duplex client (pcm16, `seconds` of speech in real time) beside `vad_flipper`: the audio it got back,
    its longest gap, the server's deadline misses and CPU meanwhile, and how long /healthz answered 503 after."""
    misses, cpu = scrape(url)["s2s_deadline_misses_total"], cpu_seconds(pid)
    arrivals: list[tuple[float, int]] = []
    victim = asyncio.create_task(
        talk(url, utterances(seconds, 1)[0], mode="duplex", codec="pcm16", listen_s=1.0, on_audio=arrivals.append)
    )
    await asyncio.sleep(0.5)  # the victim's conversation is live
    sent = await vad_flipper(url, seconds, rate)
    left = time.monotonic()
    while not healthy(url) and time.monotonic() < left + 60:
        await asyncio.sleep(0.1)
    unhealthy_s = time.monotonic() - left
    result = await victim
    back = sum(n for _, n in arrivals) / SAMPLE_RATE
    gaps = np.diff([t for t, _ in arrivals]) if len(arrivals) > 1 else np.zeros(1)
    return {
        f"VAD flood: healthy duplex client's audio back (s of {seconds:.0f})": back,
        "VAD flood: its longest audio gap (s)": float(gaps.max()),
        "VAD flood: deadline misses": int(scrape(url)["s2s_deadline_misses_total"] - misses),
        "VAD flood: server CPU (s)": cpu_seconds(pid) - cpu,
        f"VAD flood: messages the flipper sent in {seconds:.0f} s": sent,
        "VAD flood: /healthz not 200 after the flipper left (s)": unhealthy_s,
        "VAD flood: the healthy client was told": "; ".join(result.errors) or "nothing",
    }
