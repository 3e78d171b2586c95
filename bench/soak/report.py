"""The report: the issue's targets, one row per wave, and the plot over time."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from bench.soak.client import Event
from bench.soak.load import pages

ERROR_LINE = re.compile(r"Error|Traceback")


def log_errors(output: str) -> list[str]:
    """The server's output lines that name an error or start a traceback."""
    return [line.rstrip() for line in output.splitlines() if ERROR_LINE.search(line)]


def p95_ms(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 95) * 1000) if latencies else float("nan")


def _target(name: str, measured: str, goal: str, ok: bool | None) -> dict:
    return {"target": name, "measured": measured, "goal": goal, "met": "n/a" if ok is None else ("yes" if ok else "NO")}


def targets(
    waves: list[dict],
    events: list[Event],
    t0: float,
    run_s: float,
    warmup_s: float,
    window_s: float,
    misses: int,
    usable: int,
    errors: list[str],
) -> list[dict]:
    """The issue's targets from the waves' boundary rows (`waves`), the clients' events and the server's log."""
    out = []
    after = [w for w in waves if w["t_s"] >= warmup_s] or waves[-1:]
    if after:
        base, last = after[0]["rss_mb"], waves[-1]["rss_mb"]
        growth = 100 * (last - base) / base
        measured = f"{growth:+.1f} % ({base:.0f} MB at {after[0]['t_s']:.0f} s -> {last:.0f} MB at the end)"
        out.append(_target("RSS growth after warm-up (idle RSS between waves)", measured, "< 5 %", growth < 5))
    back = sum(w["at_baseline"] for w in waves)
    out.append(
        _target("pages back to baseline between waves", f"{back} of {len(waves)} waves", "all", back == len(waves))
    )
    out.append(_target("deadline misses (admitted conversations)", str(misses), "0", misses == 0))
    latency = [(e.t - t0, float(e.value)) for e in events if e.kind == "latency"]
    first = [v for t, v in latency if t < window_s]
    last = [v for t, v in latency if t >= run_s - window_s]
    a, b = p95_ms(first), p95_ms(last)
    ok = None if not (first and last) else b <= 1.10 * a
    measured = f"{a:.0f} ms ({len(first)} turns) -> {b:.0f} ms ({len(last)} turns)"
    measured += f": {b / a - 1:+.0%}" if ok is not None else ": too few turns to compare"
    out.append(_target(f"p95 first audio, last {window_s / 60:.2g} min vs first", measured, "within +10 %", ok))
    final = waves[-1] if waves else None
    if final is not None:
        p = pages(final["metrics"])
        total = sum(p.values())
        m = final["metrics"]
        checks, failed = m.get("s2s_kv_checks_total", 0), m.get("s2s_kv_check_failures_total", 0)
        measured = ", ".join(f"{k} {v}" for k, v in p.items()) + f" (usable {usable})"
        measured += f"; the engine's idle page checks: {checks:.0f}, {failed:.0f} failed"
        ok = final["at_baseline"] and total == usable and final["conversations"] == 0 and checks > 0 and not failed
        out.append(_target("no leaked page (all clients gone)", measured, "private 0, locked 0, checks pass", ok))
    shown = f"{len(errors)} lines" + (f", first: {errors[0][:100]!r}" if errors else "")
    out.append(_target("no error in the server log", shown, "0 lines", not errors))
    return out


def wave_rows(waves: list[dict], events: list[Event], t0: float) -> list[dict]:
    """One row per wave: what its clients saw, and the server at its end (after every client left)."""
    rows = []
    for i, w in enumerate(waves):
        start = waves[i - 1]["t_s"] if i else 0.0
        evs = [e for e in events if start <= e.t - t0 < w["t_s"]]
        latency = [float(e.value) for e in evs if e.kind == "latency"]
        m, prev = w["metrics"], w["metrics_before"]
        ticks = m["s2s_ticks_total"] - prev["s2s_ticks_total"]
        busy = m["s2s_busy_seconds_total"] - prev["s2s_busy_seconds_total"]
        rows.append(
            {
                "wave": i + 1,
                "ends_s": round(w["t_s"], 1),
                "opened": sum(e.kind == "opened" for e in evs),
                "turns": len(latency),
                "first_audio_ms_p50": float(np.percentile(latency, 50) * 1000) if latency else float("nan"),
                "first_audio_ms_p95": p95_ms(latency),
                "barge_ins": sum(e.kind == "barge_in" for e in evs),
                "barge_ins_missed": sum(e.kind == "barge_in_missed" for e in evs),
                "left_abort": sum(e.kind == "left" and e.value == "abort" for e in evs),
                "tick_ms_mean": 1000 * busy / ticks if ticks else float("nan"),
                "deadline_misses": int(m["s2s_deadline_misses_total"] - prev["s2s_deadline_misses_total"]),
                "refused": sum(e.kind == "refused" for e in evs),
                "errors": sum(e.kind in ("error", "dropped", "failed", "client_bug", "no_reply") for e in evs),
                "rss_mb": w["rss_mb"],
                "settle_s": w["settle_s"],
                **{f"pages_{k}": v for k, v in pages(m).items()},
                "at_baseline": w["at_baseline"],
            }
        )
    return rows


WAVE_COLUMNS = [
    ("wave", "wave"),
    ("ends_s", "ends s"),
    ("opened", "opened"),
    ("turns", "turns"),
    ("first_audio_ms_p50", "first audio p50 ms"),
    ("first_audio_ms_p95", "p95 ms"),
    ("barge_ins", "barge-ins"),
    ("barge_ins_missed", "not cut"),
    ("left_abort", "aborted"),
    ("tick_ms_mean", "tick ms"),
    ("deadline_misses", "misses"),
    ("refused", "refused"),
    ("errors", "errors"),
    ("rss_mb", "RSS MB after"),
    ("settle_s", "settle s"),
    ("pages_cached_locked", "locked"),
    ("pages_private", "private"),
    ("at_baseline", "baseline"),
]


def plot(samples: list[dict], waves: list[dict], path: Path, title: str) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(17, 8), sharex=True)
    t = [r["t_s"] / 60 for r in samples]

    def lines(ax, keys: list[tuple[str, str]], ylabel: str, cumulative: bool = False) -> None:
        for key, label in keys:
            ys = np.array([r[key] for r in samples], dtype=float)
            ax.plot(t, np.cumsum(ys) if cumulative else ys, ".-", markersize=3, label=label)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)

    lines(axes[0, 0], [("rss_mb", "server RSS")], "MB")
    states = ["cached_evictable", "cached_locked", "private"]
    lines(axes[0, 1], [(f"pages_{s}", s) for s in states], "K/V pages")
    lines(axes[0, 2], [("tick_ms_mean", "mean"), ("tick_ms_p95", "p95")], "tick ms")
    first_audio = [("first_audio_ms_p50", "client p50"), ("first_audio_ms_p95", "client p95")]
    lines(axes[1, 0], [*first_audio, ("server_ttfa_ms_p95", "server TTFA p95")], "first audio ms")
    lines(axes[1, 1], [("conversations", "server: conversations"), ("clients_live", "clients live")], "count")
    counted = [("deadline_misses", "deadline misses"), ("refused", "refused"), ("error", "error messages")]
    counted += [("dropped", "closed by the server"), ("failed", "failed to connect"), ("no_reply", "no reply")]
    lines(axes[1, 2], counted, "cumulative", cumulative=True)
    titles = ["server RSS", "pages by state (the rest free)", "tick time", "first audio (end of speech -> reply)"]
    titles += ["load", "problems"]
    for ax, name in zip(axes.flat, titles, strict=True):
        for w in waves:
            ax.axvline(w["t_s"] / 60, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(name)
    for ax in axes[1]:
        ax.set_xlabel("minutes (dotted: wave ends, every client gone)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
