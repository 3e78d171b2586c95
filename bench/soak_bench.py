"""Soak: mixed conversations through `s2s serve` at 80 % of the capacity admission reports, for minutes on end.

    s2s bench soak [--minutes 30] [--load 0.8] [--quick] [--model DIR | --preset NAME] [--json PATH] [--plot PATH]
        [--device cuda]

`s2s serve` runs in a child process on the weights a user runs: by default the shipped codec and echo model
(what `s2s serve` serves with no flags), or `--model DIR`, or `--preset NAME` (seeded weights); 4-frame ticks,
replies of at most 3 s, two shared voice prompts from espeak-ng in a `--prompts` folder. A probe opens conversations
whose microphones stream silence (admission charges a conversation as a real-time stream while its audio comes in or
it replies), one at a time, until admission refuses one (503 before the upgrade), and closes them: that count is the
capacity admission reports (probed again at the end: the cost model learns as it serves).
`--load` of it are kept live in waves (`--wave-minutes`): a client that leaves is replaced at once, and at a
wave's end every client leaves and the pages are checked. The clients (asyncio, in this process, pcm16) follow
seeded plans (`bench/soak/plans.py`): duplex or turn mode, a shared voice or none, 2-4 turns of espeak-ng speech
with a microphone that streams silence between them, barge-ins over a reply, one silence (turn mode: the microphone
muted, under the server's idle timeout; duplex: streamed silence, or muted with `--duplex-mute`), and a close frame
or an aborted TCP connection at the end, some while a reply plays. Beside them, `--churn-per-s` connections a
second open a conversation and close it at once (`bench/soak/churn.py`), as many come and go on a public server.

Every `--sample-s` seconds a row: the server's RSS (VmRSS), K/V pages by state, conversations, tick time (mean and
p95 over the interval, from the busy and tick counters and /metrics' tick time histogram), deadline misses,
first-audio latency of turns (client side: end of the user's speech to the first reply audio; and the server's own
stamps), refusals and errors the clients saw. The targets (issue 20): RSS
growth after warm-up under 5 % (idle RSS between waves), pages back to baseline between waves (free +
cached_evictable == every usable page), no deadline miss, p95 first audio in the last 5 minutes within 10 % of
the first 5, no leaked page once all clients left (and the engine's idle page check passed), and no line naming an
error in the server's output.

`--quick`: 24 s in two waves, shorter plans and speech, no second probe.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench.common import (
    SENTENCES,
    add_device_args,
    add_model_args,
    device_name,
    device_server_args,
    environment,
    model_choice,
    parser,
    print_table,
    save_outputs,
    scrape,
    write_json,
)
from bench.concurrency_bench import rss_bytes
from bench.soak.churn import churn
from bench.soak.client import Events
from bench.soak.load import Load, at_baseline, pages, probe, settle
from bench.soak.plans import QUICK_MIX, Mix
from bench.soak.report import WAVE_COLUMNS, log_errors, plot, targets, wave_rows
from bench.soak.sampler import Sampler
from codec.pcm import SAMPLE_RATE, save_wav
from server.process import ServerProcess
from speech.sample import have_espeak, speech, synthesize

VOICES = {"alice": ("en-us", "Hi, I am Alice. How can I help you today?"), "bob": ("en-gb", "Hello, this is Bob.")}
PER_CLIENT_OPTION = "--max-conversations-per-client"  # being added to the server: all clients come from 127.0.0.1


def trimmed(pcm: np.ndarray, max_s: float, threshold: float = 0.01) -> np.ndarray:
    """The speech without its leading and trailing silence (so its end is the end of speech), at most `max_s`."""
    loud = np.flatnonzero(np.abs(pcm) > threshold)
    pcm = pcm[loud[0] : loud[-1] + 1] if len(loud) else pcm
    return pcm[: int(max_s * SAMPLE_RATE)]


def write_voices(folder: Path, max_s: float = 2.0) -> list[str]:
    """The shared voice prompts, as audio files in `folder` (`s2s serve --prompts`); their names."""
    for name, (voice, text) in VOICES.items():
        pcm = synthesize(text, voice=voice) if have_espeak() else speech()[0]
        save_wav(folder / f"{name}.wav", trimmed(pcm, max_s))
    return list(VOICES)


def server_has(option: str) -> bool:
    help_text = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--help"], capture_output=True, text=True
    ).stdout
    return option in help_text


def progress(row: dict) -> None:
    print(
        f"{row['t_s']:7.1f} s  live {row['clients_live']:3d}  conv {row['conversations']:3d}  "
        f"RSS {row['rss_mb']:7.1f} MB  pages free {row['pages_free']} evictable {row['pages_cached_evictable']} "
        f"locked {row['pages_cached_locked']} private {row['pages_private']}  tick {row['tick_ms_mean']:5.1f} ms  "
        f"misses {row['deadline_misses']}  turns {row['turns']} p95 {row['first_audio_ms_p95']:.0f} ms  "
        f"refused {row['refused']} errors {row['error'] + row['dropped'] + row['failed'] + row['client_bug']}  "
        f"churn {row['churned'] / row['interval_s']:.0f}/s ({row['churn_refused']} refused, "
        f"{row['churn_failed']} failed)",
        flush=True,
    )


async def soak(url: str, pid: int, args, clips: list[np.ndarray], mix: Mix, on_row) -> dict:
    m = await asyncio.to_thread(scrape, url)
    usable = sum(pages(m).values())
    capacity, reason = await probe(url)
    await settle(url, usable, 15.0)
    target = max(1, int(args.load * capacity))
    print(f"capacity admission reports: {capacity} ({reason}); keeping {target} live", flush=True)
    events, t0 = Events(), time.monotonic()
    start = await asyncio.to_thread(scrape, url)
    load = Load(url, clips, mix, args.seed, events, reply_timeout_s=15.0)
    sampler = Sampler(url, pid, events, lambda: len(load.live), t0, args.sample_s)
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop, on_row))
    run_s = args.minutes * 60
    n_waves = max(1, round(args.minutes / args.wave_minutes))
    waves, before = [], start
    for i in range(n_waves):
        end = t0 + run_s * (i + 1) / n_waves
        await asyncio.gather(load.wave(target, end), churn(url, args.churn_per_s, end, events))
        settle_s, m = await settle(url, usable, 15.0)
        waves.append(
            {
                "t_s": time.monotonic() - t0,
                "settle_s": round(settle_s, 2),
                "rss_mb": rss_bytes(pid) / 1e6,
                "conversations": int(m["s2s_conversations"]),
                "at_baseline": at_baseline(m, usable),
                "metrics": m,
                "metrics_before": before,
            }
        )
        before = m
    stop.set()
    await sampling
    end_capacity, end_reason = await probe(url) if args.probe_at_end else (None, "not probed")
    return {
        "events": events,
        "t0": t0,
        "samples": sampler.rows,
        "waves": waves,
        "usable": usable,
        "capacity": capacity,
        "capacity_reason": reason,
        "capacity_end": end_capacity,
        "capacity_end_reason": end_reason,
        "target_live": target,
        "started_clients": load.started,
        "outcomes": load.outcomes,
        "deadline_misses": int(waves[-1]["metrics"]["s2s_deadline_misses_total"] - start["s2s_deadline_misses_total"]),
        "refusals": dict(Counter(str(e.value)[:100] for e in events if e.kind == "refused")),
        "churn": dict(Counter(e.kind for e in events if e.kind.startswith("churn"))),
    }


def main() -> None:
    p = parser("soak", __doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    p.add_argument("--load", type=float, default=0.8, help="share of the probed capacity kept live")
    p.add_argument("--wave-minutes", type=float, default=2.0, help="every client leaves (pages checked) this often")
    p.add_argument("--warmup-minutes", type=float, default=5.0, help="RSS growth counts from the first wave end after")
    p.add_argument("--window-minutes", type=float, default=5.0, help="first-audio p95: the first and last this long")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    add_model_args(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (0: the server's default)")
    p.add_argument("--kv-pages", type=int, default=4096, help="the server's K/V pages")
    p.add_argument("--max-conversations", type=int, default=32, help="the server's --max-conversations")
    p.add_argument(
        "--admission-headroom",
        type=float,
        default=None,
        help="the server's (with --max-conversations, a fixed capacity: churn's conversations opened, not refused)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the clients' plans")
    p.add_argument(
        "--churn-per-s", type=float, default=200.0, help="connections a second that open and close (0: none)"
    )
    p.add_argument(
        "--duplex-mute", action="store_true", help="duplex users go silent with a muted microphone, not silence"
    )
    p.add_argument("--no-probe-at-end", dest="probe_at_end", action="store_false", help="skip the second probe")
    add_device_args(p)
    args = p.parse_args()
    choice = model_choice(args)
    mix, clip_s = Mix(), 6.0
    if args.quick:
        args.minutes, args.wave_minutes, args.sample_s = 0.4, 0.2, 2.0
        mix, clip_s, args.probe_at_end = QUICK_MIX, 2.5, False
    started = time.monotonic()
    run_s = args.minutes * 60
    warmup_s, window_s = min(args.warmup_minutes * 60, run_s / 3), min(args.window_minutes * 60, run_s / 3)
    clips = [trimmed(speech(text)[0], clip_s) for text in SENTENCES]
    device = device_name(args.device)
    params = {
        "bench": "soak",
        "model": choice.label,
        "preset": choice.preset,
        "server_device": device,
        "server_threads": args.threads,
        "kv_pages": args.kv_pages,
        "minutes": args.minutes,
        "wave_minutes": args.wave_minutes,
        "load": args.load,
        "seed": args.seed,
    }
    rows: list[dict] = []

    def on_row(row: dict) -> None:
        progress(row)
        rows.append({**params, "kind": "sample", **row})
        write_json(args.json, rows)  # as it goes: a run cut short keeps what it measured

    with tempfile.TemporaryDirectory() as voices_dir:
        voices = tuple(write_voices(Path(voices_dir)))
        mix = Mix(**{**mix.__dict__, "voices": voices, "duplex_mute": args.duplex_mute})
        serve_args = [*choice.serve_args(), "--threads", str(args.threads), "--kv-pages", str(args.kv_pages)]
        serve_args += ["--max-conversations", str(args.max_conversations), "--frames-per-tick", str(choice.frames(4))]
        serve_args += ["--max-reply-frames", str(choice.frames(225)), "--prompts", voices_dir]
        serve_args += device_server_args(args)
        if args.admission_headroom is not None:
            serve_args += ["--admission-headroom", str(args.admission_headroom)]
        if server_has(PER_CLIENT_OPTION):
            serve_args += [PER_CLIENT_OPTION, "100000"]
        server = ServerProcess(*serve_args, timeout_s=600)
        phases = {"setup_s": time.monotonic() - started}
        with server as url:
            phases["server_start_s"] = time.monotonic() - started - sum(phases.values())
            result = asyncio.run(soak(url, server.proc.pid, args, clips, mix, on_row))
            phases["soak_s"] = time.monotonic() - started - sum(phases.values())
        phases["server_stop_s"] = time.monotonic() - started - sum(phases.values())
    time.sleep(0.5)  # the thread that reads the server's output takes its last lines (it has exited)
    errors = log_errors(server.output)
    waves, events = result["waves"], result["events"]
    ran_s = waves[-1]["t_s"]
    goals = targets(
        waves, events, result["t0"], ran_s, warmup_s, window_s, result["deadline_misses"], result["usable"], errors
    )
    per_wave = wave_rows(waves, events, result["t0"])
    title = (
        f"Soak through `s2s serve` ({choice.label}, {device}): {ran_s / 60:.1f} min, "
        f"{result['target_live']} live of a capacity of {result['capacity']}, {result['started_clients']} clients"
    )
    tables = print_table(title + ": targets (issue 20)", goals, [(k, k) for k in ("target", "measured", "goal", "met")])
    tables += print_table(title + ": waves (server state after every client left)", per_wave, WAVE_COLUMNS)
    run = {
        "capacity": result["capacity"],
        "capacity_refusal": result["capacity_reason"],
        "capacity_at_end": result["capacity_end"],
        "target_live": result["target_live"],
        "clients": result["started_clients"],
        "outcomes": result["outcomes"],
        "refusals": result["refusals"],
        "churn": result["churn"],
        "usable_pages": result["usable"],
        "server_args": serve_args,
        "server_log_error_lines": errors[:20],
        "wall_s": time.monotonic() - started,
        **{k: round(v, 1) for k, v in phases.items()},
    }
    print(
        f"capacity at the start {result['capacity']}, at the end {result['capacity_end']} "
        f"({result['capacity_end_reason']}); client outcomes {result['outcomes']}; "
        f"refusals: {result['refusals']}; churn: {result['churn']}; "
        f"seconds: { {k: round(v, 1) for k, v in phases.items()} }; "
        f"server log: {len(errors)} error lines" + "".join(f"\n  {line}" for line in errors[:10])
    )
    rows += [{**params, "kind": "wave", **r} for r in per_wave]
    rows += [{**params, "kind": "target", **r} for r in goals]
    rows.append({**params, "kind": "run", **run, **environment()})
    plot(result["samples"], waves, args.plot, title)
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
