"""Tick benchmark: the engine's tick time on the shipped codec and echo model, by phase, at N duplex conversations.

    s2s bench tick [--quick] [--conversations 1,4,8,16] [--threads 1,2] [--input silence,speech] [--json PATH]

In-process and unpaced: N duplex conversations (the server's default sampling, seeded), each pushed a tick's audio
(4 frames: 53.3 ms) before every tick, of digital silence or of speech (the sample in `speech/data/`, looped, each
conversation from its own offset). After 12 ticks of warm-up (both codec streams past their 7-frame warm-up), the
ticks are timed, whole and by phase (the codec's encoder, the model's forward, sampling, the codec's decoder; the
rest is scheduling and bookkeeping). A tick must fit well inside its 53.3 ms on a server's cores, whose websocket
threads share them.
"""

from __future__ import annotations

import collections
import time

import numpy as np
import torch

from bench.common import environment, parser, print_table, save_outputs
from codec import EncodecTokenizer
from s2s import Engine, EngineConfig, S2SModel, SamplingParams
from s2s.models.shipped import shipped
from speech.sample import speech

FRAMES_PER_TICK = 4
WARMUP_TICKS = 12
PHASES = {("audio", "encode"): "encode", ("runner", "forward"): "forward", ("runner", "sample"): "sample"}
PHASES[("audio", "decode")] = "decode"


def _timed(fn, label: str, spent: collections.Counter):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start

    return run


def measure(model: S2SModel, tok: EncodecTokenizer, conversations: int, ticks: int, source: str) -> dict:
    """Mean and median tick times (ms) over `ticks` timed ticks, and each phase's mean."""
    cfg = EngineConfig(
        calibration_ticks=0,
        frames_per_tick=FRAMES_PER_TICK,
        max_conversations=conversations,
        num_pages=conversations * ((WARMUP_TICKS + ticks) * FRAMES_PER_TICK // 16 + 4),
    )
    engine = Engine(model, tok, cfg)
    spent: collections.Counter = collections.Counter()
    for (part, method), label in PHASES.items():
        component = getattr(engine, part)
        setattr(component, method, _timed(getattr(component, method), label, spent))
    chunk = tok.frame_size * FRAMES_PER_TICK
    audio = speech()[0].astype(np.float32) if source == "speech" else np.zeros(chunk, np.float32)
    cids = [engine.open("duplex", sampling=SamplingParams(seed=i), admit=False) for i in range(conversations)]
    times = []
    for tick in range(WARMUP_TICKS + ticks):
        for i, cid in enumerate(cids):
            at = (i * 7919 + tick * chunk) % max(1, len(audio) - chunk)
            engine.push_audio(cid, audio[at : at + chunk])
        if tick == WARMUP_TICKS:
            spent.clear()
        start = time.perf_counter()
        engine.step()
        if tick >= WARMUP_TICKS:
            times.append(time.perf_counter() - start)
    ms = np.array(times) * 1000
    return {
        "conversations": conversations,
        "input": source,
        "threads": torch.get_num_threads(),
        "tick_ms_mean": float(ms.mean()),
        "tick_ms_p50": float(np.median(ms)),
        "tick_ms_p90": float(np.percentile(ms, 90)),
        **{f"{label}_ms": 1000 * spent[label] / ticks for label in PHASES.values()},
        "misses": engine.stats.deadline_misses,
    }


def main(argv: list[str] | None = None) -> None:
    p = parser("tick", __doc__.splitlines()[0])
    p.add_argument("--conversations", default="1,4,8,16", help="the levels of N")
    p.add_argument("--threads", default="1,2", help="torch's intra-op threads, each level")
    p.add_argument("--input", default="silence,speech", help="what the conversations send: silence, speech")
    p.add_argument("--ticks", type=int, default=60, help="timed ticks per level")
    args = p.parse_args(argv)
    ticks = 15 if args.quick else args.ticks
    tok = EncodecTokenizer.from_pretrained(shipped("codec"))
    model = S2SModel.from_pretrained(shipped("model"))
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for source in args.input.split(","):
            for n in (int(n) for n in args.conversations.split(",")):
                rows.append({**measure(model, tok, n, ticks, source), **environment()})
    tables = print_table(
        f"Tick time, shipped codec and echo model, {FRAMES_PER_TICK} frames a tick (budget 53.3 ms), unpaced",
        rows,
        [
            ("threads", "threads"),
            ("input", "input"),
            ("conversations", "N"),
            ("tick_ms_p50", "tick p50 ms"),
            ("tick_ms_mean", "tick mean ms"),
            ("tick_ms_p90", "tick p90 ms"),
            ("encode_ms", "encode ms"),
            ("forward_ms", "forward ms"),
            ("sample_ms", "sample ms"),
            ("decode_ms", "decode ms"),
        ],
    )
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
