"""Scale-out: three replicas behind HAProxy (`s2s cluster`), conversations over voice prompts arriving in a burst
then steady; routing by voice (consistent hashing, bounded loads) against round robin, and a drain mid-run.

Each routing gets a fresh cluster (cold caches), the same prompts, speech and arrival schedule. A conversation is a
turn-mode pcm16 client (`talk`) with `?voice=NAME`: it sends a recorded question at once (as a Realtime
client commits a buffer), ends its turn, hears the reply, leaves; so the voice prompt's prefill, where the replica
has not cached it, comes before the first audio.
A refused one (HTTP 503 from every replica it was tried on) waits the `Retry-After` and tries again, as a client
would. Per routing: the prefix cache's hit rate and the steps computed as prefill (all replicas' /metrics, before
and after), first audio (end of speech to the first reply audio) p50/p95, and p50 after the burst, refused attempts,
and the spread of
conversations over replicas. Then, on the voice-routed cluster, a wave of conversations with one replica drained
in the middle of it (`s2s cluster drain`): how many it cut, and how long the drain took.

    s2s bench cluster [--quick] [--model DIR | --preset NAME] [--conversations 48] [--voices 8] [--json PATH]

The replicas serve the weights a user runs: by default the shipped codec and echo model (what `s2s serve` serves with
no flags), or `--model DIR`, or `--preset NAME` (seeded weights, as the figures before issue 48 were); each row's
`model` says which."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from bench.common import (
    SENTENCES,
    ModelChoice,
    add_model_args,
    environment,
    model_choice,
    parser,
    percentiles,
    print_table,
    save_outputs,
    scrape,
    write_json,
)
from codec.pcm import SAMPLE_RATE, save_wav
from server.cluster.control import ask
from server.moshi.client import talk
from server.ports import free_port
from server.process import ServerProcess
from speech.sample import speech, synthesize

ESPEAK_VOICES = ["en-us+f1", "en-us+f2", "en-us+f3", "en-us+f4", "en-us+m1", "en-us+m2", "en-us+m3", "en-gb+f2"]
SEND_SPEED = 20.0  # a recorded question, sent at once (within the server's 2 s burst), as a Realtime client commits


def voice_prompts(folder: Path, count: int, seconds: float) -> list[str]:
    """`count` voice prompts of `seconds` each (espeak-ng voices, sentences back to back) as WAVs in `folder`."""
    names = []
    for i in range(count):
        pcm = np.concatenate([synthesize(t, ESPEAK_VOICES[i % len(ESPEAK_VOICES)]) for t in SENTENCES])
        name = f"voice{i}"
        save_wav(folder / f"{name}.wav", np.resize(pcm, int(seconds * SAMPLE_RATE)))
        names.append(name)
    return names


async def conversation(url: str, voice: str, pcm: np.ndarray, seed: int, speed: float = SEND_SPEED) -> dict:
    refused = 0
    for _ in range(30):
        r = await talk(url, pcm, speed=speed, listen_s=60, voice=voice, seed=str(seed))
        if r.handshake and r.metadata:
            return {
                "voice": voice,
                "replica": r.metadata[0].get("replica"),
                "first_audio_s": r.turn_latency_s,
                "refused": refused,
                "errors": r.errors,
            }
        if not any(e.startswith("refused") for e in r.errors):
            return {"voice": voice, "replica": None, "first_audio_s": None, "refused": refused, "errors": r.errors}
        refused += 1
        await asyncio.sleep(1.0)  # the 503's Retry-After
    return {"voice": voice, "replica": None, "first_audio_s": None, "refused": refused, "errors": ["gave up"]}


def questions(n: int, seconds: float) -> list[np.ndarray]:
    """`n` different questions of `seconds` each: slices of the sentences spoken back to back, each starting at its
    own place (the same audio after the same voice prompt would be a cached prefix: users do not say the same)."""
    spoken = np.concatenate([speech(t)[0] for t in SENTENCES])
    length, step = int(seconds * SAMPLE_RATE), int(0.37 * SAMPLE_RATE)
    return [np.resize(np.roll(spoken, -i * step), length) for i in range(n)]


async def arrivals(url: str, voices: list[str], pcm: list[np.ndarray], gap_s: float) -> list[dict]:
    """The first half of the conversations (one a question in `pcm`) at once, the rest `gap_s` apart; voices in
    turn."""
    n = len(pcm)
    tasks = []
    for i in range(n):
        if i >= n // 2:
            await asyncio.sleep(gap_s)
        tasks.append(asyncio.create_task(conversation(url, voices[i % len(voices)], pcm[i], i)))
    return await asyncio.gather(*tasks)


def replica_urls(run_dir: Path) -> dict[str, str]:
    return {r["replica"]: f"http://127.0.0.1:{r['port']}" for r in _status(run_dir)}


def counters(urls: dict[str, str]) -> dict[str, float]:
    keys = ("s2s_cache_hit_steps_total", "s2s_cache_missed_steps_total", "s2s_prefill_steps_total")
    total = dict.fromkeys(keys, 0.0)
    for url in urls.values():
        m = scrape(url)
        for k in keys:
            total[k] += m[k]
    return total


def summary(done: list[dict], before: dict, after: dict) -> dict:
    served = [d for d in done if d["replica"] is not None]
    latency = [d["first_audio_s"] for d in served if d["first_audio_s"] is not None]
    steady = [d["first_audio_s"] for d in done[len(done) // 2 :] if d["first_audio_s"] is not None]  # after the burst
    load = Counter(d["replica"] for d in served)
    hit = after["s2s_cache_hit_steps_total"] - before["s2s_cache_hit_steps_total"]
    missed = after["s2s_cache_missed_steps_total"] - before["s2s_cache_missed_steps_total"]
    pct = percentiles(latency, 1000) if latency else {"p50": float("nan"), "p95": float("nan")}
    return {
        "served": len(served),
        "failed": len(done) - len(served),
        "first_error": next((e for d in done for e in d["errors"] if not e.startswith("refused")), None),
        "refused_attempts": sum(d["refused"] for d in done),
        "first_audio_ms_p50": pct["p50"],
        "first_audio_ms_p95": pct["p95"],
        "steady_first_audio_ms_p50": float(np.median(steady)) * 1000 if steady else float("nan"),
        "cache_hit_rate": hit / (hit + missed) if hit + missed else float("nan"),
        "prefill_steps": int(after["s2s_prefill_steps_total"] - before["s2s_prefill_steps_total"]),
        "voice_placements": len({(d["voice"], d["replica"]) for d in served}),
        "per_replica": dict(sorted(load.items())),
        "load_max_over_mean": max(load.values()) / (len(served) / len(load)) if served else float("nan"),
    }


async def drained_wave(url: str, run_dir: Path, voices: list[str], pcm: list[np.ndarray]) -> dict:
    """A conversation per voice at once, speaking in real time; a second later, the replica holding most of them is
    drained."""
    tasks = [asyncio.create_task(conversation(url, v, pcm[i], 1000 + i, speed=1.0)) for i, v in enumerate(voices)]
    await asyncio.sleep(1.0)
    live = {r["replica"]: r["conversations"] for r in _status(run_dir)}
    target = max(live, key=live.get)
    drained = await asyncio.to_thread(_ask, run_dir, {"command": "drain", "replica": target, "timeout_s": 60})
    done = await asyncio.gather(*tasks)
    return {
        "drained": target,
        "live_at_drain": live[target],
        "cut": drained["cut"],
        "drain_s": drained["seconds"],
        "served": sum(d["replica"] is not None and not d["errors"] for d in done),
        "wave": len(done),
    }


def _ask(run_dir: Path, request: dict) -> dict:
    """What `s2s cluster status|add|drain` would: the cluster's result for `request`."""
    answer = list(ask(run_dir / "control.sock", request))[-1]
    if "error" in answer:
        raise RuntimeError(f"s2s cluster {request['command']}: {answer['error']}")
    return answer["result"]


def _status(run_dir: Path) -> list[dict]:
    return _ask(run_dir, {"command": "status"})["replicas"]


def main() -> None:
    p = parser("cluster", __doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--voices", type=int, default=8)
    p.add_argument("--prompt-seconds", type=float, default=6.0, help="length of each voice prompt")
    p.add_argument("--speech-seconds", type=float, default=1.5, help="what each user says")
    p.add_argument("--balance-factor", type=int, default=150, help="voice routing's bound (`s2s cluster`'s)")
    p.add_argument("--gap", type=float, default=1.0, help="seconds between steady arrivals")
    p.add_argument(
        "--admission-headroom",
        type=float,
        default=3.0,
        help="the replicas' (`s2s serve`'s default is 0.75, which admits about one conversation a replica when three "
        "share 2 cores, so that every arrival spills: routing cannot then matter); turn mode has no frame deadline",
    )
    args = p.parse_args()
    choice = model_choice(args)
    if args.quick:
        args.conversations, args.voices, args.prompt_seconds = 12, 4, 3.0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "voices"
        folder.mkdir()
        voices = voice_prompts(folder, args.voices, args.prompt_seconds)
        pcm = questions(args.conversations, args.speech_seconds)
        for balance in ("voice", "roundrobin"):
            run_dir = Path(tmp) / f"run-{balance}"
            cluster = ["--replicas", "3", "--port", str(free_port()), "--run-dir", str(run_dir)]
            cluster += [
                "--balance",
                balance,
                "--balance-factor",
                str(args.balance_factor),
                *choice.serve_args(),
                "--threads",
                "1",
                "--prompts",
                str(folder),
            ]
            cluster += ["--max-reply-frames", str(choice.frames(20)), "--max-conversations-per-client", "0"]
            cluster += ["--admission-headroom", str(args.admission_headroom)]
            with ServerProcess(*cluster, subcommand="cluster", timeout_s=300) as url:
                urls = replica_urls(run_dir)
                before = counters(urls)
                done = asyncio.run(arrivals(url, voices, pcm, args.gap))
                row = summary(done, before, counters(urls))
                rows.append(_row("measured", balance, args, choice, row))
                if balance == "voice":
                    wave = asyncio.run(drained_wave(url, run_dir, voices, questions(len(voices), 3.0)))
                    rows.append(_row("scale-down", balance, args, choice, wave))
            write_json(args.json, rows)
    columns = [
        ("routing", "routing"),
        ("served", "served"),
        ("refused_attempts", "refused tries"),
        ("cache_hit_rate", "cache hit rate"),
        ("prefill_steps", "prefill steps"),
        ("voice_placements", "voice x replica"),
        ("first_audio_ms_p50", "first audio p50 ms"),
        ("first_audio_ms_p95", "p95 ms"),
        ("steady_first_audio_ms_p50", "steady p50 ms"),
        ("load_max_over_mean", "max/mean load"),
        ("per_replica", "per replica"),
    ]
    measured = [r for r in rows if r["phase"] == "measured"]
    tables = print_table(
        f"{args.conversations} conversations over {args.voices} voice prompts of {args.prompt_seconds:g} s, half in a "
        f"burst, then one per {args.gap:g} s; 3 replicas ({choice.label}, 1 thread each) behind HAProxy, "
        f"{environment()['host_cpus']} CPUs",
        measured,
        columns,
    )
    drain_columns = [
        ("drained", "drained"),
        ("live_at_drain", "live at drain"),
        ("cut", "cut"),
        ("drain_s", "drain s"),
        ("served", "served"),
        ("wave", "of"),
    ]
    scale_down = [r for r in rows if r["phase"] == "scale-down"]
    tables += print_table("Scale-down: one replica drained during a wave, voice routing", scale_down, drain_columns)
    save_outputs(args, rows, tables)


def _row(phase: str, balance: str, args, choice: ModelChoice, measured: dict) -> dict:
    return {
        "bench": "cluster",
        "phase": phase,
        "routing": f"voice (consistent, bounded {args.balance_factor})" if balance == "voice" else "round robin",
        "model": choice.label,
        "preset": choice.preset,
        "replicas": 3,
        "conversations": args.conversations,
        "voices": args.voices,
        "prompt_seconds": args.prompt_seconds,
        **{k: json.dumps(v) if isinstance(v, dict) else v for k, v in measured.items()},
        **environment(),
    }


if __name__ == "__main__":
    main()
