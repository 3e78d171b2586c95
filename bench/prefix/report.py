"""The report: the four tables (by workload, pressure, ratios, fit) and the plot."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from bench.common import print_table
from bench.prefix.config import MODES, Scale
from bench.prefix.workloads import AT_ONCE, LONG

# a row's TTFA and its stages (`summarize`), as table columns (key, header)
TTFA_COLUMNS = [
    ("ttfa_ms_p50", "TTFA p50 ms"),
    ("ttfa_ms_p95", "TTFA p95 ms"),
    ("ttfa_ms_p99", "TTFA p99 ms"),
    ("encode_queue_ms_p50", "encode+queue p50"),
    ("prefill_ms_p50", "prefill p50"),
    ("first_audio_ms_p50", "to audio p50"),
]


def with_intervals(row: dict) -> dict:
    """A ratio row for the table: each ratio with its interval beside it."""
    shown = dict(row)
    for key, ci in row.items():
        if key.endswith("_ci90") and ci is not None:
            base = key.removesuffix("_ci90")
            shown[base] = f"{row[base]:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"
    return shown


def print_tables(
    rows: list[dict], ratio_rows: list[dict], fit: list[dict], scale: Scale, title: str, budget: int, clip_frames: int
) -> list[str]:
    """Print the tables; returns them as markdown. `title`: the preset and how user turns arrive."""
    pressure = [r for r in rows if r["workload"].startswith("pressure")]
    others = [r for r in rows if not r["workload"].startswith("pressure")]
    tables = print_table(
        f"TTFA by workload and cache mode ({title}; G={scale.groups} x S={scale.per_group}, "
        f"P={scale.prompt_frames} frames, Q~{clip_frames} frames, R={scale.reply_frames})",
        others,
        [
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
        ],
    )
    tables += print_table(
        f"Pressure: {scale.long_convs} long conversations, a burst of {scale.burst}, K/V budget {budget} pages "
        "(half the working set); long TTFA excludes their first turn (prompt prefill); 'pressure' keeps the "
        "engine's admission control, 'no admission' turns it off",
        pressure,
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
    return tables


def plot(rows: list[dict], path: Path, title: str) -> None:
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
