"""Hostile clients: each finding of issue 25 measured through a server started from a source tree.

    s2s bench hostile [--tree PATH] [--label NAME] [--quick] [--json PATH] [--plot PATH]

The servers run in child processes from `--tree` (default: this checkout; an older commit's worktree measures the
code before a fix): this venv's Python with the tree first on its path. The speech server is `s2s serve --preset
tiny`; the cascade is `python -m bench.cascade.serve` (`s2s serve --cascade` in a tree that predates it). Measured,
one row each:
- settings: what each out-of-range sampling setting got (the close code and the error message, or "opened");
- origin: whether the server, started with no `--allowed-origin`, opens a conversation for `Origin: EVIL`;
- `Server` header: its value on /healthz;
- stall: a real-time duplex client (pcm16, 24 s of espeak-ng speech) with a second connection beside it, which
  sends one pcm16 message of 1 MiB (21.8 s of audio, the most the server takes in one message) 2 s in, or nothing:
  the duplex client's longest gap between audio messages and the server's deadline misses (Δ `s2s_deadline_misses`)
  of each run, and what the big message's client was told. The stream outlasts the old throttle (20 s) that held
  the message back before handing it to the engine in one piece;
- Opus garbage: one `codec=opus` connection sends 200 messages of 1 MiB (0x01, then bytes that are not Ogg) and
  waits until the server has read them all (a bad control message after them is answered) or the connection ends:
  the server's peak RSS growth (VmRSS, polled), what the garbage got and how long it took, whether 1 s of valid Opus
  sent after it decodes (reply audio comes back, as a duplex stream answers its input), and how long the
  conversation outlives the socket;
- slots, last (the old server never recovers from it): 40 connections with `seed=2**64`, what they got, then
  `s2s_conversations` and whether a good client can still open a conversation;
- cascade (its own server, `--token T`): whether it opens a conversation with no token, and with the token from
  `Origin: EVIL`.

`--quick`: 20 Opus messages, and no stall (its two runs take 24 s each, as long as the old throttle needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import sphn
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.common import add_device_args, device_server_args, environment, parser, print_table, save_outputs, scrape
from bench.concurrency_bench import rss_bytes, utterances
from codec.pcm import SAMPLE_RATE
from server.moshi import protocol
from server.moshi.client import refusal_of, talk
from server.moshi.protocol import BLOCK, Kind
from server.process import ServerProcess

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


class Listener:
    """Reads a connection in the background: whether it opened (the metadata message), its error messages, how many
    audio messages came, and how it closed."""

    def __init__(self, ws: ClientConnection):
        self.ws, self.opened, self.errors, self.audio = ws, False, [], 0
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in self.ws:
                if message[0] == Kind.METADATA:
                    self.opened = True
                elif message[0] == Kind.ERROR:
                    self.errors.append(message[1:].decode(errors="replace"))
                elif message[0] == Kind.AUDIO:
                    self.audio += 1

    async def until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> bool:
        """Wait until `done()`, the connection ends or `timeout_s` passes; `done()` then."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not done() and not self.task.done():
                    await asyncio.sleep(0.05)
        return done()

    def told(self, text: str) -> bool:
        return any(text in e for e in self.errors)

    def closed(self) -> str | None:
        """How the connection ended ("closed CODE 'reason'"), or None while it is open."""
        return f"closed {self.ws.close_code} {self.ws.close_reason!r}" if self.task.done() else None

    def said(self) -> str:
        """What the server told this client: its first error message (and how many) and its close, if any."""
        told = f"{len(self.errors)} error(s), first {self.errors[0]!r}" if self.errors else "no error message"
        return "; ".join(filter(None, [told, self.closed()]))


async def attempt(url: str, query: str, origin: str | None = None) -> str:
    """What a request for a conversation got: "HTTP STATUS" (refused at the upgrade; with the body for a full or
    draining server, 503, or a client at its limit, 429: "refused: REASON"), "opened", or how it closed."""
    try:
        async with connect(f"{url}/api/chat?{query}", origin=origin) as ws:
            heard = Listener(ws)
            if await heard.until(lambda: heard.opened):
                return "opened" + (f"; {heard.said()}" if heard.errors else "")
            await heard.task
            return heard.said()
    except InvalidStatus as e:
        status = e.response.status_code
        return f"HTTP {status}" + (f" {refusal_of(e)!r}" if status in (429, 503) else "")


def yes_no(outcome: str) -> str:
    return f"{'yes' if outcome.startswith('opened') else 'no'} ({outcome})"


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


async def settle(url: str, timeout_s: float) -> float:
    """Seconds until `s2s_conversations` reads 0 (a connection's conversation closes a moment after its socket, or
    later if the server is not reading it), at most `timeout_s`."""
    started = time.monotonic()
    while scrape(url)["s2s_conversations"] and time.monotonic() < started + timeout_s:
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def slots(url: str, connections: int) -> dict[str, object]:
    got = Counter([await attempt(url, f"mode=turn&codec=pcm16&{BAD_SEED}") for _ in range(connections)])
    await settle(url, 5.0)
    return {
        f"slots: {connections} connections with {BAD_SEED} got": "; ".join(f"{n} x {o}" for o, n in got.items()),
        "slots: s2s_conversations after them": scrape(url)["s2s_conversations"],
        "slots: a good client opens after them": yes_no(await attempt(url, "mode=turn&codec=pcm16")),
    }


async def measure(url: str, pid: int, quick: bool) -> dict[str, object]:
    """Every finding on the speech server, in an order where none is measured on a server an earlier one hurt."""
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


def revision(tree: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    p = parser("hostile", __doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1], help="source tree to serve")
    p.add_argument("--label", default=None, help="the tree's name in the table (default: its git revision)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the servers")
    add_device_args(p)
    args = p.parse_args()
    tree = args.tree.resolve()
    commit = revision(tree)
    label = args.label or commit
    # the servers import the tree's code: it comes first on their path, and not the working directory
    os.environ.update(PYTHONPATH=str(tree), PYTHONSAFEPATH="1")
    serve_args = ["--preset", "tiny", "--threads", str(args.threads), *device_server_args(args)]
    started = time.monotonic()
    speech_server = ServerProcess(*serve_args, timeout_s=600)  # a first use builds the C++ kernel
    with speech_server as url:
        values = asyncio.run(measure(url, speech_server.proc.pid, args.quick))
    if (tree / "bench" / "cascade" / "serve.py").exists():  # before it moved under bench/: `s2s serve --cascade`
        cascade_server = ServerProcess(*serve_args, "--token", TOKEN, module="bench.cascade.serve", timeout_s=600)
    else:
        cascade_server = ServerProcess(*serve_args, "--token", TOKEN, "--cascade", timeout_s=600)
    with cascade_server as url:
        values.update(asyncio.run(cascade(url)))
    env = {"revision": commit, **environment()}
    rows = [{"bench": "hostile", "finding": k, "tree": label, "value": v, **env} for k, v in values.items()]
    title = f"Hostile clients (issue 25) against `s2s serve --preset tiny` from {tree} ({label}), "
    title += f"{time.monotonic() - started:.0f} s"
    tables = print_table(title, rows, [("finding", "finding"), ("tree", "tree"), ("value", "measured")])
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
