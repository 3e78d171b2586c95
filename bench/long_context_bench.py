"""One duplex conversation for hours, faster than real time: memory stays flat once its context is a window.

    s2s bench long-context [--hours H] [--max-context-s S] [--quick] [--json PATH] [--plot PATH]

An engine on `tiny` with seeded weights, codec-free (two codebooks of 1024 codes, the shape of the 1.5 kbps codec;
the codec's state is per stream and fixed in size, so it would add time, not memory), a voice prompt of 2 s, and the
server's default context (30 s and the prompt). The user's frames are pushed as codes, 4 a tick as the server's ticks
take them, and the engine ticks back to back. Decode rounds go through the eager twin of the CUDA-graph runner
(`DecodeGraphs(capture=False)`: the same buffers and the same `fits` check a GPU uses), so a round that a GPU would
run eagerly because its page table outgrew the captured width is counted (`eager_rounds`). Every simulated minute
(`--quick`: 3 minutes, sampled every 10 s): the process's RSS, the pages by state, the conversation's page table
and its frames in memory, and the ticks' time. The pool is checked (`cache.check()`) at every sample.
"""

from __future__ import annotations

import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from bench.common import environment, parser, print_table, save_outputs
from bench.concurrency_bench import rss_bytes
from codec.pcm import SAMPLE_RATE
from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.config import CODES_ONLY_FRAME_SIZE
from s2s.engine.engine import Engine, EngineConfig
from s2s.runner.cuda_graphs import DecodeGraphs

FRAMES_PER_TICK = 4
FRAME_S = CODES_ONLY_FRAME_SIZE / SAMPLE_RATE  # the frame of the codec-free engine this bench feeds codes to


class Counted(DecodeGraphs):
    """The eager twin, counting the rounds that would have fallen back to eager on a GPU."""

    eager_rounds = 0

    def fits(self, num_seqs, pages) -> bool:
        ok = super().fits(num_seqs, pages)
        Counted.eager_rounds += not ok
        return ok


def main(argv: list[str] | None = None) -> None:
    p = parser("long-context", __doc__.splitlines()[0])
    p.add_argument("--hours", type=float, default=2.0, help="conversation length, simulated")
    p.add_argument("--max-context-s", type=float, default=30.0, help="the engine's window (the server's default)")
    args = p.parse_args(argv)
    hours, every_s = (3 / 60, 10.0) if args.quick else (args.hours, 60.0)
    model = S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=2), seed=0)
    cfg = EngineConfig(
        max_context=round(args.max_context_s / FRAME_S),
        frames_per_tick=FRAMES_PER_TICK,
        calibration_ticks=0,
        num_pages=4096,
    )
    engine = Engine(model, None, cfg)
    engine.runner.graphs = Counted(model, engine.pool.k, engine.pool.v, cfg.page_size, 4, 512, capture=False)
    rng = np.random.default_rng(0)
    engine.add_voice("voice", rng.integers(0, 1024, (2, 150)))
    cid = engine.open("duplex", prompt="voice", sampling=SamplingParams(seed=1))
    frames, every = round(hours * 3600 / FRAME_S), round(every_s / FRAME_S)
    user = rng.integers(0, 1024, (2, 4096))  # what the user says, over and over
    rows, ticks, started = [], [], time.perf_counter()
    for f in range(0, frames, FRAMES_PER_TICK):
        engine.push_codes(cid, user[:, f % 4096 : f % 4096 + FRAMES_PER_TICK])
        t = time.perf_counter()
        engine.step()
        ticks.append(time.perf_counter() - t)
        while engine.event_queue(cid).qsize():
            engine.event_queue(cid).get_nowait()
        if (f + FRAMES_PER_TICK) % every < FRAMES_PER_TICK:
            s, c = engine.sessions[cid], engine.cache.stats()
            engine.cache.check()
            rows.append(
                {
                    "minutes": round((f + FRAMES_PER_TICK) * FRAME_S / 60, 2),
                    "rss_mb": rss_bytes(os.getpid()) / 2**20,
                    "table_pages": len(s.pages),
                    "dropped_pages": s.dropped,
                    "frames_held": len(s.user.data) + len(s.user.head),
                    "free": c.free,
                    "private": c.private,
                    "cached_locked": c.cached_locked,
                    "cached_evictable": c.cached_evictable,
                    "tick_ms_p50": 1000 * float(np.percentile(ticks, 50)),
                    "tick_ms_p95": 1000 * float(np.percentile(ticks, 95)),
                    "eager_rounds": Counted.eager_rounds,
                    "wall_s": round(time.perf_counter() - started, 1),
                }
            )
            ticks = []
            print(rows[-1], flush=True)
    env = environment()
    for r in rows:
        r |= {"hours": hours, "max_context_s": args.max_context_s, "preset": "tiny", **env}
    columns = [
        ("minutes", "min"),
        ("rss_mb", "RSS MB"),
        ("table_pages", "table pages"),
        ("dropped_pages", "dropped"),
        ("frames_held", "frames held"),
        ("private", "private"),
        ("cached_locked", "locked"),
        ("free", "free"),
        ("tick_ms_p95", "tick p95 ms"),
        ("eager_rounds", "eager rounds"),
    ]
    shown = rows if len(rows) <= 16 else rows[:: max(1, len(rows) // 12)] + rows[-1:]
    tables = print_table(f"One duplex conversation, {hours:g} h simulated (tiny, codec-free, cpu)", shown, columns)
    _plot(rows, args.plot)
    save_outputs(args, rows, tables)


def _plot(rows: list[dict], path) -> None:
    minutes = [r["minutes"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(minutes, [r["rss_mb"] for r in rows], label="RSS (MB)")
    a.set_xlabel("conversation minutes")
    a.set_ylabel("MB")
    a.legend()
    for key in ("table_pages", "private", "cached_locked"):
        b.plot(minutes, [r[key] for r in rows], label=key)
    b.set_xlabel("conversation minutes")
    b.set_ylabel("pages")
    b.legend()
    fig.suptitle("One duplex conversation: memory over time")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
