"""What every benchmark shares: argument parsing (the weights served, the device), percentiles, memory, tables, JSON
rows and plots."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from codec.pcm import SAMPLE_RATE
from s2s import placement
from s2s.models.shipped import MODEL as SHIPPED_MODEL
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


@dataclass(frozen=True)
class ModelChoice:
    """The weights a benchmark serves (`s2s serve`'s arguments) or loads in-process (`load`), as `add_model_args`
    reads them: a model folder (`--model DIR`: with the codec it holds, Moshi's Mimi, else the shipped codec), a
    preset (`--preset NAME`: a model of that shape with seeded weights, over a seeded EnCodec: what `s2s serve
    --preset NAME` runs), or neither: the shipped codec and echo model, what `s2s serve` runs with no flags."""

    folder: Path | None = None
    preset: str | None = None

    @property
    def label(self) -> str:
        """For tables and the rows' `model`: "shipped echo", "preset NAME" or the model folder's name."""
        if self.preset is not None:
            return f"preset {self.preset}"
        if self.folder is None or self.folder.resolve() == SHIPPED_MODEL.resolve():
            return "shipped echo"
        return self.folder.resolve().name

    def serve_args(self) -> list[str]:
        """What `s2s serve` (and `s2s cluster`, for its replicas) takes to serve these weights."""
        if self.preset is not None:
            return ["--preset", self.preset]
        return ["--model", str(self.folder)] if self.folder is not None else []

    @functools.cached_property
    def frame_size(self) -> int:
        """Samples in one frame of the codec served: EnCodec's (the shipped codec, or a preset's seeded one) unless
        the model folder holds its own codec (Moshi's Mimi), whose config says (read without building the model)."""
        own = None if self.folder is None else _own_codec(self.folder)
        if own is None:
            return _encodec_frame_size()
        from codec.mimi.weights import read_checkpoint

        return read_checkpoint(*own)[0].frame_size

    @property
    def frame_s(self) -> float:
        return self.frame_size / SAMPLE_RATE

    def frames(self, encodec_frames: int) -> int:
        """As many of the served codec's frames as last `encodec_frames` of EnCodec's 13.3 ms ones (at least one):
        a benchmark's tick and reply lengths, written in EnCodec frames, keep their seconds on another codec."""
        return max(1, round(encodec_frames * _encodec_frame_size() / self.frame_size))

    def load(self, device: torch.device | None = None, dtype: torch.dtype = torch.float32):
        """(model, codec) in this process, as `s2s serve` loads them (`s2s.build`), for in-process benchmarks."""
        from s2s import ModelConfig, S2SModel
        from s2s.build import load_weights, weight_folders

        codec, folder = weight_folders(self.folder, None, self.preset)
        try:
            model, tok = load_weights(folder, codec, False, 1.5, device, dtype)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--model: {e}") from None
        if model is None:  # a preset's seeded weights, shaped to the codec's codebooks (as `s2s.build.build_engine`)
            shape = ModelConfig.preset(self.preset, num_codebooks=tok.num_codebooks, codebook_size=tok.codebook_size)
            model = S2SModel.from_seed(shape, seed=0, dtype=dtype, device=device or torch.device("cpu"))
        return model, tok


def _encodec_frame_size() -> int:
    from codec.tokenizer import EncodecTokenizer  # (transformers: seconds to import, for benchmarks that serve)

    return EncodecTokenizer.frame_size


def _own_codec(folder: Path) -> tuple[Path, Path | None] | None:
    """The codec a model folder holds (its path and a Mimi file's config), as `s2s.models.family.load_model` finds
    it: Kyutai's layout names its Mimi file, transformers' Moshi folder is its own Mimi; None for this project's."""
    from s2s.models.moshi.checkpoint import is_kyutai_folder, read_kyutai_folder

    if is_kyutai_folder(folder):
        found = read_kyutai_folder(folder)
        return (found.mimi, found.mimi_config) if found.mimi is not None else None
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "moshi":
        return folder, None
    return None


def add_model_args(
    p: argparse.ArgumentParser, default: str | None = None, preset_codec: str = "a seeded codec"
) -> None:
    """`--model DIR` and `--preset NAME`, the weights served (`model_choice`); with neither, the preset `default`,
    or with no default the shipped codec and echo model (what `s2s serve` runs with no flags). `preset_codec`: what a
    preset runs over, for the help (a benchmark that gives `s2s serve` another `--codec` says so)."""
    shipped = "the shipped codec and echo model"
    given = f"the {default} preset" if default else shipped
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"serve this model folder (its own codec if it holds one, else the shipped codec; default: {given}; "
        f"{SHIPPED_MODEL} is the shipped echo model)",
    )
    p.add_argument(
        "--preset",
        default=None,
        help=f"serve a seeded random model of this shape: tiny, small, base, large (over {preset_codec}; default: "
        f"{given})",
    )
    p.set_defaults(model_default=default)


def model_choice(args: argparse.Namespace) -> ModelChoice:
    """The weights `add_model_args` named; both flags at once, an unknown preset or a missing folder exit."""
    default = getattr(args, "model_default", None)
    if args.model is not None and args.preset is not None:
        neither = f"the {default} preset" if default else "the shipped codec and echo model"
        raise SystemExit(f"--model and --preset name different weights: give one, or neither for {neither}")
    preset = default if args.model is None and args.preset is None else args.preset
    if preset is not None:
        from s2s import ModelConfig

        try:
            ModelConfig.preset(preset)
        except ValueError as e:
            raise SystemExit(f"--preset: {e}") from None
    if args.model is not None and not args.model.is_dir():
        raise SystemExit(f"--model: {args.model} is not a model folder")
    return ModelChoice(args.model, preset)


def model_server_args(args: argparse.Namespace) -> list[str]:
    """`s2s serve`'s arguments for the weights `add_model_args` named."""
    return model_choice(args).serve_args()


def model_label(args: argparse.Namespace) -> str:
    """The short name of the weights `add_model_args` named, for tables and each JSON row's `model`."""
    return model_choice(args).label


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
