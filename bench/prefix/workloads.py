"""The workloads: seeded prompts and arrivals (`Workload`), the same in every mode, and the conversation scripts
each workload runs (SGLang's defaults are 64 groups x 16 prompts, a 2,048-token system prompt, 128-token questions
and 256-token outputs; scaled down in `config.Scale`, numbers in every JSON row).

Prompts are codes: a group's prompt is random codes; with shared fraction f, a conversation's prompt is its group's
first f * P frames then P - f * P random frames of its own (SGLang's generated-shared-prefix benchmark: system
prompt, then a question).
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
  conversations (their first turn apart) is split into before, during and after the burst.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from bench.prefix.config import PAGE, Scale
from bench.prefix.driver import Driver, Script
from s2s import SamplingParams

LONG = "long prompts, at once"  # a few conversations at t = 0 on prompts of SGLang's length (2,048)
AT_ONCE = "shared, at once"  # the shared workload with every conversation arriving at t = 0, as SGLang sends it
WORKLOADS = ["shared", AT_ONCE, LONG, "multiturn", "branching", "unique", "pressure"]


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


def round_seed(workload: str, r: int) -> int:
    """Round r's workload seed: arrivals and prompts, the same in every mode. `unique` draws other prompts than
    `shared` at 0 % does; `pressure` runs with and without admission on the same ones."""
    return r + (1000 if workload == "unique" else 2000 if workload.startswith("pressure") else 0)


def round_workload(name: str, scale: Scale, clips: list[np.ndarray], r: int) -> Workload:
    """Round r's prompts and arrivals for workload `name`, the same in every mode."""
    w = Workload(scale, clips, round_seed(name, r))
    if name == "unique":
        w.group_prompts = [w.rng.integers(0, 1024, size=(2, scale.prompt_frames)) for _ in range(len(clips))]
    if name == AT_ONCE:
        w.arrivals[:] = 0.0
    return w


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
            d.engine.close(cid, keep=True)

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


ScriptsOf = Callable[[Driver, Workload], list[Script]]


def workload_plan(scale: Scale) -> list[tuple[str, float, ScriptsOf]]:
    """Every (workload, shared fraction) but pressure, with the scripts it runs."""
    plan: list[tuple[str, float, ScriptsOf]] = []
    for f in scale.fractions:
        plan.append(("shared", f, lambda d, w, f=f: shared_scripts(d, w, f)))
    for f in scale.fractions:
        plan.append((AT_ONCE, f, lambda d, w, f=f: shared_scripts(d, w, f)))
    for f in [f for f in scale.fractions if f >= 0.6]:
        plan.append((LONG, f, lambda d, w, f=f: long_prompt_scripts(d, w, f)))
    plan.append(("multiturn", 0.6, multiturn_scripts))
    plan.append(("branching", 2 / 3, branching_scripts))
    plan.append(("unique", 0.0, lambda d, w: shared_scripts(d, w, 0.0)))
    return plan


def pressure_phase(scale: Scale) -> dict:
    """The state `pressure_scripts` shares between its conversations: which phase the long ones' turns are in."""
    return {"name": "before", "burst_start": None, "burst_end": None, "burst_left": scale.burst, "turns_done": 0}


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


def pressure_working_set(w: Workload, frame_size: int) -> int:
    """Pages every conversation of the pressure workload would hold at its longest, all at once, in frames of
    `frame_size` samples (the codec's)."""
    s, delay = w.scale, 2
    clip_frames = [math.ceil(len(c) / frame_size) + delay for c in w.clips]
    longs = [
        s.prompt_frames + sum(clip_frames[(i + t) % len(clip_frames)] + s.reply_frames for t in range(s.long_turns))
        for i in range(s.long_convs)
    ]
    bursts = [s.prompt_frames + clip_frames[i % len(clip_frames)] + s.reply_frames for i in range(s.burst)]
    return sum(math.ceil(n / PAGE) + 1 for n in longs + bursts)
