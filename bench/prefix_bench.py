"""Prefix benchmark: the four cache modes (naive, paged, exact, radix) on audio workloads, one engine, one run.

    s2s bench prefix [--quick] [--preset small] [--rounds N] [--workloads NAME ...] [--json PATH] [--plot PATH]

In-process, no sockets: one `Engine` per mode, built identically but for `cache_mode`, driven by hand
(`engine.step()` as fast as it goes, the wall clock as its clock), with the same arrivals, audio and seeds, modes
back to back. Turn mode throughout. A user turn is espeak-ng speech (synthesized once) that arrives as
a client sends it (`--user-turn streamed`, the default: 80 ms blocks in real time, each once its last sample has
been spoken) or as SGLang's benchmark sends whole requests (`--user-turn whole`: `push_audio` of the utterance,
then `end_turn`, at once). TTFA runs from that `end_turn` call (right after the last block) to the
`first_audio_out` stamp of the reply's first AudioEvent, so it holds encoding what is not encoded yet (the same
work in every mode), prefill of whatever the cache did not give back and the user's speech did not hide, the first
steps and the first decode; the rows split it at `reply_start` (audio encoded) and `prefill_done`. Prompts are
codes: a group's prompt is random codes; with shared fraction f, a conversation's prompt is its group's first
f * P frames then P - f * P random frames of its own (SGLang's generated-shared-prefix benchmark: system prompt,
then a question).

Workloads (SGLang's defaults are 64 groups x 16 prompts, a 2,048-token system prompt, 128-token questions and
256-token outputs; scaled down to the tiny preset on 2 CPU cores, numbers in every JSON row):
- shared: G groups x S conversations arriving as a Poisson process (4 a second, the same times in every mode),
  prompts of P frames, shared fraction 0 / 30 / 60 / 90 % (P is not a multiple of the page, so shared prefixes end
  mid-page), one turn each;
- shared, at once: the same, every conversation arriving at t = 0, as SGLang's benchmark sends them (request rate
  inf). The engine re-matches the cache when it schedules a prefill and computes a page that several waiting
  conversations share once, so conversations that arrive together share what the first of them computes;
- long prompts, at once: a few conversations (4) at t = 0 on prompts of 2,048 frames (SGLang's system-prompt
  length; 27 s of audio), sharing 60 or 90 %: the prefill that is left when the user stops speaking is where a
  cache can shorten TTFA, and this is the workload that leaves some (with a model whose prefill is not free);
- multiturn: S conversations of 5 turns; between turns the client hangs up and comes back (`resume=True`), so each
  turn reopens with the whole history, as SGLang's multi-turn benchmark resends it (a live conversation keeps its
  K/V in every mode);
- branching: a reply regenerated, a reply cut by barge-in mid-page (11 frames heard), then another turn; prompts
  share 2/3 of the group prompt (a non-page-aligned point);
- unique: shared fraction 0 and every prompt its own (no reuse possible: the cost of the cache's bookkeeping);
- pressure: L long conversations take turn after turn; after their second turn a burst of B new conversations
  arrives at once; the K/V budget is half the pages all of them would hold together. TTFA of the long
  conversations (their first turn apart) is split into before, during and after the burst. Run twice: with the
  engine's admission control (its cost model may refuse an open; the script retries every 50 ms) and, but for
  --quick, without.
A last table opens conversations on one shared prompt (each with its own one-turn tail of codes) in a fixed pool
until one cannot get its pages (naive: until `open` refuses: it reserves `max_context` = 4,096 steps up front).

Every engine: one torch thread (see `main`), tiny preset, EnCodec 1.5 kbps (K = 2), pages of 16 steps, 4 frames
per tick, prefill budget 256 steps per tick (the engine's default), `calibration_ticks=0`, replies of R frames
(`max_reply_frames`), max_context 4,096. Sampling is seeded per conversation, so every mode produces the same
replies. Admission by tick cost is off (`admission_headroom=inf`: every mode sees the same arrivals; naive still
refuses when its reservation does not fit) except in one pressure run. Every (workload, mode) runs `rounds` times
with the order of modes rotating, TTFA samples pooled. Each round has its own seed (arrival times, prompts), the same
in every mode: on this CPU a run of 16 conversations near saturation is one queueing history, and its TTFA p50 moves
severalfold from one arrival pattern to the next (`ttfa_ms_p50_rounds`), so repeating one pattern measures that
pattern, not the cache. The ratio table gives each radix ratio a 90 % interval from a paired bootstrap over rounds
(`round_interval`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import asdict, dataclass, field, replace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

from bench.common import environment, parser, percentiles, print_table, save_outputs
from cache import CacheStats
from codec import EncodecTokenizer
from codec.tokenizer import SAMPLE_RATE
from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine import FRAME_S, AudioEvent, Engine, EngineConfig, MetaEvent, Refused
from server.client import BLOCK  # user audio in 80 ms blocks when streamed
from server.speech import synthesize

MODES = ("naive", "paged", "exact", "radix")
PAGE, FRAMES_PER_TICK, MAX_CONTEXT, PREFILL_BUDGET = 16, 4, 4096, 256
WORDS_PER_MINUTE = 220
LONG = "long prompts, at once"  # a few conversations at t = 0 on prompts of SGLang's length (2,048)
AT_ONCE = "shared, at once"  # the shared workload with every conversation arriving at t = 0, as SGLang sends it
WORKLOADS = ["shared", AT_ONCE, LONG, "multiturn", "branching", "unique", "pressure"]
BARGE_IN_FRAMES = 11  # frames of the reply the user hears before speaking over it (not a page boundary)
QUESTIONS = [
    "Will it rain tomorrow?",
    "Book a table for two.",
    "Tell me a story.",
    "When is the next train?",
    "How far is the station?",
    "Play some music.",
    "What time is it?",
    "Call my sister.",
]

# a row's TTFA and its stages (`summarize`), as table columns (key, header)
TTFA_COLUMNS = [
    ("ttfa_ms_p50", "TTFA p50 ms"),
    ("ttfa_ms_p95", "TTFA p95 ms"),
    ("ttfa_ms_p99", "TTFA p99 ms"),
    ("encode_queue_ms_p50", "encode+queue p50"),
    ("prefill_ms_p50", "prefill p50"),
    ("first_audio_ms_p50", "to audio p50"),
]

Wait = Callable[[], bool]
Script = Generator[Wait, None, None]


@dataclass
class Scale:
    """The run's shape (scaled down from SGLang's defaults; see the module docstring)."""

    groups: int
    per_group: int
    prompt_frames: int
    reply_frames: int
    fractions: list[float]
    turns: int
    long_convs: int
    long_turns: int
    burst: int
    fit_pages: int
    arrival_rate: float  # conversations per second (Poisson), shared/multiturn/branching/unique
    rounds: int  # every (workload, mode) is run this often, each round its own seed; TTFA samples pooled
    long_prompt_frames: int = 2048  # "long prompts, at once": SGLang's system-prompt length, in frames
    long_prompt_convs: int = 4
    question_s: float | None = None  # questions cut to this many seconds (--quick: streamed turns take real time)
    stall_s: float = 4.0  # a run with no audio out and no open this long has stalled (`Driver.run`)


QUICK = Scale(2, 2, 150, 24, [0.6], 3, 2, 3, 6, 512, 8.0, 1, 600, 2, question_s=0.4, stall_s=1.5)
FULL = Scale(4, 4, 300, 32, [0.0, 0.3, 0.6, 0.9], 5, 4, 6, 12, 1024, 4.0, 3)


@dataclass
class Driver:
    """Runs conversation scripts against one engine: each script yields a condition to wait for; between
    rounds of scripts the engine takes one tick. Records TTFA per label, audio out, refusals, peak K/V."""

    engine: Engine | None  # None once its run is over
    ttfa: dict[str, list[float]] = field(default_factory=dict)
    stages: list[tuple[float, float, float]] = field(default_factory=list)  # (encode+queue, prefill, to audio)
    expecting: dict[str, tuple[float, str]] = field(default_factory=dict)  # cid -> (end of turn, label)
    replies_done: dict[str, int] = field(default_factory=dict)
    heard: dict[str, int] = field(default_factory=dict)  # frames of the current reply received
    frames_out: int = 0
    refusals: int = 0
    peak_pages: int = 0
    stalled: int = 0
    t0: float = 0.0
    opened: int = 0
    last_arrival: float = 0.0  # seconds after the start; no stall is called before it
    streamed: bool = True  # user turns arrive in real time (`say`)

    def after(self, seconds: float) -> Wait:
        """Wait until `seconds` after the run started (arrival times)."""
        return lambda: time.perf_counter() - self.t0 >= seconds

    def run(self, scripts: Iterable[Script], stall_s: float = 4.0) -> float:
        """Run every script to its end; returns the wall seconds. A run where no audio comes out and no conversation
        opens for `stall_s` stops, and counts the scripts left as stalled."""
        live: list[tuple[Script, Wait | None]] = [(s, None) for s in scripts]
        self.t0 = last_progress = time.perf_counter()
        while live:
            kept = []
            for script, wait in live:
                try:
                    while wait is None or wait():
                        wait = next(script)
                    kept.append((script, wait))
                except StopIteration:
                    pass
            live = kept
            frames, opened = self.frames_out, self.opened
            self.engine.step()
            self._drain()
            s = self.engine.cache.stats()
            self.peak_pages = max(self.peak_pages, s.private + s.cached_locked)
            now = time.perf_counter()
            if self.frames_out > frames or self.opened > opened or now - self.t0 < self.last_arrival:
                last_progress = now
            elif now - last_progress > stall_s:
                self.stalled = len(live)
                break
        return time.perf_counter() - self.t0

    def _drain(self) -> None:
        for cid in list(self.engine.convs):
            q = self.engine.event_queue(cid)
            while not q.empty():
                event = q.get()
                if isinstance(event, AudioEvent):
                    self.frames_out += len(event.pcm) // 320
                    self.heard[cid] = self.heard.get(cid, 0) + len(event.pcm) // 320
                    if cid in self.expecting:
                        end, label = self.expecting.pop(cid)
                        t = event.times
                        self.ttfa.setdefault(label, []).append(t["first_audio_out"] - end)
                        start, prefilled = t["reply_start"], t.get("prefill_done", t["reply_start"])
                        self.stages.append((start - end, prefilled - start, t["first_audio_out"] - prefilled))
                elif isinstance(event, MetaEvent) and event.data.get("event") == "reply_done":
                    self.replies_done[cid] = self.replies_done.get(cid, 0) + 1

    # ---- steps a script is made of (each a generator: `yield from`) --------------------------------------------

    def open(self, **kwargs) -> Generator[Wait, None, str]:
        """Open a turn-mode conversation; a refused open is counted and retried every 50 ms."""
        while True:
            try:
                cid = self.engine.open("turn", **kwargs)
                self.opened += 1
                return cid
            except Refused:
                self.refusals += 1
                yield at(time.perf_counter() + 0.05)

    def speak(self, cid: str, pcm: np.ndarray, label: Callable[[], str] | str) -> Script:
        """The user's turn (see `say`); wait for the whole reply."""
        done = self.replies_done.get(cid, 0)
        yield from self.say(cid, pcm, label)
        yield lambda: self.replies_done.get(cid, 0) > done

    def say(self, cid: str, pcm: np.ndarray, label: Callable[[], str] | str) -> Script:
        """The user's turn reaches the engine, whole (pushed at once, as SGLang sends a request) or streamed (80 ms
        blocks, each once its last sample has been spoken, as `s2s client` and a microphone send them); then
        `end_turn`, from which TTFA runs."""
        if self.streamed:
            start = time.perf_counter()
            for a in range(0, len(pcm), BLOCK):
                block = pcm[a : a + BLOCK]
                yield at(start + (a + len(block)) / SAMPLE_RATE)
                self.engine.push_audio(cid, block)
        else:
            self.engine.push_audio(cid, pcm)
        self.engine.end_turn(cid)
        self.expect(cid, label if isinstance(label, str) else label())

    def expect(self, cid: str, label: str) -> None:
        self.expecting[cid] = (time.perf_counter(), label)
        self.heard[cid] = 0

    def regenerate(self, cid: str, label: str) -> Script:
        done = self.replies_done.get(cid, 0)
        self.engine.regenerate(cid)
        self.expect(cid, label)
        yield lambda: self.replies_done.get(cid, 0) > done

    def barge_in(self, cid: str, pcm: np.ndarray, label: str) -> Script:
        """Speak, and cut the reply once `BARGE_IN_FRAMES` frames of it were heard."""
        yield from self.say(cid, pcm, label)
        yield lambda: self.heard[cid] >= BARGE_IN_FRAMES
        self.engine.interrupt(cid, played_frames=BARGE_IN_FRAMES)


def at(t: float) -> Wait:
    return lambda: time.perf_counter() >= t


# ---- workloads -------------------------------------------------------------------------------------------------


class Workload:
    """Prompts and questions for one workload, the same for every mode (seeded)."""

    def __init__(self, scale: Scale, clips: list[np.ndarray], seed: int):
        self.scale, self.clips = scale, clips
        self.rng = np.random.default_rng(seed)
        self.group_prompts = [self.rng.integers(0, 1024, size=(2, scale.prompt_frames)) for _ in range(scale.groups)]
        n = scale.groups * scale.per_group
        gaps = self.rng.exponential(1 / scale.arrival_rate, size=n - 1)
        self.arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
        self._long_seed = 10_000 + seed

    def prompt(self, group: int, fraction: float) -> np.ndarray:
        shared = round(fraction * self.scale.prompt_frames)
        own = self.rng.integers(0, 1024, size=(2, self.scale.prompt_frames - shared))
        return np.concatenate([self.group_prompts[group][:, :shared], own], axis=1)

    def long_prompt(self, fraction: float) -> np.ndarray:
        """A `long_prompt_frames` prompt whose first `fraction` is one shared prompt (its own seeded stream, so the
        other workloads' prompts do not depend on it)."""
        n = self.scale.long_prompt_frames
        rng = np.random.default_rng(self._long_seed)
        self._long_seed += 1
        shared = round(fraction * n)
        common = np.random.default_rng(4242).integers(0, 1024, size=(2, n))[:, :shared]
        return np.concatenate([common, rng.integers(0, 1024, size=(2, n - shared))], axis=1)


def shared_scripts(d: Driver, w: Workload, fraction: float) -> list[Script]:
    d.last_arrival = float(w.arrivals.max())

    def conv(i: int, prompt: np.ndarray) -> Script:
        yield d.after(w.arrivals[i])
        cid = yield from d.open(prompt=prompt, sampling=SamplingParams(seed=i))
        yield from d.speak(cid, w.clips[i % len(w.clips)], "turn")
        d.engine.close(cid)

    n = w.scale.groups * w.scale.per_group
    return [conv(i, w.prompt(i % w.scale.groups, fraction)) for i in range(n)]


def long_prompt_scripts(d: Driver, w: Workload, fraction: float) -> list[Script]:
    """`long_prompt_convs` conversations at t = 0 on long prompts sharing `fraction`, one turn each."""

    def conv(i: int, prompt: np.ndarray) -> Script:
        cid = yield from d.open(prompt=prompt, sampling=SamplingParams(seed=i))
        yield from d.speak(cid, w.clips[i % len(w.clips)], "turn")
        d.engine.close(cid)

    return [conv(i, w.long_prompt(fraction)) for i in range(w.scale.long_prompt_convs)]


def multiturn_scripts(d: Driver, w: Workload) -> list[Script]:
    d.last_arrival = float(w.arrivals.max())

    def conv(i: int, prompt: np.ndarray) -> Script:
        yield d.after(w.arrivals[i])
        cid = yield from d.open(prompt=prompt, sampling=SamplingParams(seed=i))
        for turn in range(w.scale.turns):
            if turn:
                yield from d.open(session_id=cid, resume=True, sampling=SamplingParams(seed=100 * i + turn))
            yield from d.speak(cid, w.clips[(i + turn) % len(w.clips)], "first turn" if turn == 0 else "later turns")
            d.engine.close(cid)

    return [conv(i, w.prompt(i % w.scale.groups, 0.6)) for i in range(w.scale.per_group)]


def branching_scripts(d: Driver, w: Workload) -> list[Script]:
    d.last_arrival = float(w.arrivals.max())

    def conv(i: int, prompt: np.ndarray) -> Script:
        yield d.after(w.arrivals[i])
        cid = yield from d.open(prompt=prompt, sampling=SamplingParams(seed=i))
        clips = [w.clips[(i + k) % len(w.clips)] for k in range(3)]
        yield from d.speak(cid, clips[0], "turn")
        yield from d.regenerate(cid, "regenerate")
        yield from d.barge_in(cid, clips[1], "turn")
        yield from d.speak(cid, clips[2], "after barge-in")
        d.engine.close(cid)

    n = w.scale.groups * w.scale.per_group
    return [conv(i, w.prompt(i % w.scale.groups, 2 / 3)) for i in range(n)]


def pressure_scripts(d: Driver, w: Workload, phase: dict) -> list[Script]:
    """Long conversations take turns back to back; once each has finished two, the burst opens at once."""
    s = w.scale

    def label(first: bool) -> str:
        if first:
            return "first turn"
        return "during" if phase["burst_end"] is None and phase["burst_start"] else phase["name"]

    def long(i: int, prompt: np.ndarray) -> Script:
        cid = yield from d.open(prompt=prompt, sampling=SamplingParams(seed=i))
        for turn in range(s.long_turns):
            first = turn == 0  # its prompt's prefill is in it: kept apart from before/during/after
            yield from d.speak(cid, w.clips[(i + turn) % len(w.clips)], lambda f=first: "long " + label(f))
            phase["turns_done"] += 1
        d.engine.close(cid)

    def burst(i: int, prompt: np.ndarray) -> Script:
        yield lambda: phase["turns_done"] >= 2 * s.long_convs
        phase["burst_start"] = phase["burst_start"] or time.perf_counter()
        cid = yield from d.open(prompt=prompt, sampling=SamplingParams(seed=1000 + i))
        yield from d.speak(cid, w.clips[i % len(w.clips)], "burst")
        d.engine.close(cid)
        phase["burst_left"] -= 1
        if not phase["burst_left"]:
            phase["burst_end"], phase["name"] = time.perf_counter(), "after"

    longs = [long(i, w.prompt(i % s.groups, 0.0)) for i in range(s.long_convs)]
    bursts = [burst(i, w.prompt(0, 0.6)) for i in range(s.burst)]
    return longs + bursts


def pressure_working_set(w: Workload) -> int:
    """Pages every conversation of the pressure workload would hold at its longest, all at once."""
    s, delay = w.scale, 2
    clip_frames = [math.ceil(len(c) / 320) + delay for c in w.clips]
    longs = [
        s.prompt_frames + sum(clip_frames[(i + t) % len(clip_frames)] + s.reply_frames for t in range(s.long_turns))
        for i in range(s.long_convs)
    ]
    bursts = [s.prompt_frames + clip_frames[i % len(clip_frames)] + s.reply_frames for i in range(s.burst)]
    return sum(math.ceil(n / PAGE) + 1 for n in longs + bursts)


# ---- one measured run -------------------------------------------------------------------------------------------


def make_engine(model: S2SModel, tok: EncodecTokenizer, mode: str, num_pages: int, scale: Scale, **kw) -> Engine:
    cfg = EngineConfig(
        cache_mode=mode,
        page_size=PAGE,
        num_pages=num_pages,
        max_context=MAX_CONTEXT,
        frames_per_tick=FRAMES_PER_TICK,
        max_reply_frames=scale.reply_frames,
        prefill_budget=PREFILL_BUDGET,
        calibration_ticks=0,
        **{"admission_headroom": math.inf, **kw},
    )
    return Engine(model, tok, cfg)


@dataclass
class Run:
    """One run of one workload on one engine: the driver's records and the engine's counters (the engine itself,
    and its K/V pool, are let go: 132 pools of a full run would not fit in memory)."""

    driver: Driver
    wall: float
    conversations: int
    compute_s: float
    cache: CacheStats
    deadline_misses: int
    out_of_pages: int
    prefill_steps: int
    bytes_per_page: int
    num_pages: int


def run_once(engine: Engine, scripts_of: Callable[[Driver], list[Script]], streamed: bool, stall_s: float) -> Run:
    d = Driver(engine, streamed=streamed)
    scripts = scripts_of(d)
    wall = d.run(scripts, stall_s)
    run = Run(
        d,
        wall,
        len(scripts),
        engine.stats.busy_seconds,  # every tick (`tick_seconds` keeps only the last 10,000)
        engine.cache.stats(),
        engine.stats.deadline_misses,
        engine.stats.out_of_pages,
        engine.stats.prefill_steps,
        engine.pool.bytes_per_page,
        engine.pool.num_usable,
    )
    d.engine = None
    return run


def summarize(runs: list[Run]) -> dict:
    """The measures over every round of one (workload, mode): TTFA samples pooled, audio and wall summed."""
    ttfa: dict[str, list[float]] = {}
    for r in runs:
        for label, ts in r.driver.ttfa.items():
            ttfa.setdefault(label, []).extend(ts)
    all_ttfa = [t for ts in ttfa.values() for t in ts]
    p = percentiles(all_ttfa, 1000) if all_ttfa else {"p50": math.nan, "p95": math.nan, "p99": math.nan}
    stages = [st for r in runs for st in r.driver.stages]
    stage = np.median(np.asarray(stages), axis=0) * 1000 if stages else [math.nan] * 3
    audio_s = sum(r.driver.frames_out for r in runs) * FRAME_S
    compute_s = sum(r.compute_s for r in runs)
    stats = [r.cache for r in runs]
    hits, misses = sum(s.hit_steps for s in stats), sum(s.missed_steps for s in stats)
    peak = max(r.driver.peak_pages for r in runs)
    row = {
        "concurrency": runs[0].conversations,
        "rounds": len(runs),
        "ttfa_ms_p50": p["p50"],
        "ttfa_ms_p95": p["p95"],
        "ttfa_ms_p99": p["p99"],
        "turns_measured": len(all_ttfa),
        "ttfa_ms_p50_rounds": [pooled_ttfa(runs, [i], 50) for i in range(len(runs))],  # one per arrival pattern
        "encode_queue_ms_p50": float(stage[0]),
        "prefill_ms_p50": float(stage[1]),
        "first_audio_ms_p50": float(stage[2]),
        "throughput_x_realtime": audio_s / sum(r.wall for r in runs),
        "rtf_mean": compute_s / audio_s if audio_s else math.nan,
        "deadline_misses": sum(r.deadline_misses for r in runs),
        "hit_rate": hits / max(1, hits + misses),
        "hit_steps": hits,
        "peak_mem_bytes": peak * runs[0].bytes_per_page,
        "peak_pages": peak,
        "num_pages": runs[0].num_pages,
        "refusals": sum(r.driver.refusals for r in runs),
        "out_of_pages_waits": sum(r.out_of_pages for r in runs),
        "prefill_steps": sum(r.prefill_steps for r in runs) / len(runs),
        "evicted_pages": sum(s.evicted_pages for s in stats),
        "stalled": sum(r.driver.stalled for r in runs),
        "wall_s": sum(r.wall for r in runs),
    }
    for label, ts in sorted(ttfa.items()):
        q = percentiles(ts, 1000)
        key = label.replace(" ", "_").replace("-", "_")
        row |= {f"ttfa_ms_p50_{key}": q["p50"], f"ttfa_ms_p95_{key}": q["p95"], f"n_{key}": len(ts)}
    return row


def fit_count(model: S2SModel, tok: EncodecTokenizer, mode: str, scale: Scale, clip_frames: int) -> dict:
    """Conversations on one shared prompt, each with its own tail (a turn's worth of codes), opened one at a time in
    a pool of `fit_pages`, each prefilled before the next opens, until one is refused or cannot get its pages
    without preempting a resident one (which the engine would do: then they no longer all fit)."""
    max_convs = 256
    engine = make_engine(model, tok, mode, scale.fit_pages + 1, scale, max_conversations=max_convs)
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 1024, size=(2, scale.prompt_frames))
    tail = clip_frames + scale.reply_frames
    fitted, reason = 0, f"max_conversations ({max_convs})"
    for i in range(max_convs):
        prompt = np.concatenate([shared, rng.integers(0, 1024, size=(2, tail))], axis=1)
        try:
            cid = engine.open("turn", prompt=prompt, sampling=SamplingParams(seed=i))
        except Refused:
            reason = "refused at open"
            break
        conv = engine.convs[cid]
        while len(conv.ready_steps(1)) and not engine.stats.preempted:
            waits = engine.stats.out_of_pages
            engine.step()
            if engine.stats.out_of_pages > waits and len(conv.ready_steps(1)):
                break
        if len(conv.ready_steps(1)) or engine.stats.preempted:
            reason = "out of pages" + (": the next preempts a resident one" if engine.stats.preempted else "")
            break
        fitted += 1
    return {
        "workload": "fit",
        "mode": mode,
        "num_pages": scale.fit_pages,
        "kv_budget_bytes": scale.fit_pages * engine.pool.bytes_per_page,
        "prompt_frames": scale.prompt_frames,
        "own_frames": tail,
        "conversations_fit": fitted,
        "stopped_by": reason,
    }


# ---- report -----------------------------------------------------------------------------------------------------


def round_seed(workload: str, r: int) -> int:
    """Round r's workload seed: arrivals and prompts, the same in every mode. `unique` draws other prompts than
    `shared` at 0 % does; `pressure` runs with and without admission on the same ones."""
    return r + (1000 if workload == "unique" else 2000 if workload.startswith("pressure") else 0)


def pooled_ttfa(runs: list[Run], rounds: Iterable[int], q: float, label: str | None = None) -> float:
    """TTFA percentile q (ms) over the given rounds' samples pooled (those of one label, or all)."""
    ts = [t for i in rounds for lab, v in runs[i].driver.ttfa.items() if label in (None, lab) for t in v]
    return float(np.percentile(ts, q)) * 1000 if ts else math.nan


def round_interval(stat: Callable[[np.ndarray], float], rounds: int, resamples: int = 2000) -> list[float] | None:
    """90 % interval of `stat(round indices)` over rounds drawn with replacement: a paired bootstrap, since round r
    is one arrival pattern in every mode and each draw takes the same rounds from every mode. None under 3 rounds."""
    if rounds < 3:
        return None
    rng = np.random.default_rng(0)
    vals = [stat(rng.integers(0, rounds, rounds)) for _ in range(resamples)]
    return [float(v) for v in np.nanpercentile(vals, [5, 95])]


def ratios(rows: list[dict], runs: dict[tuple[str, float, str], list[Run]]) -> list[dict]:
    """radix vs paged and vs exact per workload and shared fraction: 1 - radix / other (positive: radix lower);
    pressure: each mode's long p95 during the burst over before it - 1. Each with its interval over rounds."""
    out = []
    keys = sorted({(r["workload"], r["shared_fraction"]) for r in rows}, key=str)
    for workload, fraction in keys:
        by = {r["mode"]: r for r in rows if r["workload"] == workload and r["shared_fraction"] == fraction}
        of = {mode: runs[(workload, fraction, mode)] for mode in MODES}
        n = len(of["radix"])
        row = {"workload": workload, "shared_fraction": fraction, "rounds": n}
        for other in ("paged", "exact"):
            for p in (50, 95):
                key = f"radix_vs_{other}_p{p}"
                row[key] = 1 - by["radix"][f"ttfa_ms_p{p}"] / by[other][f"ttfa_ms_p{p}"]
                row[f"{key}_ci90"] = round_interval(
                    lambda i, of=of, o=other, p=p: 1 - pooled_ttfa(of["radix"], i, p) / pooled_ttfa(of[o], i, p), n
                )
        if workload.startswith("pressure"):
            for mode in MODES:
                before, during = by[mode].get("ttfa_ms_p95_long_before"), by[mode].get("ttfa_ms_p95_long_during")
                if before and during:
                    key = f"{mode}_during_vs_before_p95"
                    row[key] = during / before - 1
                    row[f"{key}_ci90"] = round_interval(
                        lambda i, of=of, m=mode: (
                            pooled_ttfa(of[m], i, 95, "long during") / pooled_ttfa(of[m], i, 95, "long before") - 1
                        ),
                        n,
                    )
        out.append(row)
    return out


def with_intervals(row: dict) -> dict:
    """A ratio row for the table: each ratio with its interval beside it."""
    shown = dict(row)
    for key, ci in row.items():
        if key.endswith("_ci90") and ci is not None:
            base = key.removesuffix("_ci90")
            shown[base] = f"{row[base]:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"
    return shown


def plot(rows: list[dict], path, title: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4))
    for ax, workload, arrivals in zip(
        axes, ("shared", AT_ONCE), ("Poisson arrivals, 4/s", "all at t = 0"), strict=False
    ):
        shared = [r for r in rows if r["workload"] == workload]
        for mode in MODES:
            pts = sorted(
                (r["shared_fraction"], r["ttfa_ms_p50"], r["ttfa_ms_p95"]) for r in shared if r["mode"] == mode
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode} p50")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", ls="--", label=f"{mode} p95")
        ax.set(xlabel="shared fraction of the prompt", ylabel="TTFA ms", title=f"shared voice prompts, {arrivals}")
        ax.legend(fontsize=7, ncol=2)
    others = [r for r in rows if r["workload"] not in ("shared", AT_ONCE, "fit")]
    names = sorted({(r["workload"], r["shared_fraction"]) for r in others})
    width = 0.2
    for k, mode in enumerate(MODES):
        vals = [
            next(r["ttfa_ms_p95"] for r in others if (r["workload"], r["shared_fraction"]) == n and r["mode"] == mode)
            for n in names
        ]
        axes[2].bar(np.arange(len(names)) + (k - 1.5) * width, vals, width, label=mode)
    labels = [f"{w} {f:.0%}" if w == LONG else w for w, f in names]
    axes[2].set_xticks(np.arange(len(names)), labels, fontsize=6, rotation=20)
    axes[2].set(ylabel="TTFA p95 ms", title="other workloads")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"Prefix caching on audio workloads, {title}, CPU (same engine, same arrivals)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def setup(preset: str, quick: bool, rounds: int | None) -> tuple[Scale, EncodecTokenizer, S2SModel, list[np.ndarray]]:
    """The run's scale, codec, seeded model and user questions (espeak-ng speech)."""
    # one intra-op thread: on this shared 2-core machine two threads spin against other processes' work and ticks
    # slow down 20x at 16 conversations; the engine's work per tick is small (tiny preset)
    torch.set_num_threads(1)
    scale = QUICK if quick else FULL
    if rounds is not None:
        scale = replace(scale, rounds=rounds)
    tok = EncodecTokenizer.from_pretrained(None, bandwidth=1.5)
    model = S2SModel.from_seed(ModelConfig.preset(preset, num_codebooks=tok.num_codebooks), seed=0)
    clips = [synthesize(q, words_per_minute=WORDS_PER_MINUTE) for q in QUESTIONS]
    if scale.question_s:
        clips = [c[: round(scale.question_s * SAMPLE_RATE)] for c in clips]
    return scale, tok, model, clips


def warm_up(
    model: S2SModel, tok: EncodecTokenizer, scale: Scale, clips: list[np.ndarray], pages: int, streamed: bool
) -> None:
    """A throwaway run first: one-time costs (allocators, kernels) hit no measured run."""
    warm = Workload(scale, clips, 99)
    run_once(
        make_engine(model, tok, "paged", pages, scale), lambda d: shared_scripts(d, warm, 0.0), streamed, scale.stall_s
    )


def pressure_phase(scale: Scale) -> dict:
    """The state `pressure_scripts` shares between its conversations: which phase the long ones' turns are in."""
    return {"name": "before", "burst_start": None, "burst_end": None, "burst_left": scale.burst, "turns_done": 0}


def main(argv: list[str] | None = None) -> None:
    p = parser("prefix", __doc__.splitlines()[0])
    p.add_argument(
        "--user-turn",
        choices=("streamed", "whole"),
        default="streamed",
        help="how a user turn reaches the engine: in real time in 80 ms blocks (as the server gets it) or at once",
    )
    p.add_argument("--preset", default="tiny", help="model size: tiny (prefill nearly free on CPU) or small")
    p.add_argument("--rounds", type=int, default=None, help="rounds (arrival patterns) per (workload, mode)")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=WORKLOADS,
        help="run only these (quote the names with spaces); the fit table runs with any",
    )
    args = p.parse_args(argv)
    streamed = args.user_turn == "streamed"
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    scale, tok, model, clips = setup(args.preset, args.quick, args.rounds)
    clip_frames = round(np.mean([len(c) for c in clips]) / 320)
    env = {**environment(), "quick": args.quick, "preset": args.preset, **asdict(scale), "page_size": PAGE}
    env |= {"frames_per_tick": FRAMES_PER_TICK, "max_context": MAX_CONTEXT, "prefill_budget": 256}
    env["question_frames_mean"] = clip_frames
    env["user_turn"] = args.user_turn
    env["workloads"] = args.workloads
    roomy = (scale.groups * scale.per_group + scale.burst) * MAX_CONTEXT // PAGE + 1  # naive holds all at once

    plan: list[tuple[str, float, Callable[[Driver, Workload], list[Script]], Callable[[], int]]] = []
    for f in scale.fractions:
        plan.append(("shared", f, lambda d, w, f=f: shared_scripts(d, w, f), lambda: roomy))
    for f in scale.fractions:
        plan.append((AT_ONCE, f, lambda d, w, f=f: shared_scripts(d, w, f), lambda: roomy))
    for f in [f for f in scale.fractions if f >= 0.6]:
        plan.append((LONG, f, lambda d, w, f=f: long_prompt_scripts(d, w, f), lambda: roomy))
    plan.append(("multiturn", 0.6, multiturn_scripts, lambda: roomy))
    plan.append(("branching", 2 / 3, branching_scripts, lambda: roomy))
    plan.append(("unique", 0.0, lambda d, w: shared_scripts(d, w, 0.0), lambda: roomy))
    warm_up(model, tok, scale, clips, roomy, streamed)
    plan = [job for job in plan if job[0] in args.workloads]
    runs: dict[tuple[str, float, str], list[Run]] = {}
    budget = pressure_working_set(Workload(scale, clips, 0)) // 2  # depends on the clips and the scale only
    jobs = [(r, p, MODES[(r + k) % len(MODES)]) for r in range(scale.rounds) for p in plan for k in range(len(MODES))]
    for r, (name, fraction, scripts_of, pages_of), mode in tqdm(jobs, desc="prefix", file=sys.stderr):
        w = Workload(scale, clips, round_seed(name, r))
        if name == "unique":
            w.group_prompts = [w.rng.integers(0, 1024, size=(2, scale.prompt_frames)) for _ in range(len(clips))]
        if name == AT_ONCE:
            w.arrivals[:] = 0.0
        engine = make_engine(model, tok, mode, pages_of(), scale)
        runs.setdefault((name, fraction, mode), []).append(
            run_once(engine, lambda d, s=scripts_of, w=w: s(d, w), streamed, scale.stall_s)
        )
    pressure_jobs = [
        (r, name, MODES[(r + k) % len(MODES)])
        for r in range(scale.rounds)
        for name in (("pressure",) if args.quick else ("pressure", "pressure, no admission"))
        for k in range(len(MODES))
        if "pressure" in args.workloads
    ]
    for r, name, mode in tqdm(pressure_jobs, desc="pressure", file=sys.stderr):
        phase = pressure_phase(scale)
        headroom = EngineConfig.admission_headroom if name == "pressure" else math.inf
        engine = make_engine(model, tok, mode, budget + 1, scale, admission_headroom=headroom)
        w = Workload(scale, clips, round_seed(name, r))
        runs.setdefault((name, 0.6, mode), []).append(
            run_once(engine, lambda d, p=phase, w=w: pressure_scripts(d, w, p), streamed, scale.stall_s)
        )
    rows = [
        {"workload": name, "mode": mode, "shared_fraction": fraction, **summarize(rs)}
        for (name, fraction, mode), rs in runs.items()
    ]
    rows.sort(
        key=lambda r: (
            [p[0] for p in plan].index(r["workload"]) if not r["workload"].startswith("pressure") else 99,
            r["shared_fraction"],
            MODES.index(r["mode"]),
        )
    )
    for r in rows:
        if r["workload"].startswith("pressure"):
            r["working_set_pages"] = 2 * budget
    fit = [fit_count(model, tok, mode, scale, clip_frames) for mode in MODES]
    by_mode = {r["mode"]: r["conversations_fit"] for r in fit}
    for r in fit:
        r["vs_naive"] = r["conversations_fit"] / max(1, by_mode["naive"])

    cols = [
        ("workload", "workload"),
        ("shared_fraction", "shared"),
        ("mode", "mode"),
        ("concurrency", "convs"),
        *TTFA_COLUMNS,
        ("throughput_x_realtime", "thru x RT"),
        ("rtf_mean", "RTF"),
        ("hit_rate", "hit rate"),
        ("prefill_steps", "prefill steps/run"),
        ("peak_mem_bytes", "peak K/V B"),
        ("refusals", "refused"),
        ("stalled", "stalled"),
    ]
    tables = print_table(
        f"TTFA by workload and cache mode ({args.preset} preset, user turns {args.user_turn}; "
        f"G={scale.groups} x S={scale.per_group}, "
        f"P={scale.prompt_frames} frames, Q~{clip_frames} frames, R={scale.reply_frames})",
        [r for r in rows if not r["workload"].startswith("pressure")],
        cols,
    )
    tables += print_table(
        f"Pressure: {scale.long_convs} long conversations, a burst of {scale.burst}, K/V budget {budget} pages "
        "(half the working set); long TTFA excludes their first turn (prompt prefill); 'pressure' keeps the "
        "engine's admission control, 'no admission' turns it off",
        [r for r in rows if r["workload"].startswith("pressure")],
        [
            ("workload", "workload"),
            ("mode", "mode"),
            ("ttfa_ms_p50_long_before", "long p50 before"),
            ("ttfa_ms_p95_long_before", "long p95 before"),
            ("ttfa_ms_p50_long_during", "long p50 during"),
            ("ttfa_ms_p95_long_during", "long p95 during"),
            ("n_long_during", "n during"),
            ("ttfa_ms_p50_burst", "burst p50"),
            ("ttfa_ms_p95_burst", "burst p95"),
            ("hit_rate", "hit rate"),
            ("refusals", "refused"),
            ("out_of_pages_waits", "page waits"),
            ("evicted_pages", "evicted"),
            ("stalled", "stalled"),
        ],
    )
    ratio_rows = ratios(rows, runs)
    tables += print_table(
        "Ratios: 1 - radix / other (positive: radix lower); pressure: long p95 during burst / before - 1; "
        f"[90 % interval, paired bootstrap over the {scale.rounds} rounds]",
        [with_intervals(r) for r in ratio_rows],
        [
            ("workload", "workload"),
            ("shared_fraction", "shared"),
            ("radix_vs_paged_p50", "radix vs paged p50"),
            ("radix_vs_paged_p95", "radix vs paged p95"),
            ("radix_vs_exact_p50", "radix vs exact p50"),
            ("radix_vs_exact_p95", "radix vs exact p95"),
            *[(f"{m}_during_vs_before_p95", f"{m} during/before") for m in MODES],
        ],
    )
    tables += print_table(
        f"Conversations that fit {scale.fit_pages} pages (shared prompt of {scale.prompt_frames} frames + "
        f"{fit[0]['own_frames']} of their own)",
        fit,
        [
            ("mode", "mode"),
            ("conversations_fit", "conversations"),
            ("vs_naive", "x naive"),
            ("stopped_by", "stopped by"),
        ],
    )
    plot(rows, args.plot, f"{args.preset} preset, user turns {args.user_turn}")
    save_outputs(args, [{**env, **r} for r in rows + fit + ratio_rows], tables)


if __name__ == "__main__":
    main()
