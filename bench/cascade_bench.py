"""Cascade benchmark: turn latency of this server (turn and duplex mode) beside a cascaded STT -> LLM -> TTS pipeline.

    s2s bench cascade [--quick] [--protocol moshi|realtime|both] [--json PATH] [--plot PATH]

Every system is a websocket server in its own child process (one at a time), same model size (small preset, seeded):
- `s2s serve --vad-silence S`: this server, turn mode (Silero endpointing after S of silence) and duplex mode; turn
  mode through Moshi's binary protocol (`turn`) and through the Realtime API on the same server (`turn-realtime`:
  base64 pcm16 in JSON appends, server VAD with `silence_duration_ms` S, latency to the first audio delta);
- `python -m bench.cascade.serve`: `bench/cascade/`, the same endpointing (silence_ms=S), pocketsphinx fed while
  the user speaks, a byte-level text decoder of the same size on this engine, then espeak-ng or this engine's speech
  decoder.

Clients speak espeak-ng sentences in pcm16, 80 ms blocks each sent once its last sample is "spoken" (real time), then
keep sending silence (a microphone stays on). Turn latency is from the true end of speech (the clip's last sample
above SILENT, in the client's real-time timeline) to the first reply audio at the client. In duplex mode there is no
endpoint: turn latency is from the block holding the last speech frame f leaving the client (loopback: reaching the
server) to the arrival of model frame f + max_delay + 1, the first whose every code was sampled with user frame f
wholly in context (frames are counted in the pcm16 stream). Per-stage times come from the servers' metadata
(`time.perf_counter`, CLOCK_MONOTONIC on Linux, the same clock in every process). Concurrency N: N clients, started
1/N s apart, each making its turns one after another on fresh connections, 0.5 s apart (`TURN_GAP_S`).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.cascade import serve as cascade_serve
from bench.common import (
    add_device_args,
    device_name,
    device_server_args,
    environment,
    parser,
    peak_rss_bytes,
    percentiles,
    print_table,
    save_outputs,
    scrape,
    write_json,
)
from codec import EncodecTokenizer
from codec.pcm import SAMPLE_RATE, to_pcm16
from s2s import ModelConfig
from server.moshi import protocol
from server.moshi.client import refusal_of
from server.moshi.protocol import BLOCK, Kind, metadata_of
from server.process import ServerProcess
from server.realtime.wire import pcm16_base64
from server.vad.config import VadConfig
from server.vad.endpointer import Endpointer
from speech.sample import synthesize

SILENT = 0.005  # |sample| above this is speech
TURN_GAP_S = 0.5  # a client's pause between its turns
PRESET = "small"
FRAME_SIZE = EncodecTokenizer.frame_size  # the servers serve the shipped codec: its frames are theirs
SENTENCES = [
    "What is the weather going to be like tomorrow morning",
    "Please book a table for two at the Italian place tonight",
    "Tell me a short story about a robot who learns to sing",
    "I think the meeting should move to Thursday afternoon",
]
STAGES = ["endpoint", "stt", "llm", "phrase", "tts", "send", "duplex"]
STAGE_LABELS = {
    "endpoint": "endpoint wait",
    "stt": "STT final",
    "llm": "LLM / S2S prefill to first token",
    "phrase": "phrase aggregation",
    "tts": "TTS / speech out to first audio",
    "send": "send to client",
    "duplex": "duplex: frame in to audio out",
}


@dataclass
class Clip:
    pcm: np.ndarray  # the utterance and enough trailing silence to end the turn
    eos: int  # index of its last sample above SILENT


def clips(silences: list[float], count: int) -> list[Clip]:
    """espeak-ng utterances; each must end its turn exactly once, after its last word, at every silence setting."""
    out = []
    for text in SENTENCES[:count]:
        wav = synthesize(text)
        eos = int(np.flatnonzero(np.abs(wav) > SILENT)[-1])
        pcm = np.concatenate([wav, np.zeros(int(SAMPLE_RATE * (max(silences) + 0.4)), dtype=np.float32)])
        for s in silences:
            vad, ends = Endpointer(VadConfig(silence_s=s)), []
            for a in range(0, len(pcm), BLOCK):
                if "end_of_turn" in vad.push(pcm[a : a + BLOCK]):
                    ends.append(a + BLOCK)
            if len(ends) != 1 or ends[0] <= eos:
                raise RuntimeError(f"{text!r}: the {s * 1000:.0f} ms endpointer fires at samples {ends}, eos {eos}")
        out.append(Clip(pcm, eos))
    return out


@dataclass
class TurnResult:
    latency_s: float | None = None
    stages: dict[str, float] = field(default_factory=dict)
    ttfa_s: float | None = None
    refused: bool = False
    errors: list[str] = field(default_factory=list)


def refused_at_upgrade(result: TurnResult, e: InvalidStatus) -> TurnResult:
    """A connect the server answered with an HTTP error instead of the upgrade: a refusal when it is full or drains
    (503) or the client holds its limit (429), the body its reason ("refused: REASON"); an error otherwise."""
    result.refused = e.response.status_code in (429, 503)
    result.errors.append(refusal_of(e))
    return result


async def speak(
    ws, clip: Clip, start: float, timeout_s: float, done: asyncio.Event, message: Callable[[np.ndarray], bytes | str]
) -> list[float]:
    """The clip, then silence (a microphone stays on), in 80 ms blocks each sent once its last sample is "spoken",
    until `done`; returns when each block left."""
    silence, sent_at = np.zeros(BLOCK, dtype=np.float32), []
    try:
        for i in range(int((len(clip.pcm) / SAMPLE_RATE + timeout_s) * SAMPLE_RATE / BLOCK)):
            a = i * BLOCK
            block = clip.pcm[a : a + BLOCK] if a < len(clip.pcm) else silence
            await asyncio.sleep(max(0.0, start + (i + 1) * BLOCK / SAMPLE_RATE - time.perf_counter()))
            if done.is_set():
                break
            await ws.send(message(block))
            sent_at.append(time.perf_counter())
    except ConnectionClosed:
        pass
    return sent_at


async def one_turn(url: str, clip: Clip, system: str, query: str, timeout_s: float, max_delay: int) -> TurnResult:
    """One utterance on a fresh connection, measured as the module docstring says."""
    result = TurnResult()
    start = time.perf_counter()
    eos_at = start + (clip.eos + 1) / SAMPLE_RATE  # when the speaker stopped, in real time
    received = 0  # duplex: samples of model audio so far
    first_audio: float | None = None
    target = (clip.eos // FRAME_SIZE + max_delay + 1 + 1) * FRAME_SIZE  # duplex: samples to the end of that frame
    done = asyncio.Event()
    meta: dict = {}

    try:
        ws = await connect(f"{url}/api/chat?{query}", max_size=None)
    except InvalidStatus as e:
        return refused_at_upgrade(result, e)
    async with ws:

        async def receive() -> None:
            nonlocal received, first_audio
            try:
                async for message in ws:
                    now = time.perf_counter()
                    if message[0] == Kind.AUDIO:
                        n = (len(message) - 1) // 2
                        if system == "duplex":
                            if received < target <= received + n:
                                first_audio = now
                                done.set()
                            received += n
                        elif first_audio is None and now > eos_at:
                            first_audio = now
                    elif message[0] == Kind.METADATA:
                        data = metadata_of(message)
                        if data.get("event") in ("first_audio", "reply_done"):
                            meta.setdefault(data["event"], data)
                        if data.get("event") == "reply_done" and first_audio is not None:
                            done.set()
                    elif message[0] == Kind.ERROR:
                        text = message[1:].decode(errors="replace")
                        result.errors.append(text)
                        result.refused = result.refused or text.startswith("refused")
            except ConnectionClosed:
                pass
            done.set()

        reader = asyncio.create_task(receive())

        def pcm16(block: np.ndarray) -> bytes:
            return protocol.audio(to_pcm16(block))

        sent_at = await speak(ws, clip, start, timeout_s, done, pcm16)  # block i left the client at sent_at[i]
        await ws.close()
        await asyncio.wait_for(reader, 5)
    if first_audio is None and not result.refused:
        result.errors.append(f"no reply audio within {timeout_s:g} s of the end of speech")
    if first_audio is None or result.refused:
        return result
    if system == "duplex":
        frame_in = sent_at[((clip.eos // FRAME_SIZE + 1) * FRAME_SIZE - 1) // BLOCK]
        result.latency_s = result.ttfa_s = first_audio - frame_in
        result.stages = {"duplex": result.latency_s}
        return result
    result.latency_s = first_audio - eos_at
    if system == "turn":
        t = meta.get("reply_done", {}).get("times", {})
        if not {"end_of_turn", "first_step", "first_audio_out"} <= t.keys():
            result.errors.append(f"no stage times in {meta}")
            return result
        marks = [eos_at, t["end_of_turn"], t["end_of_turn"], t["first_step"], t["first_step"], t["first_audio_out"]]
        result.ttfa_s = t["first_audio_out"] - t["end_of_turn"]
    else:
        t = meta.get("first_audio", {}).get("times", {})
        if "tts_first_audio" not in t:
            result.errors.append(f"no stage times in {meta}")
            return result
        keys = ["endpoint", "stt_done", "llm_first_token", "phrase_ready", "tts_first_audio"]
        marks = [eos_at, *(t[k] for k in keys)]
        result.ttfa_s = t["tts_first_audio"] - t["endpoint"]
    marks.append(first_audio)
    result.stages = {s: b - a for s, a, b in zip(STAGES, marks, marks[1:], strict=False)}
    return result


async def one_realtime_turn(url: str, clip: Clip, silence_ms: float, timeout_s: float) -> TurnResult:
    """One utterance through the Realtime API on a fresh connection: 80 ms appends in real time, as `one_turn` sends
    them, and the turn's latency from the end of speech to the first audio delta."""
    result = TurnResult()
    first_audio: float | None = None
    done = asyncio.Event()
    try:
        ws = await connect(f"{url}/v1/realtime?model=s2s", max_size=None)
    except InvalidStatus as e:
        return refused_at_upgrade(result, e)
    async with ws:
        vad = {"type": "server_vad", "silence_duration_ms": int(silence_ms)}
        update = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": vad}}, "seed": 1}}
        async with asyncio.timeout(timeout_s):
            for expected in ("session.created", "session.updated"):  # a late refusal comes first, then the close
                if (event := json.loads(await ws.recv()))["type"] != expected:
                    result.refused = event.get("error", {}).get("code") == "refused"
                    result.errors.append(event.get("error", {}).get("message", str(event)))
                    return result
                if expected == "session.created":
                    await ws.send(json.dumps(update))
        start = time.perf_counter()
        eos_at = start + (clip.eos + 1) / SAMPLE_RATE

        async def receive() -> None:
            nonlocal first_audio
            try:
                async for message in ws:
                    event = json.loads(message)
                    now = time.perf_counter()
                    if event["type"] == "response.output_audio.delta" and first_audio is None and now > eos_at:
                        first_audio = now
                    elif event["type"] == "response.done":
                        done.set()
                    elif event["type"] == "error":
                        result.errors.append(event["error"]["message"])
            except ConnectionClosed:
                pass
            done.set()

        reader = asyncio.create_task(receive())

        def append(block: np.ndarray) -> str:
            return json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_base64(block)})

        await speak(ws, clip, start, timeout_s, done, append)
        await ws.close()
        await asyncio.wait_for(reader, 5)
    if first_audio is None:
        result.errors.append(f"no reply audio within {timeout_s:g} s of the end of speech")
        return result
    result.latency_s = first_audio - eos_at
    return result


async def run_level(
    url: str, system: str, query: str, n: int, rounds: int, voices: list[Clip], timeout_s: float, max_delay: int
) -> list[TurnResult]:
    def turn(clip: Clip):
        if system == "turn-realtime":
            silence_ms = float(query.rpartition("silence_ms=")[2])
            return one_realtime_turn(url, clip, silence_ms, timeout_s)
        return one_turn(url, clip, system.split("-")[0], query, timeout_s, max_delay)

    async def client(i: int) -> list[TurnResult]:
        await asyncio.sleep(i / n)
        results = []
        for r in range(rounds):
            if r:  # the server closes the last conversation a tick or two after its socket: not refused for it
                await asyncio.sleep(TURN_GAP_S)
            results.append(await turn(voices[(i + r) % len(voices)]))
        return results

    return [r for rs in await asyncio.gather(*(client(i) for i in range(n))) for r in rs]


def summarize(results: list[TurnResult]) -> dict:
    ok = [r for r in results if r.latency_s is not None]
    row = {
        "turns": len(results),
        "answered": len(ok),
        "refusals": sum(r.refused for r in results),
        "errors": sum(bool(r.errors) and not r.refused for r in results),
        "first_error": next((r.errors[0] for r in results if r.errors and not r.refused), None),
        "first_refusal": next((e for r in results for e in r.errors if e.startswith("refused")), None),
    }
    if ok:
        lat = percentiles([r.latency_s for r in ok], 1000)
        row.update({f"turn_latency_ms_{k}": v for k, v in lat.items()})
        if any(r.ttfa_s is not None for r in ok):
            ttfa = percentiles([r.ttfa_s for r in ok if r.ttfa_s is not None], 1000)
            row.update({f"ttfa_ms_{k}": v for k, v in ttfa.items()})
        staged = [r for r in ok if r.stages]  # the stage times come in metadata that may not arrive in time
        for s in STAGES if staged else []:
            row[f"{s}_ms_p50"] = float(np.median([r.stages.get(s, 0.0) for r in staged]) * 1000)
    return row


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, per silence, cascade TTS and concurrency, from this run's rows."""
    by = {(r["system"], r["silence_ms"], r["concurrency"]): r for r in rows if "turn_latency_ms_p50" in r}
    out = []
    for (system, silence, n), c in sorted(by.items()):
        if not system.startswith("cascade"):
            continue
        turn, duplex = by.get(("turn", silence, n)), by.get(("duplex", None, n))
        row = {"cascade": system, "silence_ms": silence, "concurrency": n, "cascade_p50_ms": c["turn_latency_ms_p50"]}
        if duplex:
            row["duplex_over_cascade"] = duplex["turn_latency_ms_p50"] / c["turn_latency_ms_p50"]
            row["duplex_at_most_third"] = row["duplex_over_cascade"] <= 1 / 3
        if realtime := by.get(("turn-realtime", silence, n)):
            row["realtime_over_moshi"] = realtime["turn_latency_ms_p50"] / turn["turn_latency_ms_p50"] if turn else None
        if turn:
            row["turn_p50_ms"] = turn["turn_latency_ms_p50"]
            row["gap_ms"] = c["turn_latency_ms_p50"] - turn["turn_latency_ms_p50"]
            row["stt_plus_llm_ms"] = c["stt_ms_p50"] + c["llm_ms_p50"]
            row["turn_ahead_by_stt_llm"] = row["gap_ms"] >= row["stt_plus_llm_ms"]
        out.append(row)
    for row in out:  # the gap widening as concurrency grows
        same = [
            r for r in out if (r["cascade"], r["silence_ms"]) == (row["cascade"], row["silence_ms"]) and "gap_ms" in r
        ]
        lower = [r for r in same if r["concurrency"] < row["concurrency"]]
        if lower and "gap_ms" in row:
            row["gap_wider_than_lower_n"] = all(row["gap_ms"] > r["gap_ms"] for r in lower)
    return out


def plot(rows: list[dict], path, device: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    silences = sorted({r["silence_ms"] for r in rows if r["silence_ms"] is not None})
    fig, axes = plt.subplots(1, len(silences), figsize=(7 * len(silences), 5), squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, silence in zip(axes[0], silences, strict=True):
        bars = [r for r in rows if r["silence_ms"] in (silence, None) and "turn_latency_ms_p50" in r]
        bars.sort(key=lambda r: (r["system"], r["concurrency"]))
        x = np.arange(len(bars))
        bottom = np.zeros(len(bars))
        for i, s in enumerate(STAGES):
            h = np.array([max(0.0, r.get(f"{s}_ms_p50", 0.0)) for r in bars])
            ax.bar(x, h, bottom=bottom, color=colors(i), label=STAGE_LABELS[s])
            bottom += h
        ax.plot(x, [r["turn_latency_ms_p50"] for r in bars], "k_", ms=14, label="turn latency p50")
        ax.set_xticks(x, [f"{r['system'].replace('-', chr(10))}\nN={r['concurrency']}" for r in bars], fontsize=7)
        ax.set_ylabel("ms (stage medians)")
        ax.set_title(f"endpointing silence {silence:g} ms (duplex: no endpointing)")
        ax.legend(fontsize=7)
    fig.suptitle(f"Turn latency by stage, {PRESET} preset on both sides, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = parser("cascade", __doc__.splitlines()[0])
    # one: on this shared 2-core machine two OpenMP threads per server, beside other work, made ticks 40x slower
    p.add_argument("--threads", type=int, default=1, help="torch threads per server process (0: the server's default)")
    p.add_argument("--silence-ms", default="200,500", help="endpointing silences (pipecat's 200, LiveKit's 500)")
    p.add_argument("--rounds", default="6,3,2", help="turns per client at concurrency 1, 4 and 16")
    p.add_argument(
        "--protocol",
        choices=["moshi", "realtime", "both"],
        default="both",
        help="turn mode through Moshi's binary protocol, the Realtime API, or both (duplex and the cascade: Moshi's)",
    )
    add_device_args(p)
    args = p.parse_args(argv)
    silences = [float(ms) / 1000 for ms in args.silence_ms.split(",")]
    if args.quick:
        levels, silences, reply_frames, sentences, rounds = [1, 4], silences[:1], 38, 1, {1: 1, 4: 1}
    else:
        levels, reply_frames, sentences = [1, 4, 16], 150, 4
        rounds = dict(zip(levels, map(int, args.rounds.split(",")), strict=True))
    device = device_name(args.device)
    timeout_s = 30.0
    max_delay = ModelConfig.preset(PRESET).max_delay
    voices = clips(silences, sentences)
    # room for a level's conversations while the last level's are still closing
    common = ["--preset", PRESET, "--max-reply-frames", reply_frames, "--max-conversations", 2 * max(levels)]
    common += ["--threads", args.threads] if args.threads else []
    common += ["--max-conversations-per-client", 0]  # every client connects from this process
    common += device_server_args(args)
    plan = []  # (server module (None: `s2s serve`), server args, [(system, silence ms or None, query)])
    for s in silences:
        # duplex first: an overloaded turn-mode level teaches the admission cost model slow ticks
        runs = [("duplex", None, "mode=duplex&codec=pcm16&seed=1")] if s == silences[0] else []
        if args.protocol in ("moshi", "both"):
            runs += [("turn", s * 1000, "mode=turn&codec=pcm16&seed=1")]
        if args.protocol in ("realtime", "both"):
            runs += [("turn-realtime", s * 1000, f"silence_ms={s * 1000:g}")]
        plan.append((None, ["--vad-silence", s, *common], runs))
    cascade = [
        (f"cascade-{tts}", s * 1000, f"mode=turn&codec=pcm16&seed=1&tts={tts}&silence_ms={s * 1000:g}")
        for s in silences
        for tts in ("espeak", "engine")
    ]
    plan.append((cascade_serve.MODULE, common, cascade))
    env = {
        **environment(),
        "quick": args.quick,
        "preset": PRESET,
        "reply_frames": reply_frames,
        "levels": levels,
        "silences_s": silences,
        "server_device": device,
        "cuda_graphs": not args.enforce_eager,
        "client_timeout_s": timeout_s,
        "codec": "pcm16",
        "max_delay": max_delay,
    }
    rows = []
    with tqdm(total=sum(len(runs) for *_, runs in plan) * len(levels), desc="cascade bench", file=sys.stderr) as bar:
        for module, server_args, runs in plan:
            with ServerProcess(*server_args, module=module) as url:
                for system, silence_ms, query in runs:
                    if not args.quick:  # one turn to warm up (first-call costs), not measured
                        asyncio.run(run_level(url, system, query, 1, 1, voices, timeout_s, max_delay))
                    for n in levels:
                        # the cascade's /metrics is its speech engine's: no duplex there
                        misses = scrape(url)["s2s_deadline_misses_total"] if module is None else None
                        t0 = time.perf_counter()
                        results = asyncio.run(run_level(url, system, query, n, rounds[n], voices, timeout_s, max_delay))
                        after = scrape(url)["s2s_deadline_misses_total"] if module is None else None
                        rows.append(
                            {
                                "workload": "espeak utterances, one turn per connection",
                                "system": system,
                                "mode": "duplex" if system == "duplex" else "turn",
                                "protocol": "realtime" if system == "turn-realtime" else "moshi",
                                "silence_ms": silence_ms,
                                "concurrency": n,
                                "rounds_per_client": rounds[n],
                                "wall_s": time.perf_counter() - t0,
                                "deadline_misses": None if None in (misses, after) else int(after - misses),
                                "query": query,
                                "server_args": " ".join(map(str, [module or "s2s serve", *server_args])),
                                **summarize(results),
                            }
                        )
                        # each level as it finishes: a run cut short keeps what it measured
                        write_json(args.json, [{**env, **r} for r in rows])
                        bar.update()
    columns = [
        ("system", "system"),
        ("mode", "mode"),
        ("protocol", "protocol"),
        ("silence_ms", "silence ms"),
        ("concurrency", "N"),
        ("answered", "answered"),
        ("refusals", "refused"),
        ("turn_latency_ms_p50", "turn p50 ms"),
        ("turn_latency_ms_p95", "turn p95 ms"),
        *((f"{s}_ms_p50", f"{s} ms") for s in STAGES),
        ("deadline_misses", "deadline misses"),
    ]
    tables = print_table(
        f"Turn latency, {PRESET} preset both sides (duplex: last user frame in -> first audio computed with it out)",
        [{**r, "silence_ms": "-" if r["silence_ms"] is None else r["silence_ms"]} for r in rows],
        columns,
    )
    tables += print_table(
        "Targets (p50s of this run)",
        targets(rows),
        [
            ("cascade", "cascade"),
            ("silence_ms", "silence ms"),
            ("concurrency", "N"),
            ("cascade_p50_ms", "cascade p50"),
            ("turn_p50_ms", "turn p50"),
            ("gap_ms", "gap"),
            ("stt_plus_llm_ms", "cascade STT+LLM"),
            ("turn_ahead_by_stt_llm", "turn ahead >= STT+LLM"),
            ("gap_wider_than_lower_n", "gap widens"),
            ("realtime_over_moshi", "realtime / moshi"),
            ("duplex_over_cascade", "duplex / cascade"),
            ("duplex_at_most_third", "duplex <= 1/3"),
        ],
    )
    env["bench_peak_rss_bytes"] = peak_rss_bytes()
    plot(rows, args.plot, device)
    save_outputs(args, [{**env, **r} for r in rows], tables)


if __name__ == "__main__":
    main()
