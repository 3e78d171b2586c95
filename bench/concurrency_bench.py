"""Concurrency benchmark: duplex and turn sweeps through the real server, clients over websockets.

    s2s bench concurrency [--quick] [--json PATH] [--plot PATH] [--model DIR | --preset NAME] [--levels 1,2,4,8,16,32]
        [--modes duplex,turn] [--client-procs P] [--ramp-s 3.2] [--max-context-s S]

`s2s serve` runs in a child process (its own GIL, as in use), one per mode, on the weights a user runs: by default the
shipped codec and echo model (what `s2s serve` serves with no flags), or `--model DIR` (a model folder), or `--preset
NAME` (seeded weights); each row's `model` says which. Ticks of 4 EnCodec frames (53 ms; on a codec of longer frames,
the frames closest to that) and one torch thread (`--threads`; on 2 cores, per-op thread overhead dominates at these
shapes and a second thread fights the clients and the event loop). For each level N, N clients (asyncio, pcm16 to keep
their own CPU low on a 2-core machine; in this process, or spread over `--client-procs` processes of their own, so that
hundreds of real-time clients do not share one event loop) connect 0.1 s apart (`--ramp-s` / N apart beyond 32) and
stream espeak-ng speech in real time (80 ms blocks, as Moshi's client does). Measured per level:
- duplex `latency_ms`: output lag, when each reply chunk's last sample arrives minus when the user spoke the sample
  at the same position (the client sends an 80 ms block once it is spoken, as a microphone does): the block, the
  engine's tick and jitter, the network;
- turn `latency_ms`: from the end of the user's speech (the client sends the end-of-turn message, no VAD wait) to the
  first reply audio at the client;
- `rtf_mean`: the server engine's busy time over wall time (above 1: it cannot keep up), from /metrics;
- `throughput_x_realtime`: reply audio received by all clients per wall second;
- deadline misses and refusals (Δ of the server's counters), peak server RSS and peak K/V pages in use (polled).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

from bench.common import (
    SENTENCES,
    add_device_args,
    add_model_args,
    device_name,
    device_server_args,
    environment,
    model_choice,
    parser,
    percentiles,
    print_table,
    save_outputs,
    scrape,
    write_json,
)
from codec.pcm import SAMPLE_RATE
from server.moshi.client import talk
from server.process import ServerProcess
from speech.sample import speech


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def utterances(seconds: float, count: int) -> list[np.ndarray]:
    """`seconds` of espeak-ng speech per client (sentences back to back, starting at a different one each),
    synthesized once before any client starts."""
    clips = [speech(text)[0] for text in SENTENCES]
    out = []
    for i in range(count):
        order = [clips[(i + k) % len(clips)] for k in range(int(seconds * SAMPLE_RATE) // min(map(len, clips)) + 1)]
        out.append(np.concatenate(order)[: int(seconds * SAMPLE_RATE)])
    return out


def _refusal(errors: list[str]) -> str | None:
    """The server's reason for refusing the conversation (it names the predicted tick time), or None: "refused:
    REASON", the body of the 503 that answers the upgrade (`talk` keeps it), or an error message after it."""
    return next((e for e in errors if "refused" in e), None)


async def duplex_client(url: str, pcm: np.ndarray, codec: str = "pcm16") -> dict:
    """One duplex conversation; the lag of each received chunk against the send clock."""
    arrivals: list[tuple[float, int]] = []
    result = await talk(url, pcm, mode="duplex", codec=codec, listen_s=0.5, on_audio=arrivals.append)
    lags, received = [], 0
    for t, n in arrivals:
        received += n  # output sample k answers the user's sample k, spoken at speech_started + k / SAMPLE_RATE
        lags.append(t - result.speech_started - received / SAMPLE_RATE)
    return {"refusal": _refusal(result.errors), "latency_s": lags, "audio_s": received / SAMPLE_RATE}


async def turn_client(url: str, pcm: np.ndarray) -> dict:
    result = await talk(url, pcm, mode="turn", codec="pcm16", listen_s=3.0)
    lat = [result.turn_latency_s] if result.turn_latency_s is not None else []
    return {
        "refusal": _refusal(result.errors),
        "latency_s": lat,
        "audio_s": len(result.reply) / SAMPLE_RATE,
    }


def clients(url: str, mode: str, pcms: list[np.ndarray], starts: list[float], codec: str = "pcm16") -> list[dict]:
    """Conversations that each start at their `time.monotonic()` in `starts` (the clock is the machine's, the same
    in every process), all in this process's event loop; turn mode speaks pcm16."""

    async def one(pcm: np.ndarray, at: float) -> dict:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        return await (duplex_client(url, pcm, codec) if mode == "duplex" else turn_client(url, pcm))

    async def all_of_them() -> list[dict]:
        return await asyncio.gather(*(one(p, t) for p, t in zip(pcms, starts, strict=True)))

    return asyncio.run(all_of_them())


def client_pool(procs: int) -> ProcessPoolExecutor:
    """`procs` client processes, spawned (a fresh interpreter each, no forked event loop) and started, so that none
    starts on a level's clock."""
    pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
    list(pool.map(time.sleep, [0.0] * procs))
    return pool


async def dealt(
    pool: ProcessPoolExecutor, workers: int, url: str, mode: str, pcms: list, starts: list[float], codec: str = "pcm16"
) -> list[dict]:
    """`clients` dealt round robin to the `workers` processes of `pool`; their results in the order of `pcms`."""
    loop = asyncio.get_running_loop()
    shares = [
        loop.run_in_executor(pool, clients, url, mode, pcms[w::workers], starts[w::workers], codec)
        for w in range(workers)
    ]
    done: list = [None] * len(pcms)
    for w, share in enumerate(await asyncio.gather(*shares)):
        done[w::workers] = share
    return done


async def run_level(
    url: str,
    pid: int,
    mode: str,
    speech_per_client: list[np.ndarray],
    pool: ProcessPoolExecutor | None,
    workers: int,
    ramp_s: float,
) -> dict:
    """One level: its clients in this process, or dealt round robin to the `workers` processes of `pool`."""
    n = len(speech_per_client)
    before = scrape(url)
    stop = asyncio.Event()
    peak = {"rss": 0, "pages": 0.0}

    async def poll() -> None:
        while not stop.is_set():
            m = await asyncio.to_thread(scrape, url)
            used = sum(v for k, v in m.items() if k.startswith("s2s_kv_pages{") and 'state="free"' not in k)
            peak["pages"] = max(peak["pages"], used)
            peak["rss"] = max(peak["rss"], rss_bytes(pid))
            await asyncio.sleep(0.5)

    poller = asyncio.create_task(poll())
    t0 = time.monotonic()
    starts = [t0 + i * min(0.1, ramp_s / n) for i in range(n)]
    if pool is None:
        done = await asyncio.to_thread(clients, url, mode, speech_per_client, starts)
    else:
        done = await dealt(pool, workers, url, mode, speech_per_client, starts)
    wall = time.monotonic() - t0
    stop.set()
    await poller
    await asyncio.sleep(1.0)  # closes reach the engine
    after = scrape(url)
    served = [d for d in done if d["refusal"] is None]
    ticks = after["s2s_ticks_total"] - before["s2s_ticks_total"]
    phases = {
        f"tick_{phase}_ms": 1000 * (after[key] - before[key]) / ticks if ticks else float("nan")
        for key in after
        if key.startswith("s2s_tick_phase_seconds_total{")
        for phase in [key.split('"')[1]]
    }
    lat = [x for d in served for x in d["latency_s"]]
    pct = percentiles(lat, 1000) if lat else {"p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    return {
        "concurrency": n,
        "served": len(served),
        "refused": len(done) - len(served),
        "latency_ms_p50": pct["p50"],
        "latency_ms_p95": pct["p95"],
        "latency_ms_p99": pct["p99"],
        "rtf_mean": (after["s2s_busy_seconds_total"] - before["s2s_busy_seconds_total"]) / wall,
        "throughput_x_realtime": sum(d["audio_s"] for d in served) / wall,
        "deadline_misses": int(after["s2s_deadline_misses_total"] - before["s2s_deadline_misses_total"]),
        "peak_mem_bytes": peak["rss"],
        "peak_kv_pages": int(peak["pages"]),
        "leaked_private_pages": int(after['s2s_kv_pages{state="private"}']),
        "tick_ms_mean": 1000 * (after["s2s_busy_seconds_total"] - before["s2s_busy_seconds_total"]) / ticks
        if ticks
        else float("nan"),
        **phases,
        "first_refusal": next((d["refusal"] for d in done if d["refusal"] is not None), None),
    }


def main() -> None:
    p = parser("concurrency", __doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--levels", default="1,2,4,8,16,32", help="numbers of concurrent conversations")
    p.add_argument("--seconds", type=float, default=8.0, help="speech per client")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (0: the server's default)")
    p.add_argument("--modes", default="duplex,turn", help="which sweeps: duplex, turn or both")
    p.add_argument("--client-procs", type=int, default=0, help="processes for the clients (0: in this process)")
    p.add_argument(
        "--frontends", type=int, default=None, help="the server's front-end processes (default: the server's own)"
    )
    p.add_argument("--ramp-s", type=float, default=3.2, help="clients start 0.1 s apart, or over this many seconds")
    p.add_argument(
        "--max-context-s", type=float, default=None, help="the server's attention window (default: the server's own)"
    )
    add_device_args(p)
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    modes = args.modes.split(",")
    if not set(modes) <= {"duplex", "turn"} or args.client_procs < 0:
        raise SystemExit(f"--modes takes duplex and turn, --client-procs 0 or more: {args.modes}, {args.client_procs}")
    if args.quick:
        levels, args.seconds = [1, 2, 4], 3.0
    choice = model_choice(args)  # (its frames: the served codec's, which the ticks, replies and pages are sized in)
    frames_per_tick = choice.frames(4)
    serve_args = [*choice.serve_args(), "--frames-per-tick", str(frames_per_tick)]
    serve_args += ["--max-reply-frames", str(choice.frames(225))]  # 3 s
    serve_args += ["--threads", str(args.threads), *device_server_args(args)]
    serve_args += ["--max-conversations-per-client", "0"]  # every client connects from this host
    if args.frontends is not None:
        serve_args += ["--frontends", str(args.frontends)]
    if args.max_context_s is not None:  # (admission charges every stream a full window's attention)
        serve_args += ["--max-context-s", str(args.max_context_s)]
    pages = max(levels) * (math.ceil((args.seconds + 1) / choice.frame_s / 16) + 2)  # each one's speech, and its reply
    serve_args += ["--max-conversations", str(max(32, max(levels))), "--kv-pages", str(max(4096, pages))]
    device = device_name(args.device)
    pcm = utterances(args.seconds, max(levels))
    rows = []
    pool = client_pool(args.client_procs) if args.client_procs else None  # once, before any server
    bar = tqdm(total=len(modes) * len(levels), desc="concurrency")
    for mode in modes:
        server = ServerProcess(*serve_args)
        with server as url:
            for n in levels:
                row = asyncio.run(run_level(url, server.proc.pid, mode, pcm[:n], pool, args.client_procs, args.ramp_s))
                rows.append(
                    {
                        "bench": "concurrency",
                        "workload": f"{mode} speech {args.seconds:g} s per client",
                        "mode": mode,
                        "model": choice.label,
                        "preset": choice.preset,
                        "frames_per_tick": frames_per_tick,
                        "frame_ms": 1000 * choice.frame_s,
                        "server_threads": args.threads,
                        "server_device": device,
                        "cuda_graphs": not args.enforce_eager,
                        "client_codec": "pcm16",
                        "client_procs": args.client_procs,
                        "frontends": args.frontends,
                        "seconds_per_client": args.seconds,
                        "max_context_s": args.max_context_s,
                        **row,
                        **environment(),
                    }
                )
                write_json(args.json, rows)  # each level as it finishes: a run cut short keeps what it measured
                bar.update()
    bar.close()
    if pool is not None:
        pool.shutdown()
    columns = [
        ("mode", "mode"),
        ("concurrency", "N"),
        ("served", "served"),
        ("refused", "refused"),
        ("latency_ms_p50", "latency p50 ms"),
        ("latency_ms_p95", "p95 ms"),
        ("rtf_mean", "engine RTF"),
        ("throughput_x_realtime", "throughput x rt"),
        ("deadline_misses", "misses"),
        ("tick_ms_mean", "tick ms"),
        ("tick_model_ms", "model ms"),
        ("tick_encode_ms", "encode ms"),
        ("tick_decode_ms", "decode ms"),
        ("peak_kv_pages", "peak K/V pages"),
        ("peak_mem_bytes", "peak RSS B"),
    ]
    tables = print_table(
        f"Concurrency through `s2s serve` ({choice.label}, {frames_per_tick}-frame ticks, {device}): "
        "duplex latency = output lag, "
        "turn latency = end of speech to first reply audio",
        rows,
        columns,
    )
    plot(rows, args.plot, device)
    save_outputs(args, rows, tables)


def plot(rows: list[dict], path, device: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode in ("duplex", "turn"):
        rs = [r for r in rows if r["mode"] == mode]
        n = [r["concurrency"] for r in rs]
        axes[0].plot(n, [r["latency_ms_p50"] for r in rs], "o-", label=f"{mode} p50")
        axes[0].plot(n, [r["latency_ms_p95"] for r in rs], "x--", label=f"{mode} p95")
        axes[1].plot(n, [r["throughput_x_realtime"] for r in rs], "o-", label=mode)
        axes[2].plot(n, [r["served"] for r in rs], "o-", label=f"{mode} served")
        axes[2].plot(n, [r["deadline_misses"] for r in rs], "x--", label=f"{mode} misses")
    titles = ["latency (ms)", "reply audio, x real time", "conversations served / deadline misses"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent conversations")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"Concurrency through the server, {rows[0]['model']}, {device}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
