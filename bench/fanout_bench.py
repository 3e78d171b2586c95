"""The event fan-out per tick: what handing a tick's audio to N conversations' connections costs the engine thread
(the puts, and waking the event loop) and the event loop (waking each conversation's sender).

    s2s bench fanout [--quick] [--conversations 16,64,256,512] [--ticks 200] [--json PATH] [--plot PATH]

No model and no sockets: the server's own bridge (`server.session.events`, one reader per conversation on an asyncio
loop in the main thread) and a thread that puts one `AudioEvent` (a 4-frame tick's PCM) into each conversation's
`EventQueue` per tick, as the engine's fan-out does, then sleeps 10 ms. Each side's CPU time is its thread's.
"""

from __future__ import annotations

import asyncio
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from bench.common import environment, parser, print_table, save_outputs, write_json
from codec import EncodecTokenizer
from s2s.engine.events import AudioEvent, EventQueue
from server.engine_session import events

FRAME_SIZE = EncodecTokenizer.frame_size  # the events are the shipped codec's
TICK_PCM = np.zeros(4 * FRAME_SIZE, np.float32)


def measure(n: int, ticks: int) -> dict:
    queues = [EventQueue(FRAME_SIZE) for _ in range(n)]
    engine_cpu_s = 0.0

    def engine() -> None:
        nonlocal engine_cpu_s
        start = time.thread_time()
        for t in range(ticks):
            for i, q in enumerate(queues):
                q.put(AudioEvent(str(i), 0, 4 * t, TICK_PCM), 4)  # (as the engine puts them)
            time.sleep(0.01)
        engine_cpu_s = time.thread_time() - start
        for q in queues:
            q.put(None)

    async def read(q: EventQueue) -> int:
        return sum([1 async for _ in events(q, conn=None)])

    async def run() -> tuple[float, int]:
        readers = [asyncio.create_task(read(q)) for q in queues]
        await asyncio.sleep(0)
        start = time.thread_time()
        await asyncio.to_thread(engine)
        delivered = sum(await asyncio.gather(*readers))
        return time.thread_time() - start, delivered

    loop_cpu_s, delivered = asyncio.run(run())
    if delivered != n * ticks:
        raise AssertionError(f"{delivered} of {n * ticks} events delivered")
    return {
        "conversations": n,
        "ticks": ticks,
        "engine_ms_per_tick": engine_cpu_s / ticks * 1000,
        "loop_ms_per_tick": loop_cpu_s / ticks * 1000,
        "engine_us_per_event": engine_cpu_s / (n * ticks) * 1e6,
        "loop_us_per_event": loop_cpu_s / (n * ticks) * 1e6,
    }


def main() -> None:
    p = parser("fanout", __doc__.splitlines()[0])
    p.add_argument("--conversations", default="16,64,256,512", help="conversations (readers) at each level")
    p.add_argument("--ticks", type=int, default=200, help="ticks measured at each level")
    args = p.parse_args()
    levels = [16, 64] if args.quick else [int(x) for x in args.conversations.split(",")]
    ticks = 50 if args.quick else args.ticks
    rows, env = [], environment()
    for n in levels:
        rows.append({"bench": "fanout", **measure(n, ticks), **env})
        print(rows[-1], flush=True)
        write_json(args.json, rows)
    columns = [
        ("conversations", "N"),
        ("engine_ms_per_tick", "engine thread ms a tick"),
        ("loop_ms_per_tick", "event loop ms a tick"),
        ("engine_us_per_event", "engine µs an event"),
        ("loop_us_per_event", "loop µs an event"),
    ]
    tables = print_table("A tick's events handed to N conversations' senders (CPU time)", rows, columns)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("engine_ms_per_tick", "engine thread"), ("loop_ms_per_tick", "event loop")):
        ax.plot([r["conversations"] for r in rows], [r[key] for r in rows], "o-", label=label)
    ax.set_xlabel("conversations")
    ax.set_ylabel("CPU ms per tick")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot)
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
