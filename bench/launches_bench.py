"""Launches benchmark: torch ops per engine tick, by phase, eager and on CUDA graphs.

    s2s bench launches [--quick] [--conversations 1,4,16,64,256] [--model DIR | --preset NAME] [--json PATH]

The models served here are small, so on a GPU a tick's time is mostly the CPU issuing kernels, about one per torch
op. This counts the ops (every aten call but views, which launch nothing, through a TorchDispatchMode) of ticks of N
silent duplex conversations, 4 frames a tick, on the CPU: the model's forward, sampling, the codec's encoder and
decoder, and within them EnCodec's LSTM as the CPU steps it (a GPU runs cuDNN's fused LSTM instead). Each N runs
twice: on the eager paths, and on the graphs' paths as a GPU takes them (the decode rounds, sampling and the codec's
steady pushes: `DecodeGraphs`, `SamplingGraphs`, `CodecGraphs`), through their eager twins, each replay counted as
one launch and its copies in as theirs. Batched work costs the same ops at any N: what grows with N is a loop over
conversations issuing ops. Counts do not depend on the machine; no time is measured. By default the models are
the `tiny` and `small` presets on a seeded codec; `--model DIR` counts that folder's model (`--model
s2s/weights/echo`: the shipped echo, on the shipped codec, what `s2s serve` runs by default), `--preset NAME` one
preset.
"""

from __future__ import annotations

import collections

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import ModelChoice, add_model_args, environment, model_choice, parser, print_table, save_outputs
from codec import EncodecTokenizer, stream_layers
from s2s import Engine, EngineConfig, SamplingParams
from s2s.runner import sampling, sampling_graphs
from s2s.runner.codec_graphs import codec_graphs
from s2s.runner.cuda_graphs import DecodeGraphs
from s2s.runner.sampling_graphs import SamplingGraphs

# (engine component, method): phase
PHASES = {
    ("audio", "encode"): "encode",
    ("runner", "forward"): "forward",
    ("runner", "sample"): "sample",
    ("audio", "decode"): "decode",
}
FRAMES_PER_TICK = 4
PATHS = ("eager", "graphs")
REPLAY = "replay"  # the label of what a graph holds: one launch, whatever it runs
HOST = "host"  # the label of torch ops on host tensors, which a GPU does not launch (a graph's row keys)


class _Count(TorchDispatchMode):
    """Counts aten calls under the innermost label of `stack`."""

    def __init__(self, stack: list[str], counts: collections.Counter):
        super().__init__()
        self.stack, self.counts = stack, counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        generator = (kwargs or {}).get("generator")
        on_host = generator is not None and generator.device.type == "cpu"  # a row's sampling noise: host work
        if not (func.is_view or on_host or REPLAY in self.stack or HOST in self.stack):  # a view launches nothing
            self.counts[self.stack[-1]] += 1
        return func(*args, **(kwargs or {}))


def _replayed(fn, stack: list[str], counts: collections.Counter):
    """A graph's eager twin counted as its replay: one launch for the phase that calls it."""

    def run(*args, **kwargs):
        counts[stack[-1]] += 1
        stack.append(REPLAY)
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()

    return run


def _labelled(fn, label: str, stack: list[str]):
    def run(*args, **kwargs):
        stack.append(label)
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()

    return run


def _on_graphs(engine: Engine, tok: EncodecTokenizer, stack: list[str], counts: collections.Counter) -> None:
    """The engine as a GPU runs it, through the graphs' eager twins, each replay counted as one launch."""
    model, cfg, n = engine.model, engine.model.config, engine.cfg.max_conversations
    runner, audio = engine.runner, engine.audio
    max_pages = -(-cfg.max_position_embeddings // engine.cfg.page_size)  # as `ModelRunner`
    runner.graphs = DecodeGraphs(model, engine.pool.k, engine.pool.v, engine.cfg.page_size, n, max_pages, False)
    runner.sampler = SamplingGraphs(n, cfg.num_codebooks, cfg.vocab_size, cfg.pad_id, "cpu", capture=False)
    for side, graphs in zip((audio.encoder, audio.decoder), codec_graphs(tok, n, FRAMES_PER_TICK, False), strict=True):
        side.use_graphs(graphs)
    runner.graphs._step = _replayed(runner.graphs._step, stack, counts)
    runner.sampler._sample = _replayed(runner.sampler._sample, stack, counts)
    sampling_graphs.stream_keys = _labelled(sampling.stream_keys, HOST, stack)
    for graphs in (audio.encoder.graphs, audio.decoder.graphs):
        graphs._step = _replayed(graphs._step, stack, counts)


def count(choice: ModelChoice, conversations: int, ticks: int, path: str) -> dict:
    """Mean ops per tick by phase, over `ticks` ticks after the codec's streams have warmed up; `path`: "eager", or
    "graphs" (as a GPU runs the tick)."""
    model, tok = choice.load()
    cfg = EngineConfig(
        calibration_ticks=0,
        frames_per_tick=FRAMES_PER_TICK,
        max_conversations=conversations,
        num_pages=conversations * ((8 + ticks) * FRAMES_PER_TICK // 16 + 4),  # each one's frames, and room
    )
    engine = Engine(model, tok, cfg)
    stack, counts = ["other"], collections.Counter()
    if path == "graphs":
        _on_graphs(engine, tok, stack, counts)
    for (part, method), label in PHASES.items():
        component = getattr(engine, part)
        setattr(component, method, _labelled(getattr(component, method), label, stack))
    lstm = stream_layers._LSTM.stepped
    stream_layers._LSTM.stepped = _labelled(lstm, "codec LSTM", stack)
    try:
        cids = [engine.open("duplex", sampling=SamplingParams(seed=i), admit=False) for i in range(conversations)]
        silence = np.zeros(tok.frame_size * FRAMES_PER_TICK, dtype=np.float32)
        for tick in range(8 + ticks):  # 8 ticks: both codec streams past their 7-frame warm-up
            for cid in cids:
                engine.push_audio(cid, silence)
            if tick < 8:
                engine.step()
                continue
            if tick == 8:
                counts.clear()  # (what the warm-up's replays counted)
            with _Count(stack, counts):
                engine.step()
    finally:
        stream_layers._LSTM.stepped = lstm
        sampling_graphs.stream_keys = sampling.stream_keys
    return {
        "preset": choice.label,
        "conversations": conversations,
        "path": path,
        "frames_per_tick": FRAMES_PER_TICK,
        **{
            f"{label.replace(' ', '_').lower()}_ops": counts[label] / ticks
            for label in [*PHASES.values(), "codec LSTM", "other"]
        },
        "total_ops": sum(counts.values()) / ticks,
    }


def plot(rows: list[dict], path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r['preset']}, {r['conversations']} conv, {r['path']}" for r in rows]
    bottom = np.zeros(len(rows))
    for key in ("forward_ops", "sample_ops", "encode_ops", "decode_ops", "codec_lstm_ops", "other_ops"):
        h = np.array([r[key] for r in rows])
        ax.bar(labels, h, bottom=bottom, label=key.removesuffix("_ops"))
        bottom += h
    ax.set_ylabel("torch ops per tick (a replay: one)")
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    ax.set_title(f"Ops per tick, {FRAMES_PER_TICK} frames a tick")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = parser("launches", __doc__.splitlines()[0])
    p.add_argument("--conversations", default="1,4,16,64,256", help="the levels of N")
    add_model_args(p, default="tiny and small")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    levels = [1, 16] if args.quick else [int(n) for n in args.conversations.split(",")]
    if args.model is not None or args.preset is not None:
        choices = [model_choice(args)]
    else:  # (the presets, each on the seeded codec)
        choices = [ModelChoice(preset=name) for name in (["small"] if args.quick else ["tiny", "small"])]
    grid = [(c, n) for c in choices for n in levels]
    rows = [{**count(p, n, 2 if args.quick else 4, path), **environment()} for p, n in grid for path in PATHS]
    tables = print_table(
        "Torch ops per tick by phase (one op is about one kernel launch on a GPU; a graph's replay counts one)",
        rows,
        [
            ("preset", "preset"),
            ("conversations", "conversations"),
            ("path", "path"),
            ("forward_ops", "model forward"),
            ("sample_ops", "sampling"),
            ("encode_ops", "codec encoder"),
            ("decode_ops", "codec decoder"),
            ("codec_lstm_ops", "codec LSTM (stepped)"),
            ("other_ops", "other"),
            ("total_ops", "total"),
        ],
    )
    plot(rows, args.plot)
    save_outputs(args, rows, tables)


if __name__ == "__main__":
    main()
