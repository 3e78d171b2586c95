"""Run Triton kernels in interpreter mode on machines without CUDA; must happen before any kernel is defined."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
