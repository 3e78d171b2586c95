"""Engine benchmark: a duplex sweep in real time, this engine beside a loop over transformers' LlamaModel.

    s2s bench engine [--quick] [--json PATH] [--plot PATH]

In-process, no sockets. For each concurrency N, N duplex conversations ask to open one every 3 ticks; each admitted
one streams espeak-ng speech, a codec frame at a time in real time (EnCodec's: 320 samples, 13.33 ms), for the
run's length, and reads its audio back.
The driver paces ticks to the wall clock, as the engine thread does. Both systems are `s2s.Engine` with the same
codec path, scheduler, sampling and admission control (calibrated on their own tick times); they differ only in the
model step:
- engine: one batched `S2SModel.forward_paged` over all conversations, K/V in radix-cache pages;
- engine, deterministic: the same in `EngineConfig(deterministic=True)` (batch-invariant kernels, the codec a row
  and a frame a call): what that mode costs;
- transformers loop: for each conversation, `LlamaModel` (sdpa) with its own `DynamicCache`, our embeddings and
  heads around it (what a server built on transformers does without a batching engine).
Same seeded weights (small preset). A deadline miss is an output frame sent later than its playback time (counted
from the conversation's first output frame) plus the jitter buffer (`EngineConfig.jitter_buffer_s`, in each row).
"""

from __future__ import annotations

import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm
from transformers import DynamicCache, LlamaModel

from bench.common import SENTENCES, environment, parser, peak_rss_bytes, percentiles, print_table, save_outputs
from codec import EncodecTokenizer
from s2s import ModelConfig, S2SModel, SamplingParams
from s2s.engine.engine import AudioEvent, Engine, EngineConfig, Refused
from s2s.runner.model_runner import ModelRunner
from speech.sample import speech, synthesize


class TransformersRunner(ModelRunner):
    """The engine's model step as a per-conversation transformers loop: each session keeps its own `DynamicCache`."""

    def __init__(self, model: S2SModel, *args) -> None:
        super().__init__(model, *args)
        self.llama = LlamaModel(model.config.to_llama_config()).eval()
        self.llama.config._attn_implementation = "sdpa"
        self.llama.load_state_dict(model.backbone.state_dict(), strict=False)
        self.caches: dict[str, DynamicCache] = {}  # by session id (a `Session` takes no new attributes)

    def attend(self, rows: int, keys: int) -> None:
        """Nothing: this loop has no paged attention to time, so its admission charges no window (as before d293da2,
        which charges the engine's)."""

    def forward(self, batch) -> torch.Tensor:
        assert batch.lane is None, "the transformers loop steps every conversation as its own work"
        logits = []
        for w in batch.work:
            s = w.session
            if (cache := self.caches.get(s.id)) is None:
                cache = self.caches[s.id] = DynamicCache(config=self.llama.config)
            if cache.get_seq_length() != s.computed:
                cache.crop(s.computed)
            x = self.model.embed(torch.from_numpy(w.tokens))[None]
            pos = torch.arange(s.computed, s.computed + len(w.tokens))[None]
            hidden = self.llama(inputs_embeds=x, past_key_values=cache, position_ids=pos, use_cache=True)
            logits.append(self.model.logits(hidden.last_hidden_state[0, -1]))
        return torch.stack(logits)


class TransformersLoop(Engine):
    """The same engine with its model step replaced by a per-conversation transformers loop."""

    runner_class = TransformersRunner
    duplex_lane = False


SYSTEMS = ("engine", "engine, deterministic", "transformers loop")


def clips() -> list[np.ndarray]:
    try:
        return [synthesize(s) for s in SENTENCES]
    except RuntimeError:
        return [speech()[0]]


def run(engine: Engine, n: int, seconds: float, voices: list[np.ndarray]) -> dict:
    """N conversations ask to open, one every 3 ticks; a refused one asks again every 10 ticks. Audio reaches the
    engine by the wall clock (a frame per frame's duration per conversation), whatever the engine's pace."""
    tick, frame, frame_size = engine.cfg.tick_s, engine.cfg.frame_s, engine.cfg.frame_size
    asks = {i: 3 * i for i in range(n)}  # conversation -> tick of its next attempt
    total = int(seconds / tick) + 3 * n
    live: dict[str, tuple[np.ndarray, float]] = {}  # cid -> (clip, wall time it opened)
    sent: dict[str, int] = {}
    refused = frames_out = 0
    tick_times = []
    t0 = time.perf_counter()
    next_tick = t0
    for k in range(total):
        for i, at in list(asks.items()):
            if at != k:
                continue
            try:
                cid = engine.open("duplex", sampling=SamplingParams(temperature=0.8, top_k=50, seed=i))
                live[cid] = (voices[i % len(voices)], time.perf_counter())
                sent[cid] = 0
                del asks[i]
            except Refused:
                refused += 1
                asks[i] = k + 10
        now = time.perf_counter()
        for cid, (clip, opened) in live.items():
            due = int((now - opened) / frame) + 1
            if due > sent[cid]:
                a, b = sent[cid] * frame_size % len(clip), due * frame_size % len(clip)
                chunk = clip[a:b] if b > a else np.concatenate([clip[a:], clip[:b]])
                engine.push_audio(cid, chunk)
                sent[cid] = due
        start = time.perf_counter()
        engine.step()
        tick_times.append(time.perf_counter() - start)
        for cid in live:
            q = engine.event_queue(cid)
            while not q.empty():
                event = q.get()
                if isinstance(event, AudioEvent):
                    frames_out += len(event.pcm) // frame_size
        next_tick += tick
        delay = next_tick - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        else:
            next_tick = time.perf_counter()  # behind: run the next tick at once, as the engine thread does
    wall = time.perf_counter() - t0
    for cid in list(live):
        engine.close(cid)
    p = percentiles(tick_times, 1000)
    return {
        "concurrency": n,
        "admitted": len(live),
        "refusals": refused,
        "tick_ms_p50": p["p50"],
        "tick_ms_p95": p["p95"],
        "tick_ms_p99": p["p99"],
        "rtf_mean": float(np.mean(tick_times) / tick),
        "throughput_x_realtime": frames_out * frame / wall,
        "deadline_misses": engine.stats.deadline_misses,
        "seconds": seconds,
        "tick_s": tick,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def plot(rows: list[dict], path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system in sorted({r["system"] for r in rows}):
        pts = sorted(
            (r["concurrency"], r["throughput_x_realtime"], r["tick_ms_p50"]) for r in rows if r["system"] == system
        )
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=system)
    axes[0].set_ylabel("throughput (x real time, all conversations)")
    axes[1].set_ylabel("tick p50 (ms)")
    budget = rows[0]["tick_s"] * 1000
    axes[1].axhline(budget, color="k", ls="--", lw=1, label=f"tick budget ({budget:.1f} ms)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("conversations asking to open")
        ax.legend(fontsize=8)
    fig.suptitle("Duplex sweep, small preset, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = parser("engine", __doc__.splitlines()[0])
    p.add_argument("--frames-per-tick", type=int, default=4, help="duplex frames per tick (codec chunk length)")
    args = p.parse_args(argv)
    levels, seconds = ([1, 4], 1.5) if args.quick else ([1, 2, 4, 8, 16, 32], 4.0)
    tok = EncodecTokenizer.from_pretrained()
    model = S2SModel.from_seed(ModelConfig.preset("small", num_codebooks=tok.num_codebooks), seed=0)
    voices = clips()
    rows = []
    grid = [(n, s) for n in levels for s in SYSTEMS]
    for n, system in tqdm(grid, desc="engine sweep", file=sys.stderr):
        cfg = EngineConfig(
            cache_mode="paged" if system == "transformers loop" else "radix",
            num_pages=8192,
            max_conversations=max(levels),
            frames_per_tick=args.frames_per_tick,
            deterministic=system == "engine, deterministic",
        )
        engine = TransformersLoop(model, tok, cfg) if system == "transformers loop" else Engine(model, tok, cfg)
        row = run(engine, n, seconds, voices)
        rows.append(
            {
                "system": system,
                "preset": "small",
                "frames_per_tick": args.frames_per_tick,
                "jitter_buffer_s": cfg.jitter_buffer_s,
                **row,
            }
        )
    tables = print_table(
        "Duplex sweep: this engine, in deterministic mode, and a transformers loop (same weights, same codec path)",
        rows,
        [
            ("system", "system"),
            ("concurrency", "asked"),
            ("admitted", "admitted"),
            ("refusals", "refused"),
            ("tick_ms_p50", "tick p50 ms"),
            ("tick_ms_p95", "tick p95 ms"),
            ("rtf_mean", "RTF mean"),
            ("throughput_x_realtime", "throughput x RT"),
            ("deadline_misses", "deadline misses"),
            ("peak_rss_bytes", "peak RSS B"),
        ],
    )
    env = {**environment(), "quick": args.quick}
    plot(rows, args.plot)
    save_outputs(args, [{**env, **r} for r in rows], tables)


if __name__ == "__main__":
    main()
