"""Prefix benchmark: the four cache modes (naive, paged, exact, radix) on audio workloads, one engine, one run.

    s2s bench prefix [--quick] [--model DIR | --preset small] [--rounds N] [--workloads NAME ...] [--json PATH]
        [--plot PATH]

In-process, no sockets: one `Engine` per mode, built identically but for `cache_mode`, driven by hand
(`engine.step()` as fast as it goes, the wall clock as its clock), with the same arrivals, audio and seeds, modes
back to back. Turn mode throughout. A user turn is espeak-ng speech (synthesized once) that arrives as
a client sends it (`--user-turn streamed`, the default: 80 ms blocks in real time, each once its last sample has
been spoken) or as SGLang's benchmark sends whole requests (`--user-turn whole`: `push_audio` of the utterance,
then `end_turn`, at once). TTFA runs from that `end_turn` call (right after the last block) to the
`first_audio_out` stamp of the reply's first AudioEvent, so it holds encoding what is not encoded yet (the same
work in every mode), prefill of whatever the cache did not give back and the user's speech did not hide, the first
steps and the first decode; the rows split it at `reply_start` (audio encoded) and `prefill_done`.

Workloads (each described in `bench/prefix/workloads.py`, prompts of codes sharing a fraction of a group prompt):
shared (Poisson arrivals), shared at once, long prompts at once, multiturn, branching, unique and pressure. Pressure
runs twice: with the engine's admission control (its cost model may refuse an open; the script retries every
50 ms) and, but for --quick, without. A last table opens conversations on one shared prompt (each with its own
one-turn tail of codes) in a fixed pool until one cannot get its pages (`bench/prefix/fit.py`; naive: until `open`
refuses: it reserves `max_context` = 4,096 steps up front).

Every engine: one torch thread (see `setup`); by default the tiny preset (seeded weights over a seeded EnCodec at
1.5 kbps, K = 2: its prefill nearly free on a CPU), or `--preset NAME`, or `--model DIR` (over the shipped codec;
`--model s2s/weights/echo`: the shipped echo model, what `s2s serve` serves with no flags), each row's `model` saying
which; pages of 16 steps, 4 frames per tick, prefill budget 256 steps per tick (the engine's default),
`calibration_ticks=0`, replies of R frames (`max_reply_frames`), max_context 4,096. Sampling is seeded per
conversation, so every mode produces the same replies. Admission by tick cost is off (`admission_headroom=inf`: every
mode sees the same arrivals; naive still refuses when its reservation does not fit) except in one pressure run. Every
(workload, mode) runs `rounds` times with the order of modes rotating, TTFA samples pooled. Each round has its own
seed (arrival times, prompts), the same in every mode: on this CPU a run of 16 conversations near saturation is one
queueing history, and its TTFA p50 moves severalfold from one arrival pattern to the next (`ttfa_ms_p50_rounds`), so
repeating one pattern measures that pattern, not the cache. The ratio table gives each radix ratio a 90 % interval
from a paired bootstrap over rounds (`round_interval`).

This file is the command; the driver, workloads, statistics and report are in `bench/prefix/` (map in its
`__init__.py`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict

import numpy as np
from tqdm import tqdm

from bench.common import add_model_args, environment, model_choice, parser, save_outputs
from bench.prefix.config import FRAMES_PER_TICK, MAX_CONTEXT, MODES, PAGE, PREFILL_BUDGET, QUICK
from bench.prefix.fit import fit_rows
from bench.prefix.report import TTFA_COLUMNS, plot, print_tables, with_intervals
from bench.prefix.run import Run, make_engine, run_once, setup, warm_up
from bench.prefix.stats import RunsByKey, mode_rows, pooled_ttfa, ratios, round_interval, summarize
from bench.prefix.workloads import (
    WORKLOADS,
    Workload,
    branching_scripts,
    pressure_phase,
    pressure_scripts,
    pressure_working_set,
    round_seed,
    round_workload,
    shared_scripts,
    workload_plan,
)
from s2s.engine.engine import EngineConfig

# what other benchmarks (scheduler_bench), the tests and RESULTS.md's scripts import from here
__all__ = [
    "MAX_CONTEXT",
    "MODES",
    "PAGE",
    "PREFILL_BUDGET",
    "QUICK",
    "TTFA_COLUMNS",
    "Run",
    "Workload",
    "branching_scripts",
    "make_engine",
    "pooled_ttfa",
    "pressure_phase",
    "pressure_scripts",
    "pressure_working_set",
    "round_interval",
    "round_seed",
    "run_once",
    "setup",
    "shared_scripts",
    "summarize",
    "warm_up",
    "with_intervals",
    "main",
]


def main(argv: list[str] | None = None) -> None:
    p = parser("prefix", __doc__.splitlines()[0])
    p.add_argument(
        "--user-turn",
        choices=("streamed", "whole"),
        default="streamed",
        help="how a user turn reaches the engine: in real time in 80 ms blocks (as the server gets it) or at once",
    )
    add_model_args(p, default="tiny")  # (tiny: prefill nearly free on a CPU)
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
    choice = model_choice(args)
    scale, tok, model, clips = setup(choice.preset or "tiny", args.quick, args.rounds)
    if choice.preset is None:  # a model folder, and its codec (the shipped one, unless it holds its own)
        model, tok = choice.load()
    clip_frames = round(np.mean([len(c) for c in clips]) / tok.frame_size)
    env = {**environment(), "quick": args.quick, "model": choice.label, "preset": choice.preset}
    env |= {**asdict(scale), "page_size": PAGE}
    env |= {"frames_per_tick": FRAMES_PER_TICK, "max_context": MAX_CONTEXT, "prefill_budget": PREFILL_BUDGET}
    env |= {"question_frames_mean": clip_frames, "user_turn": args.user_turn, "workloads": args.workloads}
    roomy = (scale.groups * scale.per_group + scale.burst) * MAX_CONTEXT // PAGE + 1  # naive holds all at once
    warm_up(model, tok, scale, clips, roomy, streamed)

    plan = [job for job in workload_plan(scale) if job[0] in args.workloads]
    runs: RunsByKey = {}
    jobs = [(r, p, MODES[(r + k) % len(MODES)]) for r in range(scale.rounds) for p in plan for k in range(len(MODES))]
    for r, (name, fraction, scripts_of), mode in tqdm(jobs, desc="prefix", file=sys.stderr):
        w = round_workload(name, scale, clips, r)
        engine = make_engine(model, tok, mode, roomy, scale)
        runs.setdefault((name, fraction, mode), []).append(
            run_once(engine, lambda d, s=scripts_of, w=w: s(d, w), streamed, scale.stall_s)
        )
    budget = pressure_working_set(Workload(scale, clips, 0), tok.frame_size) // 2  # the clips and the scale only
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
        w = round_workload(name, scale, clips, r)
        runs.setdefault((name, 0.6, mode), []).append(
            run_once(engine, lambda d, p=phase, w=w: pressure_scripts(d, w, p), streamed, scale.stall_s)
        )

    rows = mode_rows(runs, [job[0] for job in plan])
    for r in rows:
        if r["workload"].startswith("pressure"):
            r["working_set_pages"] = 2 * budget
    fit = fit_rows(model, tok, scale, clip_frames)
    ratio_rows = ratios(rows, runs)
    title = f"{choice.label}, user turns {args.user_turn}"
    tables = print_tables(rows, ratio_rows, fit, scale, title, budget, clip_frames)
    plot(rows, args.plot, title)
    save_outputs(args, [{**env, **r} for r in rows + fit + ratio_rows], tables)


if __name__ == "__main__":
    main()
