"""The delay pattern: codebook k lags k steps (or `delays[k]`), so one forward emits every codebook of a frame.

Step t holds codebook k of frame t - delays[k]; positions before a codebook's first frame, or after its last, hold
`pad_id`. `frames_to_steps` and `steps_to_frames` are exact inverses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def frames_to_steps(frames: torch.Tensor, delays: Sequence[int], pad_id: int) -> torch.Tensor:
    """`[B, K, F]` frames -> `[B, K, F + max(delays)]` steps."""
    batch, k, f = frames.shape
    if len(delays) != k:
        raise ValueError(f"{len(delays)} delays for {k} codebooks")
    steps = frames.new_full((batch, k, f + max(delays)), pad_id)
    for i, d in enumerate(delays):
        steps[:, i, d : d + f] = frames[:, i]
    return steps


def steps_to_frames(steps: torch.Tensor, delays: Sequence[int]) -> torch.Tensor:
    """`[B, K, T]` steps -> `[B, K, T - max(delays)]` frames (the frames every codebook has reached)."""
    k, t = steps.shape[1], steps.shape[2]
    if len(delays) != k:
        raise ValueError(f"{len(delays)} delays for {k} codebooks")
    f = t - max(delays)
    if f < 0:
        raise ValueError(f"{t} steps hold no complete frame with delays {list(delays)}")
    return torch.stack([steps[:, i, d : d + f] for i, d in enumerate(delays)], dim=1)
