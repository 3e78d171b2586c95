"""The statistics: one row per (workload, shared fraction, mode) over its rounds (`summarize`), and radix's ratios
against the other modes with a 90 % interval from a paired bootstrap over rounds (`ratios`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from bench.common import percentiles
from bench.prefix.config import MODES
from bench.prefix.run import Run

RunsByKey = dict[tuple[str, float, str], list[Run]]  # (workload, shared fraction, mode) -> its runs, one a round


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
    audio_s = sum(r.driver.frames_out * r.frame_s for r in runs)
    counters = [r.counters for r in runs]
    compute_s = sum(c.compute_s for c in counters)
    stats = [c.cache for c in counters]
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
        "deadline_misses": sum(c.deadline_misses for c in counters),
        "hit_rate": hits / max(1, hits + misses),
        "hit_steps": hits,
        "peak_mem_bytes": peak * counters[0].bytes_per_page,
        "peak_pages": peak,
        "num_pages": counters[0].num_pages,
        "refusals": sum(r.driver.refusals for r in runs),
        "out_of_pages_waits": sum(c.out_of_pages for c in counters),
        "prefill_steps": sum(c.prefill_steps for c in counters) / len(runs),
        "evicted_pages": sum(s.evicted_pages for s in stats),
        "stalled": sum(r.driver.stalled for r in runs),
        "wall_s": sum(r.wall for r in runs),
    }
    for label, ts in sorted(ttfa.items()):
        q = percentiles(ts, 1000)
        key = label.replace(" ", "_").replace("-", "_")
        row |= {f"ttfa_ms_p50_{key}": q["p50"], f"ttfa_ms_p95_{key}": q["p95"], f"n_{key}": len(ts)}
    return row


def ratios(rows: list[dict], runs: RunsByKey) -> list[dict]:
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


def mode_rows(runs: RunsByKey, order: list[str]) -> list[dict]:
    """One row per (workload, shared fraction, mode), workloads in `order` (pressure last), then fraction, mode."""
    rows = [
        {"workload": name, "mode": mode, "shared_fraction": fraction, **summarize(rs)}
        for (name, fraction, mode), rs in runs.items()
    ]
    rows.sort(
        key=lambda r: (
            order.index(r["workload"]) if not r["workload"].startswith("pressure") else 99,
            r["shared_fraction"],
            MODES.index(r["mode"]),
        )
    )
    return rows
