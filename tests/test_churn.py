"""Issue 45: a server's memory depends on the conversations that are live, not on how many have been. Moshi-protocol
conversations open and close against `s2s serve --preset tiny` in a child process, and its RSS stays flat after a
warm-up (it grew with every closed conversation while the engine kept each one's context for a resume nobody asks
for)."""

from __future__ import annotations

import asyncio
import itertools
import statistics

import numpy as np
from tests_support import wait_until
from websockets.asyncio.client import connect

from bench.concurrency_bench import rss_bytes
from codec.pcm import SAMPLE_RATE, to_pcm16
from server.moshi.protocol import Kind, audio
from server.process import ServerProcess
from server.scrape import scrape

# 12 kbps: 16 codebooks a frame, so that what a conversation's frames take is well over the allocator's noise
SERVE = ["--preset", "tiny", "--bandwidth", "12", "--threads", "1", "--admission-headroom", "inf"]
SERVE += ["--max-conversations-per-client", "0"]  # (a client's closes reach the server a moment after it goes on)
SEGMENTS, CYCLES = 4, 50  # measured: RSS read after each segment of CYCLES conversations
AT_ONCE = 2
BOUND = 30_000  # bytes a conversation, the median segment's: 3-6 KB; 148 KB while each closed one kept its context


def noise(seconds: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return audio(to_pcm16(np.clip(0.3 * rng.standard_normal(int(seconds * SAMPLE_RATE)), -1, 1)))


async def converse(url: str, message: bytes, reply_s: float = 0.0) -> None:
    """One duplex conversation: `message` of audio in, then until the first reply audio (the engine has the audio),
    or `reply_s` of it, then close."""
    async with connect(f"{url}/api/chat?mode=duplex&codec=pcm16", max_size=None) as ws:
        assert (await ws.recv())[0] == Kind.HANDSHAKE
        await ws.send(message)
        heard = 0
        async for m in ws:
            if m[0] == Kind.AUDIO and (heard := heard + (len(m) - 1) // 2) >= reply_s * SAMPLE_RATE:
                return


async def cycles(url: str, count: int, long_s: float = 0.0) -> None:
    """`count` short conversations, `AT_ONCE` at a time; beside them, one of `long_s` (paced in real time)."""
    short, slots = noise(0.25, 0), asyncio.Semaphore(AT_ONCE)

    async def one() -> None:
        async with slots:
            await converse(url, short)

    long = [converse(url, noise(long_s, 1), long_s - 0.5)] if long_s else []
    await asyncio.gather(*(one() for _ in range(count)), *long)


def test_closed_conversations_leave_the_servers_memory_flat(monkeypatch) -> None:
    """After a warm-up, whose one long conversation widens the engine's frame rows (as any long conversation does,
    for good), each segment of short conversations leaves the server's RSS where it was. glibc's malloc serves a
    small block from space freed earlier (a tick's peak) and would hide a leak for hundreds of conversations: from
    64 KiB up, blocks are mapped on their own, so what a closed conversation keeps shows at once."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    server = ServerProcess(*SERVE)
    with server as url:

        def settled() -> int:
            """The RSS once every conversation is closed in the engine too."""
            wait_until(lambda: scrape(url)["s2s_conversations"] == 0, 30, "a conversation still open")
            return rss_bytes(server.proc.pid)

        asyncio.run(cycles(url, 60, long_s=6.0))
        rss = [settled()]
        for _ in range(SEGMENTS):
            asyncio.run(cycles(url, CYCLES))
            rss.append(settled())
    growth = statistics.median(b - a for a, b in itertools.pairwise(rss)) / CYCLES
    assert growth < BOUND, f"{growth / 1e3:.1f} KB a conversation (RSS after each segment: {rss})"
