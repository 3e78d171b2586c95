"""VAD flood benchmark: what spurious turns cost at N listening sessions, with and without flood control.

    s2s bench vad-flood [--quick] [--json PATH] [--plot PATH] [--levels 10,25,50,100,200] [--seconds 50]
        [--model DIR | --preset NAME]

Two stages, so that 200 sessions fit a 2-core machine honestly:
1. Offline, faster than real time: `server/vad/endpointer.py`'s `Endpointer` (Silero) runs over `--track-s` seconds
   of each noise kind (`bench/noise.py`: babble, street, pink, music, a far speaker) with one of the bench's sentences
   (espeak-ng, 15 to 20 dB over the noise) every `--turn-every` seconds or so, once as it was before flood control
   (`PLAIN`: every stretch of speech is a turn, no take-back) and once with it (`VadConfig()`). The first table is
   the endpointer's turns per session-hour of noise, by kind: spurious, confident, dropped, taken back; and what
   becomes of the user's sentences (found, and how long after the speech ended the turn ended).
2. In real time: N turn-mode sessions in an in-process `Engine` on the weights a user runs: by default the shipped
   echo model (what `s2s serve` serves with no flags), or `--model DIR` (a model of EnCodec's frames), or `--preset
   NAME` (seeded weights); each row's `model` says which. Codec-free: each session is fed random codes at 75 frames a
   second in 80 ms blocks, its noise as context; the codec would take both cores at N = 200 and is the same with or
   without the control. Session i hears noise kind i mod 5 from a
   random offset, and replays that timeline's events as the server's receive loop does: a speech start is a barge-in
   (`Engine.interrupt` with the frames played), a take-back an interrupt with 0 frames, an end of turn
   `Engine.end_turn`, through the server's `TurnGate` with the control. Events in the last 2 s are left out, so every
   turn has time for its first audio.
Per level and arm: real turns' time to first audio (the engine's own stamps, end of turn -> first reply frame out),
p50/p95; spurious turns sent, replies to them and their frames; turns the gate dropped; the engine's busy share. At
the largest level a third arm, the oracle, sends only the real turns' ends: the best a flood control could do.
The engine admits all N (`admission_headroom` 1000) and takes `--prefill-budget` steps a tick, so that N = 200
sessions' listening keeps up: the measure is what their false turns cost, not admission.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

from bench.common import (
    ModelChoice,
    add_model_args,
    environment,
    model_choice,
    parser,
    percentiles,
    print_table,
    save_outputs,
    write_json,
)
from bench.noise import KINDS
from bench.noise_turns import BLOCK_S, PLAIN, Timeline, VadEvent, endpoint, spurious_row, track
from codec.pcm import SAMPLE_RATE
from s2s import CodesEvent, Engine, EngineConfig, S2SModel, SamplingParams
from s2s.engine.config import CODES_ONLY_FRAME_SIZE
from server.vad.config import VadConfig
from server.vad.turn_gate import TurnGate

FRAME_S = CODES_ONLY_FRAME_SIZE / SAMPLE_RATE  # the frame of the codec-free engine this bench feeds codes to
FRAMES_PER_BLOCK = round(BLOCK_S / FRAME_S)  # 6: a client's 80 ms block
DRAIN_S = 2.0  # no events this close to a session's end: every turn has time for its first audio


@dataclass
class Turns:
    """A level's turns as the engine answered them, filled in by the event reader."""

    sent: dict[str, list[tuple[float, bool]]]  # session -> (engine clock at end_turn, real) for each end sent
    latency: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})  # real? -> TTFA s
    frames: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # real? -> reply frames out
    real: dict[tuple[str, int], bool] = field(default_factory=dict)  # (session, turn) -> whether a real turn's
    latest: dict[str, tuple[int, float, int]] = field(default_factory=dict)  # session -> turn, first out, frames

    def take(self, event: CodesEvent) -> None:
        key, n = (event.session, event.turn), event.codes.shape[-1]
        if key not in self.real:
            ended = event.times["end_of_turn"]
            self.real[key] = next((r for t, r in reversed(self.sent[event.session]) if t <= ended + 1e-3), False)
            self.latency[self.real[key]].append(event.times["first_audio_out"] - ended)
            self.latest[event.session] = (event.turn, time.perf_counter(), 0)
        self.frames[self.real[key]] += n
        turn, first, frames = self.latest[event.session]
        if turn == event.turn:
            self.latest[event.session] = (turn, first, frames + n)

    def played(self, session: str) -> int:
        """Frames of the session's latest reply its user has heard (they play in real time from the first)."""
        _, first, frames = self.latest.get(session, (0, 0.0, 0))
        return min(frames, int((time.perf_counter() - first) / FRAME_S))


def session_events(
    timeline: Timeline, offset: float, track_s: float, seconds: float, oracle: bool = False
) -> dict[int, list[VadEvent]]:
    """One session's events: the timeline from `offset` (wrapping), by 80 ms block. `oracle`: only the real turns'
    ends, what a perfect endpointer would send."""
    out: dict[int, list[VadEvent]] = {}
    for e in timeline.events:
        at = (e.t - offset) % track_s
        if at < seconds - DRAIN_S and (e.real or not oracle):
            out.setdefault(int(at / BLOCK_S), []).append(e)
    return out


def read_events(engine: Engine, ready: queue.SimpleQueue, turns: Turns) -> None:
    while (cid := ready.get()) is not None:
        q = engine.event_queue(cid)
        while not q.empty():
            if isinstance(event := q.get_nowait(), CodesEvent):
                turns.take(event)


def level_engine(model: S2SModel, n: int, args) -> Engine:
    """An engine that admits all `n` sessions and whose prefill keeps up with their listening."""
    pages = n * (int(args.seconds / FRAME_S + 4 * args.reply_frames) // 16 + 8)
    cfg = EngineConfig(
        cache_mode="paged",  # noise shares no prefixes
        max_conversations=n,
        frames_per_tick=4,
        prefill_budget=args.prefill_budget,
        max_reply_frames=args.reply_frames,
        admission_headroom=1000.0,
        num_pages=pages,
    )
    return Engine(model, None, cfg)


def feed(
    engine: Engine, timelines: list[dict[int, list[VadEvent]]], turns: Turns, gate: TurnGate | None, seconds: float
) -> dict:
    """Each session's codes and events, block by block in real time, as the server's receive loop passes them on:
    barge-ins and take-backs before the block's audio, an end of turn (through the gate, if any) after it."""
    cids = list(turns.sent)
    k, rng = engine.model.config.num_codebooks, np.random.default_rng(0)
    codes = rng.integers(0, engine.model.config.codebook_size, (len(cids), k, 4096))
    blocks, lag, real_dropped = int(seconds / BLOCK_S), 0.0, 0
    t0 = time.perf_counter()
    for b in range(blocks):
        lag = max(lag, time.perf_counter() - (t0 + b * BLOCK_S))
        for i, cid in enumerate(cids):
            events = timelines[i].get(b, [])
            for e in events:
                if e.kind in ("speech_start", "take_back"):
                    engine.interrupt(cid, turns.played(cid) if e.kind == "speech_start" else 0)
            a = (b * FRAMES_PER_BLOCK + 97 * i) % (codes.shape[-1] - FRAMES_PER_BLOCK)
            engine.push_codes(cid, codes[i, :, a : a + FRAMES_PER_BLOCK])
            for e in events:
                if e.kind != "end_of_turn":
                    continue
                if gate is not None and not gate.admit(e.turn):
                    real_dropped += e.real
                    continue
                turns.sent[cid].append((engine.clock(), e.real))
                engine.end_turn(cid)
        time.sleep(max(0.0, t0 + (b + 1) * BLOCK_S - time.perf_counter()))
    return {"wall_s": time.perf_counter() - t0, "feeder_lag_ms": 1000 * lag, "real_dropped": real_dropped}


def run_level(model: S2SModel, timelines: list[dict[int, list[VadEvent]]], args, control: bool) -> dict:
    engine = level_engine(model, len(timelines), args)
    gate = TurnGate(engine, VadConfig()) if control else None
    cids = [engine.open("turn", sampling=SamplingParams(seed=i)) for i in range(len(timelines))]
    turns, ready = Turns({cid: [] for cid in cids}), queue.SimpleQueue()
    for cid in cids:
        engine.event_queue(cid).on_put = functools.partial(ready.put, cid)
    reader = threading.Thread(target=read_events, args=(engine, ready, turns), daemon=True)
    reader.start()
    engine.start()
    before = engine.snapshot().stats
    fed = feed(engine, timelines, turns, gate, args.seconds)
    after = engine.snapshot().stats
    engine.stop()
    ready.put(None)
    reader.join()
    sent = [real for ends in turns.sent.values() for _, real in ends]
    real, spurious = turns.latency[True], turns.latency[False]
    pct = percentiles(real, 1000) if real else dict.fromkeys(("p50", "p95", "p99"), float("nan"))
    busy = after.busy_seconds - before.busy_seconds
    return {
        "real_sent": sum(sent),
        "real_answered": len(real),
        "ttfa_ms_p50": pct["p50"],
        "ttfa_ms_p95": pct["p95"],
        "ttfa_ms_p99": pct["p99"],
        "spurious_sent": len(sent) - sum(sent),
        "spurious_replies": len(spurious),
        "spurious_reply_frames": turns.frames[False],
        "real_reply_frames": turns.frames[True],
        "gate_dropped": gate.dropped["saturated"] if gate else 0,
        "busy_share": busy / fed["wall_s"],
        "tick_ms_mean": 1000 * busy / max(after.ticks - before.ticks, 1),
        "max_context": engine.cfg.max_context,
        **fed,
    }


def endpointer_stage(args, cfg: VadConfig) -> tuple[dict[str, Timeline], dict[str, Timeline], list[dict]]:
    """Stage 1: each noise kind's timeline, plain and with flood control, and the endpointer's table rows."""
    plain, control, rows = {}, {}, []
    for kind in tqdm(KINDS, desc="endpointer"):
        tr = track(kind, args.track_s, args.turn_every)
        plain[kind], control[kind] = endpoint(tr, PLAIN), endpoint(tr, cfg)
        rows.append({"bench": "vad-flood", "table": "endpointer", **spurious_row(tr, plain[kind], control[kind], cfg)})
    return plain, control, rows


def replay_stage(args, choice: ModelChoice, levels: list[int], plain: dict, control: dict) -> list[dict]:
    """Stage 2: each level, both arms, the same sessions (noise kind and offset) in each; at the largest level also
    the oracle (the plain timelines' real turns only: the best any flood control could do)."""
    model, _ = choice.load()  # (its codec is not used: codes go straight in)
    rng, rows = np.random.default_rng(1), []
    names = ("seconds", "track_s", "turn_every", "reply_frames", "prefill_budget")
    params = {name: getattr(args, name) for name in names} | {"model": choice.label, "preset": choice.preset}
    params |= environment()
    for n in tqdm(levels, desc="levels"):
        offsets = rng.uniform(0, args.track_s, n)
        arms = [("plain", plain), ("control", control)] + [("oracle", plain)] * (n == max(levels))
        for arm, timelines in arms:
            kinds = [timelines[KINDS[i % len(KINDS)]] for i in range(n)]
            sessions = [
                session_events(k, offsets[i], args.track_s, args.seconds, arm == "oracle") for i, k in enumerate(kinds)
            ]
            row = run_level(model, sessions, args, control=arm == "control")
            rows.append({"bench": "vad-flood", "table": "replay", "arm": arm, "sessions": n, **params, **row})
            write_json(args.json, rows)
    return rows


def targets(rows: list[dict]) -> str:
    """The issue's targets: at the largest N, real turns' p95 with the control against the smallest N's (and the
    oracle's); and the waste without it."""
    arm = {(r["arm"], r["sessions"]): r for r in rows}
    low, high = min(r["sessions"] for r in rows), max(r["sessions"] for r in rows)
    ratio = arm["control", high]["ttfa_ms_p95"] / arm["control", low]["ttfa_ms_p95"]
    plain, best = arm["plain", high], arm["control", high]["ttfa_ms_p95"] / arm["oracle", high]["ttfa_ms_p95"]
    return (
        f"control: real turns' TTFA p95 at N = {high} is {ratio:.2f}x that at N = {low} (target: within 1.10x), "
        f"{best:.2f}x the oracle's at N = {high}; without it, at N = {high}: {plain['spurious_replies']} replies to "
        "spurious turns, "
        f"{plain['spurious_reply_frames'] * FRAME_S:.1f} s of reply audio, engine busy {plain['busy_share']:.2f} "
        f"(control: {arm['control', high]['busy_share']:.2f})"
    )


def main() -> None:
    p = parser("vad-flood", __doc__.splitlines()[0])
    p.add_argument("--levels", default="10,25,50,100,200", help="numbers of listening sessions")
    p.add_argument("--seconds", type=float, default=50.0, help="real time each level runs, per arm")
    p.add_argument("--track-s", type=float, default=480.0, help="seconds of each noise kind the endpointer hears")
    p.add_argument("--turn-every", type=float, default=60.0, help="seconds between a session's real turns, about")
    add_model_args(p)
    p.add_argument("--reply-frames", type=int, default=150, help="longest reply (75 frames a second)")
    p.add_argument("--prefill-budget", type=int, default=1024, help="engine prefill steps a tick")
    args = p.parse_args()
    choice = model_choice(args)
    if choice.frame_size != CODES_ONLY_FRAME_SIZE:
        raise SystemExit(
            f"--model: {choice.label}'s codec has {choice.frame_size}-sample frames; this bench feeds codes "
            f"at the codec-free engine's {CODES_ONLY_FRAME_SIZE} (EnCodec's)"
        )
    levels = [int(x) for x in args.levels.split(",")]
    if args.quick:
        levels, args.seconds, args.track_s, args.turn_every = [10, 50], 8.0, 40.0, 12.0
    torch.set_num_threads(1)
    cfg = VadConfig()
    plain, control, noise_rows = endpointer_stage(args, cfg)
    tables = print_table(
        f"Endpointer over noise ({args.track_s:g} s of each): turns per session-hour, plain = before flood control",
        noise_rows,
        [
            ("noise", "noise"),
            ("speech_time_pct", "speech time %"),
            ("turns_per_h_plain", "turns/h plain"),
            ("turns_per_h_control", "turns/h control"),
            ("confident_per_h_control", "confident/h"),
            ("short_per_h", "short/h"),
            ("unsure_per_h", "unsure/h"),
            ("take_backs_per_h", "taken back/h"),
            ("real_found_pct_plain", "sentences found % plain"),
            ("real_found_pct_control", "% control"),
            ("real_confident_pct", "% confident"),
            ("end_delay_ms_p50_plain", "end delay p50 ms plain"),
            ("end_delay_ms_p50_control", "control"),
            ("end_delay_ms_p95_plain", "p95 plain"),
            ("end_delay_ms_p95_control", "control"),
        ],
    )
    replay = replay_stage(args, choice, levels, plain, control)
    tables += print_table(
        f"N turn-mode sessions over noise, replayed in real time ({choice.label}, codec-free, "
        f"{args.seconds:g} s): TTFA = end of turn -> first reply frame out of the engine",
        replay,
        [
            ("arm", "arm"),
            ("sessions", "N"),
            ("real_sent", "real turns"),
            ("real_answered", "answered"),
            ("ttfa_ms_p50", "TTFA p50 ms"),
            ("ttfa_ms_p95", "p95 ms"),
            ("spurious_sent", "spurious sent"),
            ("spurious_replies", "spurious replies"),
            ("spurious_reply_frames", "spurious frames"),
            ("gate_dropped", "gate dropped"),
            ("busy_share", "engine busy"),
            ("tick_ms_mean", "tick ms"),
            ("feeder_lag_ms", "feeder lag ms"),
        ],
    )
    print(summary := targets(replay))
    plot(replay, args.plot)
    save_outputs(args, noise_rows + replay, [*tables, summary])


def plot(rows: list[dict], path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for arm, color in (("plain", "tab:red"), ("control", "tab:blue"), ("oracle", "tab:green")):
        rs = [r for r in rows if r["arm"] == arm]
        n = [r["sessions"] for r in rs]
        axes[0].plot(n, [r["ttfa_ms_p95"] for r in rs], "o-", color=color, label=f"{arm} p95")
        axes[0].plot(n, [r["ttfa_ms_p50"] for r in rs], "x--", color=color, label=f"{arm} p50")
        axes[1].plot(n, [r["spurious_reply_frames"] * FRAME_S for r in rs], "o-", color=color, label=arm)
        axes[2].plot(n, [r["busy_share"] for r in rs], "o-", color=color, label=arm)
    titles = ["real turns: time to first reply frame (ms)", "reply audio made for spurious turns (s)", "engine busy"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_xticks(n, [str(x) for x in n], minor=False)
        ax.minorticks_off()
        ax.set_xlabel("listening sessions")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("VAD flood: N turn-mode sessions over noise, with and without flood control")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
