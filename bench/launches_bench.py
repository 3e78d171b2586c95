"""Launches benchmark: torch ops per engine tick, by phase, in eager mode.

    s2s bench launches [--quick] [--conversations 1,4,16,64,256] [--json PATH] [--plot PATH]

The models served here are small, so on a GPU a tick's time is mostly the CPU issuing kernels, about one per torch
op. This counts the ops (every aten call but views, which launch nothing, through a TorchDispatchMode) of ticks of N
silent duplex conversations, 4 frames a tick, on the CPU with the eager paths: the model's forward, sampling, the
codec's encoder and decoder, and within them EnCodec's LSTM as the CPU steps it (a GPU runs cuDNN's fused LSTM
instead, and decode rounds on CUDA graphs, neither of which runs here). Each row's sampling noise comes from its own
CPU generator on any device (`s2s/sampling.py`): host work, copied over in one copy, so not counted. Batched work costs
the same ops at any N: what grows with N is a loop over conversations issuing ops. Counts do not depend on the
machine; no time is measured.
"""

from __future__ import annotations

import collections

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import environment, parser, print_table, save_outputs
from codec import EncodecTokenizer, stream_layers
from s2s import Engine, EngineConfig, ModelConfig, S2SModel, SamplingParams

# (engine component, method): phase
PHASES = {
    ("audio", "encode"): "encode",
    ("runner", "forward"): "forward",
    ("runner", "sample"): "sample",
    ("audio", "decode"): "decode",
}
FRAMES_PER_TICK = 4


class _Count(TorchDispatchMode):
    """Counts aten calls under the innermost label of `stack`."""

    def __init__(self, stack: list[str], counts: collections.Counter):
        super().__init__()
        self.stack, self.counts = stack, counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        generator = (kwargs or {}).get("generator")
        on_host = generator is not None and generator.device.type == "cpu"  # a row's sampling noise: host work
        if not (func.is_view or on_host):  # a view (a select, a slice, a detach) launches no kernel either
            self.counts[self.stack[-1]] += 1
        return func(*args, **(kwargs or {}))


def _labelled(fn, label: str, stack: list[str]):
    def run(*args, **kwargs):
        stack.append(label)
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()

    return run


def count(preset: str, conversations: int, ticks: int) -> dict:
    """Mean ops per tick by phase, over `ticks` ticks after the codec's streams have warmed up."""
    tok = EncodecTokenizer.from_pretrained()
    model = S2SModel.from_seed(ModelConfig.preset(preset, num_codebooks=tok.num_codebooks), seed=0)
    cfg = EngineConfig(
        calibration_ticks=0,
        frames_per_tick=FRAMES_PER_TICK,
        max_conversations=conversations,
        num_pages=conversations * ((8 + ticks) * FRAMES_PER_TICK // 16 + 4),  # each one's frames, and room
    )
    engine = Engine(model, tok, cfg)
    stack, counts = ["other"], collections.Counter()
    for (part, method), label in PHASES.items():
        component = getattr(engine, part)
        setattr(component, method, _labelled(getattr(component, method), label, stack))
    lstm = stream_layers._LSTM.stepped
    stream_layers._LSTM.stepped = _labelled(lstm, "codec LSTM", stack)
    try:
        cids = [engine.open("duplex", sampling=SamplingParams(seed=i), admit=False) for i in range(conversations)]
        silence = np.zeros(320 * FRAMES_PER_TICK, dtype=np.float32)
        for tick in range(8 + ticks):  # 8 ticks: both codec streams past their 7-frame warm-up
            for cid in cids:
                engine.push_audio(cid, silence)
            if tick < 8:
                engine.step()
                continue
            with _Count(stack, counts):
                engine.step()
    finally:
        stream_layers._LSTM.stepped = lstm
    return {
        "preset": preset,
        "conversations": conversations,
        "frames_per_tick": FRAMES_PER_TICK,
        **{
            f"{label.replace(' ', '_').lower()}_ops": counts[label] / ticks
            for label in [*PHASES.values(), "codec LSTM", "other"]
        },
        "total_ops": sum(counts.values()) / ticks,
    }


def plot(rows: list[dict], path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['preset']}, {r['conversations']} conv" for r in rows]
    bottom = np.zeros(len(rows))
    for key in ("forward_ops", "sample_ops", "encode_ops", "decode_ops", "codec_lstm_ops", "other_ops"):
        h = np.array([r[key] for r in rows])
        ax.bar(labels, h, bottom=bottom, label=key.removesuffix("_ops"))
        bottom += h
    ax.set_ylabel("torch ops per tick (eager)")
    ax.set_title(f"Ops per tick, {FRAMES_PER_TICK} frames a tick")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = parser("launches", __doc__.splitlines()[0])
    p.add_argument("--conversations", default="1,4,16,64,256", help="the levels of N")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    levels = [1, 16] if args.quick else [int(n) for n in args.conversations.split(",")]
    grid = [("small", n) for n in levels] if args.quick else [(p, n) for p in ("tiny", "small") for n in levels]
    rows = [{**count(p, n, ticks=2 if args.quick else 4), **environment()} for p, n in grid]
    tables = print_table(
        "Torch ops per tick by phase (eager; one op is about one kernel launch on a GPU)",
        rows,
        [
            ("preset", "preset"),
            ("conversations", "conversations"),
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
