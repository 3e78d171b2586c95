"""What the server's front end costs per stream: the CPU time of its event loop (websockets, Ogg/Opus both ways,
the engine calls) per second of duplex conversation, the figure a front-end process is sized by.

    s2s bench frontend [--quick] [--levels 1,2,4] [--seconds 8] [--client-procs 2] [--json PATH] [--plot PATH]

`s2s serve` (the shipped codec and echo model, one torch thread, 4-frame ticks) runs in a child process; for each
level N, N clients in `--client-procs` processes of their own stream espeak-ng speech in real time as Ogg/Opus in
duplex (`bench/concurrency_bench.py`'s clients) and read the reply. The server's threads' CPU times are read from
/proc before and after: its main thread runs the event loop, so its time is the front end's (duplex runs no VAD);
the rest (the engine thread, torch's workers) is the engine's. Per level: CPU seconds per stream-second of each, and
the streams one core of front-end time carries (1 / the first).
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.common import environment, parser, print_table, save_outputs, write_json
from bench.concurrency_bench import client_pool, dealt, utterances
from codec.tokenizer import SAMPLE_RATE
from server.process import ServerProcess

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[int, float]:
    """Each thread's user + system CPU seconds so far."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime
    return out


async def measure(url: str, pid: int, pcms: list, pool: ProcessPoolExecutor, workers: int) -> dict:
    """One level: its clients 0.1 s apart, the server's CPU time over it by thread."""
    before = thread_cpu_s(pid)
    start = time.monotonic()
    starts = [start + 0.1 * i for i in range(len(pcms))]
    done = await dealt(pool, workers, url, "duplex", pcms, starts, "opus")
    wall = time.monotonic() - start
    after = thread_cpu_s(pid)
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    front = spent.get(pid, 0.0)
    served = [d for d in done if d["refusal"] is None]
    stream_s = sum(len(p) for p, d in zip(pcms, done, strict=True) if d["refusal"] is None) / SAMPLE_RATE
    return {
        "streams": len(pcms),
        "served": len(served),
        "stream_seconds": stream_s,
        "wall_s": wall,
        "frontend_cpu_s_per_stream_s": front / stream_s if stream_s else float("nan"),
        "engine_cpu_s_per_stream_s": (sum(spent.values()) - front) / stream_s if stream_s else float("nan"),
        "streams_per_frontend_core": stream_s / front if front else float("nan"),
        "reply_audio_s": sum(d["audio_s"] for d in served),
    }


def main() -> None:
    p = parser("frontend", __doc__.splitlines()[0])
    p.add_argument("--levels", default="1,2,4", help="streams at once")
    p.add_argument("--seconds", type=float, default=8.0, help="speech per stream")
    p.add_argument("--client-procs", type=int, default=2, help="processes for the clients")
    args = p.parse_args()
    levels = [1, 2] if args.quick else [int(x) for x in args.levels.split(",")]
    seconds = 4.0 if args.quick else args.seconds
    pcm = utterances(seconds, max(levels))
    serve_args = ["--threads", "1", "--frames-per-tick", "4", "--max-conversations-per-client", "0"]
    pool = client_pool(args.client_procs)
    rows, env = [], environment()
    server = ServerProcess(*serve_args)
    with server as url, pool:
        for n in levels:
            row = asyncio.run(measure(url, server.proc.pid, pcm[:n], pool, args.client_procs))
            rows.append({"bench": "frontend", "codec": "opus", "mode": "duplex", "server_threads": 1, **row, **env})
            print(rows[-1], flush=True)
            write_json(args.json, rows)
    columns = [
        ("streams", "N"),
        ("served", "served"),
        ("stream_seconds", "stream s"),
        ("frontend_cpu_s_per_stream_s", "front-end CPU s per stream s"),
        ("engine_cpu_s_per_stream_s", "engine CPU s per stream s"),
        ("streams_per_frontend_core", "streams per front-end core"),
    ]
    tables = print_table("The server's front end (its event loop) per duplex Ogg/Opus stream", rows, columns)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["streams"] for r in rows], [r["streams_per_frontend_core"] for r in rows], "o-")
    ax.axhline(60, ls="--", c="gray", label="issue 22's target: 60")
    ax.set_xlabel("streams at once")
    ax.set_ylabel("streams per core of front-end CPU time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot)
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
