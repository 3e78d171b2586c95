"""What the server's front end costs per stream: the CPU time of the websockets, Ogg/Opus both ways and the engine
calls per second of duplex conversation, the figure a front-end process is sized by.

    s2s bench frontend [--quick] [--levels 1,2,4] [--frontends 0,1] [--seconds 8] [--client-procs 2]
        [--model DIR | --preset NAME] [--json PATH] [--plot PATH]

`s2s serve` (by default the shipped codec and echo model, what `s2s serve` serves with no flags; or `--model DIR`; or
`--preset NAME`, a seeded model over the shipped codec, admitting by count only; one torch thread, 4-frame ticks) runs
in a child process, once with each `--frontends` count, side by side; for each level N, N clients in `--client-procs`
processes of their own stream espeak-ng speech in real time as Ogg/Opus in duplex (`bench/concurrency_bench.py`'s
clients) and read the reply. CPU times are read from /proc before and after. With front-end processes, theirs (every
thread) is the front end's and the server process's is the engine's. In one process (`--frontends 0`), its main thread
runs the event loop, so that thread's time is the front end's (duplex runs no VAD) and the rest (the engine thread,
torch's workers) the engine's. Per level: CPU seconds per stream-second of each, and the streams one core of front-end
time carries (1 / the first), over the whole level (connections opened and closed, the half second each listens after
its speech) and in its steady state: from a second after the last client started to half a second before the first
one's speech ends, when all N stream both ways (what a front end costs per conversation that lasts minutes). `tail_s`:
how long the level ran past the last client's speech, under 1.5 s when the engine keeps up (the echo's delay, then the
client listens); more when its replies fall behind the speech, and then less reply audio flows in the steady window
than in real time, so the steady figure overstates what a front end carries. Each server's start (to its "serving"
line) and resident sizes before its first stream (the engine's process, and the largest front end's) go in its rows.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.common import add_model_args, environment, model_choice, parser, print_table, save_outputs, write_json
from bench.concurrency_bench import client_pool, dealt, rss_bytes, utterances
from codec.pcm import SAMPLE_RATE
from s2s.models.shipped import shipped
from server.process import ServerProcess

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
STEADY_AFTER_S = 1.0  # the steady state starts this long after the last client started
STEADY_BEFORE_END_S = 0.5  # and ends this long before the first one's speech ends


def thread_cpu_s(pid: int) -> dict[int, float]:
    """Each thread's user + system CPU seconds so far."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = _cpu_s(task / "stat")
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return out


def _cpu_s(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime


def frontend_pids(pid: int) -> list[int]:
    """The front-end processes `s2s serve --frontends` spawned (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def cpu_split(pid: int, frontends: list[int]) -> tuple[float, float]:
    """CPU seconds so far: the front end's and the engine's."""
    if frontends:
        return sum(_cpu_s(Path(f"/proc/{f}/stat")) for f in frontends), _cpu_s(Path(f"/proc/{pid}/stat"))
    threads = thread_cpu_s(pid)
    return threads[pid], sum(threads.values()) - threads[pid]


async def measure(url: str, pid: int, pcms: list, pool: ProcessPoolExecutor, workers: int) -> dict:
    """One level: its clients 0.1 s apart, the server's CPU time over it and in its steady state, the front end's and
    the engine's."""
    frontends = frontend_pids(pid)
    front_before, engine_before = cpu_split(pid, frontends)
    start = time.monotonic()
    starts = [start + 0.1 * i for i in range(len(pcms))]
    steady = (starts[-1] + STEADY_AFTER_S, start + min(len(p) for p in pcms) / SAMPLE_RATE - STEADY_BEFORE_END_S)
    if steady[1] - steady[0] < 1:
        raise ValueError("speech too short for a steady state of a second: raise --seconds")
    clients = asyncio.ensure_future(dealt(pool, workers, url, "duplex", pcms, starts, "opus"))
    steady_cpu = await _cpu_between(pid, frontends, *steady)
    done = await clients
    wall = time.monotonic() - start
    front_after, engine_after = cpu_split(pid, frontends)
    front, engine = front_after - front_before, engine_after - engine_before
    served = [d for d in done if d["refusal"] is None]
    steady_front = steady_cpu / (len(served) * (steady[1] - steady[0])) if served else float("nan")
    stream_s = sum(len(p) for p, d in zip(pcms, done, strict=True) if d["refusal"] is None) / SAMPLE_RATE
    return {
        "frontends": len(frontends),
        "streams": len(pcms),
        "served": len(served),
        "stream_seconds": stream_s,
        "wall_s": wall,
        "tail_s": wall - (starts[-1] - start) - max(len(p) for p in pcms) / SAMPLE_RATE,
        "frontend_cpu_s_per_stream_s": front / stream_s if stream_s else float("nan"),
        "engine_cpu_s_per_stream_s": engine / stream_s if stream_s else float("nan"),
        "streams_per_frontend_core": stream_s / front if front else float("nan"),
        "steady_s": steady[1] - steady[0],
        "steady_frontend_cpu_s_per_stream_s": steady_front,
        "steady_streams_per_frontend_core": 1 / steady_front if steady_front else float("nan"),
        "reply_audio_s": sum(d["audio_s"] for d in served),
    }


async def _cpu_between(pid: int, frontends: list[int], a: float, b: float) -> float:
    """The front end's CPU seconds between monotonic times `a` and `b`."""
    await asyncio.sleep(a - time.monotonic())
    before = cpu_split(pid, frontends)[0]
    await asyncio.sleep(b - time.monotonic())
    return cpu_split(pid, frontends)[0] - before


def main() -> None:
    p = parser("frontend", __doc__.splitlines()[0])
    p.add_argument("--levels", default="1,2,4", help="streams at once")
    p.add_argument("--frontends", default="0,1", help="front-end process counts, each a server of its own")
    p.add_argument("--seconds", type=float, default=8.0, help="speech per stream")
    p.add_argument("--client-procs", type=int, default=2, help="processes for the clients")
    add_model_args(p, preset_codec="the shipped codec: a cheaper engine keeps up with more streams")
    args = p.parse_args()
    choice = model_choice(args)
    levels = [1, 2] if args.quick else [int(x) for x in args.levels.split(",")]
    seconds = 4.0 if args.quick else args.seconds
    pcm = utterances(seconds, max(levels))
    serve_args = [*choice.serve_args(), "--threads", "1", "--frames-per-tick", str(choice.frames(4))]
    serve_args += ["--max-conversations-per-client", "0"]
    if choice.preset is not None:  # the shipped codec still, and admission by count only
        serve_args += ["--codec", str(shipped("codec")), "--admission-headroom", "inf"]
    label = f"{choice.label}, shipped codec" if choice.preset is not None else choice.label
    pool = client_pool(args.client_procs)
    rows, env = [], {"model": label, "preset": choice.preset, **environment()}
    with pool:
        for frontends in [int(x) for x in args.frontends.split(",")]:
            server, started = ServerProcess(*serve_args, "--frontends", str(frontends)), time.monotonic()
            with server as url:
                idle = {  # before any stream: the server's own start and size
                    "start_s": time.monotonic() - started,
                    "server_rss_mb": rss_bytes(server.proc.pid) / 2**20,
                    "frontend_rss_mb": max(map(rss_bytes, frontend_pids(server.proc.pid)), default=math.nan) / 2**20,
                }
                for n in levels:
                    row = asyncio.run(measure(url, server.proc.pid, pcm[:n], pool, args.client_procs))
                    rows.append({"bench": "frontend", "codec": "opus", "mode": "duplex", **row, **idle, **env})
                    print(rows[-1], flush=True)
                    write_json(args.json, rows)
    columns = [
        ("frontends", "front-end processes"),
        ("streams", "N"),
        ("served", "served"),
        ("stream_seconds", "stream s"),
        ("frontend_cpu_s_per_stream_s", "front-end CPU s per stream s"),
        ("engine_cpu_s_per_stream_s", "engine CPU s per stream s"),
        ("streams_per_frontend_core", "streams per front-end core"),
        ("steady_frontend_cpu_s_per_stream_s", "steady: front-end CPU s per stream s"),
        ("steady_streams_per_frontend_core", "steady: streams per front-end core"),
        ("tail_s", "tail s"),
        ("start_s", "server start s"),
        ("server_rss_mb", "server RSS MB"),
        ("frontend_rss_mb", "front-end RSS MB"),
        ("reply_audio_s", "reply audio s"),
    ]
    tables = print_table(f"The server's front end per duplex Ogg/Opus stream ({label})", rows, columns)
    fig, ax = plt.subplots(figsize=(6, 4))
    for count in sorted({r["frontends"] for r in rows}):
        mine = [r for r in rows if r["frontends"] == count]
        label = f"{count} front-end processes" if count else "one process (its event loop)"
        line = ax.plot([r["streams"] for r in mine], [r["streams_per_frontend_core"] for r in mine], "o-", label=label)
        steady = [r["steady_streams_per_frontend_core"] for r in mine]
        ax.plot([r["streams"] for r in mine], steady, "s--", c=line[0].get_color(), label=f"{label}, steady")
    ax.axhline(60, ls="--", c="gray", label="issue 22's target: 60")
    ax.set_xlabel("streams at once")
    ax.set_ylabel("streams per core of front-end CPU time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot)
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
