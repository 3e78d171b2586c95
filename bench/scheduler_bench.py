"""Scheduler benchmark: the engine's background prefill budget, its values side by side in one run.

    s2s bench scheduler [--quick] [--model DIR | --preset NAME] [--rounds N] [--budgets N ...] [--modes MODE ...]
        [--json PATH]

In a tick someone waits on (a turn's rest of speech to compute, a reply before its first audio), the scheduler gives
work nobody waits on (voice prompts, speech computed while its user still talks) at most `background_budget` steps
(`EngineConfig.background_budget`, `s2s/scheduling/scheduler.py`). This measures what that buys and costs, on the prefix
benchmark's own workloads, engines and driver (`bench/prefix_bench.py`): `shared` at 60 % (Poisson arrivals, where
background prompts and waiting users overlap) and `pressure` with admission control (the long conversations' p95
TTFA during a burst of new ones against before it). The default budgets are 16 (one page, the engine's default) and
256 (the whole prefill budget: no cap). Every (workload, mode, budget) runs `--rounds` times, each round its own
arrival pattern shared by every engine, the order rotating within a round; ratios get a 90 % interval from a paired
bootstrap over rounds, as in the prefix benchmark.

The engines run the weights a user runs: by default the shipped codec and echo model (what `s2s serve` serves with no
flags), or `--model DIR`, or `--preset NAME` (seeded weights over a seeded EnCodec, as `s2s bench prefix` runs them:
`--preset small`, a model whose prefill is not free on a CPU, is what the figures before issue 48 ran); each row's
`model` says which.
"""

from __future__ import annotations

import math
import sys
from itertools import product

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

from bench.common import add_model_args, environment, model_choice, parser, print_table, save_outputs
from bench.prefix_bench import (
    MAX_CONTEXT,
    MODES,
    PAGE,
    PREFILL_BUDGET,
    TTFA_COLUMNS,
    Run,
    Workload,
    make_engine,
    pooled_ttfa,
    pressure_phase,
    pressure_scripts,
    pressure_working_set,
    round_interval,
    round_seed,
    run_once,
    setup,
    shared_scripts,
    summarize,
    warm_up,
    with_intervals,
)
from s2s.engine.engine import EngineConfig

SHARED_FRACTION = 0.6
WORKLOADS = ("shared", "pressure")


def ratio_rows(runs: dict[tuple[str, str, int], list[Run]], budgets: list[int], modes: list[str]) -> list[dict]:
    """Per workload and mode: each budget's TTFA against the last budget's (1 - this / last: positive, this one is
    lower); pressure: each budget's long p95 during the burst over before it - 1."""
    out = []
    base = budgets[-1]
    for workload, mode, budget in product(WORKLOADS, modes, budgets):
        rs = runs.get((workload, mode, budget))
        if not rs:
            continue
        n = len(rs)
        row = {"workload": workload, "mode": mode, "background_budget": budget, "rounds": n}
        if budget != base:
            ref = runs[(workload, mode, base)]
            for p in (50, 95):
                key = f"vs_{base}_p{p}"
                row[key] = 1 - pooled_ttfa(rs, range(n), p) / pooled_ttfa(ref, range(n), p)
                row[f"{key}_ci90"] = round_interval(
                    lambda i, rs=rs, ref=ref, p=p: 1 - pooled_ttfa(rs, i, p) / pooled_ttfa(ref, i, p), n
                )
        if workload == "pressure":
            row["during_vs_before_p95"] = (
                pooled_ttfa(rs, range(n), 95, "long during") / pooled_ttfa(rs, range(n), 95, "long before") - 1
            )
            row["during_vs_before_p95_ci90"] = round_interval(
                lambda i, rs=rs: pooled_ttfa(rs, i, 95, "long during") / pooled_ttfa(rs, i, 95, "long before") - 1, n
            )
        out.append(row)
    return out


def plot(rows: list[dict], path, title: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = [
        ("shared", "ttfa_ms_p50", "ttfa_ms_p95", f"shared {SHARED_FRACTION:.0%}, Poisson arrivals: TTFA ms"),
        ("pressure", "ttfa_ms_p95_long_before", "ttfa_ms_p95_long_during", "pressure: long p95 before / during ms"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4))
    for ax, (workload, a, b, name) in zip(axes, panels, strict=True):
        shown = [r for r in rows if r["workload"] == workload]
        labels = [f"{r['mode']}\nbudget {r['background_budget']}" for r in shown]
        x = np.arange(len(shown))
        ax.bar(x - 0.2, [r.get(a, math.nan) for r in shown], 0.4, label=a.removeprefix("ttfa_ms_"))
        ax.bar(x + 0.2, [r.get(b, math.nan) for r in shown], 0.4, label=b.removeprefix("ttfa_ms_"))
        ax.set_xticks(x, labels, fontsize=7)
        ax.set(title=name, ylabel="ms")
        ax.legend(fontsize=7)
    fig.suptitle(f"Background prefill budget in ticks someone waits on, {title}, CPU (same arrivals)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = parser("scheduler", __doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument(
        "--rounds", type=int, default=None, help="rounds (arrival patterns) per (workload, mode, budget); default 6"
    )
    p.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[EngineConfig.background_budget, PREFILL_BUDGET],
        help="background budgets to compare; ratios are against the last",
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=["paged", "radix"], help="cache modes")
    args = p.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 6
    if rounds < 1 or min(args.budgets) < 1:
        p.error("--rounds and every --budgets value must be >= 1")
    choice = model_choice(args)
    scale, tok, model, clips = setup(choice.preset or "tiny", args.quick, rounds)
    if choice.preset is None:  # the shipped echo or a model folder, over the codec `s2s serve` gives it
        model, tok = choice.load()
    roomy = scale.groups * scale.per_group * MAX_CONTEXT // PAGE + 1
    pressure_pages = pressure_working_set(Workload(scale, clips, 0), tok.frame_size) // 2 + 1
    warm_up(model, tok, scale, clips, roomy, streamed=True)
    engines = list(product(args.modes, args.budgets))
    jobs = [
        (r, workload, *engines[(r + k) % len(engines)])
        for r in range(scale.rounds)
        for workload in WORKLOADS
        for k in range(len(engines))
    ]
    runs: dict[tuple[str, str, int], list[Run]] = {}
    for r, workload, mode, budget in tqdm(jobs, desc="scheduler", file=sys.stderr):
        w = Workload(scale, clips, round_seed(workload, r))
        if workload == "shared":
            engine = make_engine(model, tok, mode, roomy, scale, background_budget=budget)
            scripts_of = lambda d, w=w: shared_scripts(d, w, SHARED_FRACTION)  # noqa: E731
        else:
            headroom = EngineConfig.admission_headroom
            engine = make_engine(
                model, tok, mode, pressure_pages, scale, background_budget=budget, admission_headroom=headroom
            )
            phase = pressure_phase(scale)
            scripts_of = lambda d, w=w, ph=phase: pressure_scripts(d, w, ph)  # noqa: E731
        runs.setdefault((workload, mode, budget), []).append(run_once(engine, scripts_of, True, scale.stall_s))
    rows = [
        {"workload": workload, "mode": mode, "background_budget": budget, "shared_fraction": SHARED_FRACTION, **s}
        for (workload, mode, budget), rs in runs.items()
        for s in [summarize(rs)]
    ]
    rows.sort(key=lambda r: (WORKLOADS.index(r["workload"]), MODES.index(r["mode"]), r["background_budget"]))
    env = {**environment(), "quick": args.quick, "model": choice.label, "preset": choice.preset, "page_size": PAGE}
    env |= {"prefill_budget": PREFILL_BUDGET, "budgets": args.budgets, "pressure_pages": pressure_pages - 1}
    cols = [
        ("workload", "workload"),
        ("mode", "mode"),
        ("background_budget", "background budget"),
        *TTFA_COLUMNS,
        ("ttfa_ms_p95_long_before", "long p95 before"),
        ("ttfa_ms_p95_long_during", "long p95 during"),
        ("n_long_during", "n during"),
        ("ttfa_ms_p50_burst", "burst p50"),
        ("deadline_misses", "misses"),
        ("prefill_steps", "prefill steps/run"),
        ("refusals", "refused"),
        ("stalled", "stalled"),
    ]
    tables = print_table(
        f"Background budget in ticks someone waits on ({choice.label}, {scale.rounds} rounds; shared at "
        f"{SHARED_FRACTION:.0%}, pressure with admission in {pressure_pages - 1} pages)",
        rows,
        cols,
    )
    ratios = ratio_rows(runs, args.budgets, args.modes)
    base = args.budgets[-1]
    tables += print_table(
        f"Ratios: 1 - budget / budget {base} (positive: lower TTFA); pressure: long p95 during burst / before - 1 "
        f"[90 % interval, paired bootstrap over the {scale.rounds} rounds]",
        [with_intervals(r) for r in ratios],
        [
            ("workload", "workload"),
            ("mode", "mode"),
            ("background_budget", "background budget"),
            (f"vs_{base}_p50", f"vs {base}, p50"),
            (f"vs_{base}_p95", f"vs {base}, p95"),
            ("during_vs_before_p95", "during/before p95"),
        ],
    )
    plot(rows, args.plot, choice.label)
    save_outputs(args, [{**env, **r} for r in rows + ratios], tables)


if __name__ == "__main__":
    main()
