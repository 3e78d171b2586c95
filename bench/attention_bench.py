"""Attention benchmark: a model forward over tick-shaped batches on CPU, one padded call against the split.

    s2s bench attention [--quick] [--json PATH] [--plot PATH]

A tick's batch mixes decode steps (one per replying conversation) with prefill chunks of any length. The torch
reference computes a batch in one call that pads every sequence to the longest query and the longest keys
(`S2S_ATTENTION_BACKEND=torch`); the CPU path (`auto`, `paged_kernels/cpu_attention.py`) sends the decode steps to
its C++ kernel and the extends to the reference in groups of small padding. Each row times
`S2SModel.forward_paged` (every layer, K/V in a page pool) on one batch shape with both, interleaved in one run,
one torch thread, seeded weights; the ratio is the figure. Context lengths are in steps.
"""

from __future__ import annotations

import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from bench.common import environment, parser, print_table, save_outputs, timed
from cache import PagePool
from paged_kernels import set_backend
from s2s import ModelConfig, S2SModel
from s2s.runner.batch import PagedBatch

PAGE = 16
SPREAD = list(range(300, 2000, 106))[:16]  # 16 contexts from 300 to 1,890 steps
# name: (cached steps, new steps) per sequence
CASES = {
    "one 256-step chunk at 1,846": ([1846], [256]),
    "chunks of 244 at 1,858 and 12 at 1,843": ([1858, 1843], [244, 12]),
    "16 decode steps at 1,000": ([1000] * 16, [1] * 16),
    "one 256-step chunk at 1,000": ([1000], [256]),
    "16 decode steps and a 256-step chunk, at 1,000": ([1000] * 17, [1] * 16 + [256]),
    "16 decode steps at 300-1,890 and a 64-step chunk at 500": ([*SPREAD, 500], [1] * 16 + [64]),
    "16 chunks of 5 at 300-1,890": (SPREAD, [5] * 16),
}
QUICK_CASES = ["16 decode steps and a 256-step chunk, at 1,000", "chunks of 244 at 1,858 and 12 at 1,843"]


def time_case(model: S2SModel, pool: PagePool, cached: list[int], new: list[int], reps: int) -> dict[str, float]:
    """Median ms of `forward_paged` on this batch, per backend, the two alternating."""
    pages, first = [], 1
    for c, n in zip(cached, new, strict=True):
        count = -(-(c + n) // PAGE)
        pages.append(list(range(first, first + count)))
        first += count
    batch = PagedBatch.build(cached, new, pages, PAGE)
    tokens = torch.zeros(sum(new), model.config.step_width, dtype=torch.long)
    times: dict[str, list[float]] = {"torch": [], "auto": []}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for backend in times:
                set_backend(backend)
                seconds, _ = timed(model.forward_paged, tokens, batch, pool.k, pool.v)
                if rep:  # the first round warms up
                    times[backend].append(seconds)
    set_backend("auto")
    return {backend: 1000 * float(np.median(ts)) for backend, ts in times.items()}


def plot(rows: list[dict], path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    presets = sorted({r["preset"] for r in rows})
    # one set of row labels, wrapped, on the left: the batches are the same in every preset
    fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets) + 2, 4.5), squeeze=False, sharey=True)
    for ax, preset in zip(axes[0], presets, strict=True):
        mine = [r for r in rows if r["preset"] == preset]
        y = np.arange(len(mine))
        ax.barh(y - 0.2, [r["padded_ms"] for r in mine], 0.4, label="one padded call (torch)")
        ax.barh(y + 0.2, [r["split_ms"] for r in mine], 0.4, label="split (auto)")
        ax.set_yticks(y, [textwrap.fill(r["batch"], 24) for r in mine], fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("forward_paged ms (median)")
        ax.set_title(f"{preset} preset, one thread")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parser("attention", __doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for preset in ["small"] if args.quick else ["tiny", "small"]:
        cfg = ModelConfig.preset(preset, num_codebooks=2)
        model = S2SModel.from_seed(cfg, seed=0)
        pool = PagePool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, PAGE, num_pages=4096)
        for name, (cached, new) in CASES.items():
            if args.quick and name not in QUICK_CASES:
                continue
            ms = time_case(model, pool, cached, new, reps=3 if args.quick else 9)
            rows.append(
                {
                    "preset": preset,
                    "batch": name,
                    "sequences": len(new),
                    "new_steps": sum(new),
                    "padded_ms": ms["torch"],
                    "split_ms": ms["auto"],
                    "speedup": ms["torch"] / ms["auto"],
                    **environment(),
                }
            )
    tables = print_table(
        "forward_paged on one tick's batch, CPU: one padded reference call against the split (median ms)",
        rows,
        [
            ("preset", "preset"),
            ("batch", "batch (cached steps)"),
            ("new_steps", "new steps"),
            ("padded_ms", "one call ms"),
            ("split_ms", "split ms"),
            ("speedup", "one call / split"),
        ],
    )
    plot(rows, args.plot)
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
