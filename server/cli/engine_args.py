"""The engine that `s2s serve`'s options describe, built through `s2s.build`."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from codec import Tokenizer
from codec.pcm import SAMPLE_RATE
from s2s import Engine, EngineConfig, placement
from s2s.build import build_engine, load_weights, weight_folders
from server.cli.options import DEFAULT_TICK_S, default_threads


def weights_of(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """The codec and model paths `add_engine_args` names (`s2s.build.weight_folders`)."""
    return weight_folders(args.model, args.codec, args.preset, args.random_weights)


def placement_of(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """`--device` and `--dtype` (`add_engine_args`) resolved for this machine."""
    try:
        return placement(args.device, args.dtype)
    except ValueError as e:
        raise SystemExit(f"--device/--dtype: {e}") from None


def engine_of(args: argparse.Namespace, frontends: int = 0) -> tuple[Engine, Tokenizer]:
    """The engine `add_engine_args` describes, with the voice prompts of `--prompts`, and its codec; `frontends`: the
    front-end processes beside it (their cores are not the engine's)."""
    torch.set_num_threads(args.threads or default_threads(frontends))
    device, dtype = placement_of(args)
    codec, model_folder = weights_of(args)
    try:
        model, tok = load_weights(model_folder, codec, args.codec is not None, args.bandwidth, device, dtype)
    except (OSError, ValueError) as e:  # a path that is no model or codec, or a checkpoint that does not load
        raise SystemExit(f"--model/--codec: {e}") from None
    frame_s = tok.frame_size / SAMPLE_RATE  # the options in seconds become the codec's frames
    config = EngineConfig(
        cache_mode=args.cache,
        max_conversations=args.max_conversations,
        frames_per_tick=args.frames_per_tick or max(1, round(DEFAULT_TICK_S / frame_s)),
        num_pages=args.kv_pages,
        max_reply_frames=args.max_reply_frames,
        max_context=round(args.max_context_s / frame_s),
        admission_headroom=args.admission_headroom,
        jitter_buffer_s=args.jitter_buffer_ms / 1000 if args.jitter_buffer_ms else None,
        cuda_graphs=not args.enforce_eager,
        deterministic=args.deterministic,
    )
    return build_engine(config, tok, model, args.preset, args.prompts, device, dtype), tok
