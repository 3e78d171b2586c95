"""Kyutai's own streaming Mimi (moshi 0.2.13), timed for `s2s bench codec --codec mimi`: run in .venv-moshi.

    .venv-moshi/bin/python bench/mimi_kyutai.py OUT_DIR --batches 1 4 --frames 40 [--threads 1]

Builds Kyutai's default Mimi (`moshi.models.loaders._mimi_config`: 8 codebooks used) with seeded random weights made
to carry a signal (`tests/mimi_reference.py`'s `randomize`), writes them to OUT_DIR/mimi.safetensors (the same
weights the other side of the comparison loads), and for each batch size B streams B rows of seeded signals one
80 ms frame a call, as Kyutai's server does (`with mimi.streaming(B)`): encode, then decode of those codes. Writes
OUT_DIR/kyutai.json: per B, each frame's encode and decode time (after `warmup` frames), the first frame's encode
and decode time on a fresh stream, and the codes and audio of row 0 (to check that both sides give the same).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mimi_reference import randomize, signals  # noqa: E402


@torch.no_grad()
def stream(mimi, wav: torch.Tensor) -> dict:
    """`wav` [B, F * frame_size] streamed a frame a call: times (s) and row 0's codes and audio."""
    fs, rows, frames = mimi.frame_size, wav.shape[0], wav.shape[1] // mimi.frame_size
    encode_s, decode_s, codes, audio = [], [], [], []
    with mimi.streaming(rows):
        for f in range(frames):
            start = time.perf_counter()
            c = mimi.encode(wav[:, None, f * fs : (f + 1) * fs])
            middle = time.perf_counter()
            a = mimi.decode(c)
            encode_s.append(middle - start)
            decode_s.append(time.perf_counter() - middle)
            codes.append(c[0].numpy())
            audio.append(a[0, 0].numpy())
    return {
        "encode_s": encode_s,
        "decode_s": decode_s,
        "codes": np.concatenate(codes, -1).tolist(),
        "audio": np.concatenate(audio).tolist(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from moshi.models import loaders
    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    mimi = loaders.get_mimi(None, device="cpu", num_codebooks=8)
    wav = torch.from_numpy(signals(max(args.batches), args.frames * mimi.frame_size, args.seed))
    randomize(mimi, wav[:2, : 8 * mimi.frame_size], args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(args.out / "mimi.safetensors"))
    mimi = loaders.get_mimi(args.out / "mimi.safetensors", device="cpu", num_codebooks=8)
    results = {"frame_size": mimi.frame_size, "threads": args.threads, "batches": {}}
    for b in args.batches:
        results["batches"][str(b)] = stream(mimi, wav[:b])
    (args.out / "kyutai.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
