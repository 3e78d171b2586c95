"""What every benchmark shares: argument parsing, percentiles, memory, tables, JSON rows and plots."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from s2s import placement
from server.scrape import scrape as scrape  # the benchmarks' import of it

RESULTS_DIR = Path(__file__).parent / "results"
# what the simulated users say (espeak-ng speaks them)
SENTENCES = [
    "Hello, can you hear me? I would like to book a table for two tonight.",
    "What is the weather going to be like tomorrow morning in the city?",
    "Please tell me a short story about a robot who learns to sing.",
    "I think the meeting should move to Thursday afternoon at three.",
]


def parser(name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"s2s bench {name}", description=description)
    p.add_argument("--quick", action="store_true", help="a reduced run that finishes in under a minute")
    p.add_argument("--json", type=Path, default=None, help="write one JSON row per measured configuration here")
    p.add_argument("--plot", type=Path, default=RESULTS_DIR / f"{name}.png", help="where to write the PNG plot")
    return p


def percentiles(samples: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """p50/p95/p99 of `samples` times `scale`, as a dict with those keys."""
    a = np.asarray(samples, dtype=np.float64) * scale
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 95, 99)}


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t, out


def add_device_args(p: argparse.ArgumentParser) -> None:
    """`--device` and `--enforce-eager` for benchmarks that start `s2s serve`: passed to the server as they are."""
    p.add_argument("--device", default="auto", help="the server's device: cpu, cuda, cuda:N (auto: a GPU if any)")
    p.add_argument("--enforce-eager", action="store_true", help="the server runs without CUDA graphs")


def device_server_args(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device] + (["--enforce-eager"] if args.enforce_eager else [])


def device_name(device: str) -> str:
    """What `--device DEVICE` (as `s2s serve` resolves it) runs on, for tables and plots: "cpu" or the GPU's name."""
    dev, _ = placement(device, "auto")
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def environment() -> dict:
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "host_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def print_table(title: str, rows: Iterable[dict], columns: Sequence[tuple[str, str]]) -> list[str]:
    """Print rows as a table and return it as markdown; `columns` are (key, header) pairs."""
    rows = list(rows)
    table = Table(title=title)
    for _, header in columns:
        table.add_column(header, justify="right")
    for row in rows:
        cells = []
        for key, _ in columns:
            v = row.get(key, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        table.add_row(*cells)
    Console(width=200).print(table)
    return [f"**{title}**\n\n{markdown_table(rows, columns)}"]


def markdown_table(rows: Iterable[dict], columns: Sequence[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        vals = [row.get(k, "") for k, _ in columns]
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in vals) + " |")
    return "\n".join(lines)


def write_json(path: Path | None, rows: list[dict]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n")


def save_outputs(args: argparse.Namespace, rows: list[dict], tables: list[str]) -> None:
    """Every benchmark's last step: JSON rows to --json, markdown tables beside the plot (--plot, already drawn)."""
    write_json(args.json, rows)
    md = args.plot.with_suffix(".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n\n".join(tables) + "\n")
    print(f"plot: {args.plot}; markdown tables: {md}")
