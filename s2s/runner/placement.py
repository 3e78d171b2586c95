"""Where the model runs: `--device` / `--dtype` as torch objects, the same for the server and the benchmarks."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def placement(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """ "auto" is the first CUDA GPU in bfloat16 where there is one, else the CPU in float32 (bf16 matmuls on a CPU
    are slower than fp32). The codec always runs in float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: torch sees no CUDA GPU here (use cpu)")
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    return dev, DTYPES[dtype]
