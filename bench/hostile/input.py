"""Hostile input (issue 25): out-of-range settings, a foreign origin, the `Server` header, one huge message beside a
duplex stream, Opus garbage, slots taken by bad seeds, and the cascade's token."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.error
import urllib.request
from collections import Counter

import numpy as np
import sphn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from bench.common import scrape
from bench.concurrency_bench import rss_bytes, utterances
from bench.hostile.clients import Listener, attempt, settle, yes_no
from codec.pcm import SAMPLE_RATE
from server.moshi import protocol
from server.moshi.client import talk
from server.moshi.protocol import BLOCK, Kind

EVIL = "http://evil.example"
BAD_SEED = f"seed={2**64}"
SETTINGS = [
    "temperature=-1",
    "temperature=nan",
    "top_p=5",
    "top_k=-5",
    "temperature=inf",
    "top_k=1000000000",
    "seed=-1",
]
MESSAGE_BYTES = 1 << 20  # the server's largest message (`ServerOptions.max_message_bytes`)
SENTINEL = b"alive!42"  # in a bad control message, quoted by the error that answers it
TOKEN = "T"


def server_header(url: str) -> str:
    try:
        with urllib.request.urlopen(url.replace("ws://", "http://") + "/healthz", timeout=10) as r:
            return r.headers.get("Server", "(none)")
    except urllib.error.HTTPError as e:  # 503 while the server would refuse a conversation: the header is there too
        return e.headers.get("Server", "(none)")


async def stall(url: str, speech: np.ndarray, big: bool) -> tuple[float, int, str]:
    """The duplex client's longest gap between audio messages (s), the server's deadline misses meanwhile, and what
    the second client was told, with (`big`) or without its 1 MiB message."""
    misses = scrape(url)["s2s_deadline_misses_total"]
    arrivals: list[tuple[float, int]] = []
    healthy = asyncio.create_task(
        talk(url, speech, mode="duplex", codec="pcm16", listen_s=0.5, on_audio=arrivals.append)
    )
    await asyncio.sleep(2.0)  # the duplex stream is live
    async with connect(f"{url}/api/chat?codec=pcm16", max_size=None) as ws:
        other = Listener(ws)
        await other.until(lambda: other.opened)
        if big:  # silence: pcm16 takes an even number of bytes
            await ws.send(protocol.audio(bytes(MESSAGE_BYTES - 2)))
        result = await healthy
        said = other.said()
    if result.errors:
        raise RuntimeError(f"the duplex client was told {result.errors}")
    gap = float(np.diff([t for t, _ in arrivals]).max())
    return gap, int(scrape(url)["s2s_deadline_misses_total"] - misses), said


async def opus_garbage(url: str, pid: int, messages: int) -> dict[str, object]:
    garbage = protocol.audio((bytes(range(256)) * (MESSAGE_BYTES // 256))[: MESSAGE_BYTES - 1])
    writer, pcm = sphn.OpusStreamWriter(SAMPLE_RATE), utterances(1.0, 1)[0]
    valid = [protocol.audio(bytes(writer.append_pcm(pcm[a : a + BLOCK]))) for a in range(0, len(pcm), BLOCK)]
    async with connect(f"{url}/api/chat?codec=opus", max_size=None) as ws:
        heard = Listener(ws)
        await heard.until(lambda: heard.opened)
        base = peak = rss_bytes(pid)
        started, sent = time.monotonic(), 0

        async def flood() -> None:
            nonlocal sent
            for _ in range(messages):
                await ws.send(garbage)
                sent += 1
            await ws.send(bytes([Kind.CONTROL]) + SENTINEL)
            await heard.until(lambda: heard.told(SENTINEL.decode()), 300)

        task = asyncio.create_task(flood())
        while not task.done():
            peak = max(peak, rss_bytes(pid))
            await asyncio.sleep(0.05)
        with contextlib.suppress(ConnectionClosed):
            task.result()
        said = f"{sent} of {messages} sent, {time.monotonic() - started:.0f} s; {heard.said()}"
        errors, audio = len(heard.errors), heard.audio
        with contextlib.suppress(ConnectionClosed):
            for message in valid:  # in real time
                await ws.send(message)
                await asyncio.sleep(BLOCK / SAMPLE_RATE)
            await heard.until(lambda: heard.audio > audio, 5.0)
        if heard.closed():
            decoded = f"no ({heard.closed()})"
        elif heard.audio > audio:
            decoded = f"yes ({heard.audio - audio} reply audio messages)"
        else:
            decoded = f"no ({(heard.errors[errors:] or ['no reply audio'])[0]!r})"
    return {
        f"Opus garbage: peak RSS growth, {messages} x 1 MiB (MB)": (peak - base) / 1e6,
        "Opus garbage: what it got": said,
        "Opus garbage: valid Opus after it decodes": decoded,
        "Opus garbage: its conversation ends, s after the socket": await settle(url, 300.0),
    }


async def slots(url: str, connections: int) -> dict[str, object]:
    got = Counter([await attempt(url, f"mode=turn&codec=pcm16&{BAD_SEED}") for _ in range(connections)])
    await settle(url, 5.0)
    return {
        f"slots: {connections} connections with {BAD_SEED} got": "; ".join(f"{n} x {o}" for o, n in got.items()),
        "slots: s2s_conversations after them": scrape(url)["s2s_conversations"],
        "slots: a good client opens after them": yes_no(await attempt(url, "mode=turn&codec=pcm16")),
    }


async def inputs(url: str, pid: int, quick: bool) -> dict[str, object]:
    """Every input finding on the speech server, in an order where none is measured on a server an earlier one
    hurt (`slots` last: the old server never recovers from it)."""
    out: dict[str, object] = {f"setting {s}": await attempt(url, f"mode=turn&codec=pcm16&{s}") for s in SETTINGS}
    out["origin: no --allowed-origin opens for " + EVIL] = yes_no(await attempt(url, "mode=turn", EVIL))
    out["Server header"] = server_header(url)
    if not quick:
        speech = utterances(24.0, 1)[0]
        for big in (False, True):
            gap, misses, said = await stall(url, speech, big)
            which = "beside a 1 MiB pcm16 message" if big else "no big message"
            out[f"stall: longest audio gap (s), {which}"] = gap
            out[f"stall: deadline misses, {which}"] = misses
        out["stall: the 1 MiB message's client was told"] = said
    out.update(await opus_garbage(url, pid, 20 if quick else 200))
    out.update(await slots(url, 40))
    return out


async def cascade(url: str) -> dict[str, object]:
    return {
        "cascade --token: opens with no token": yes_no(await attempt(url, "mode=turn")),
        f"cascade --token: opens for {EVIL}": yes_no(await attempt(url, f"mode=turn&token={TOKEN}", EVIL)),
    }
