"""Run Triton kernels in interpreter mode on machines without CUDA (before any kernel is defined); shared fixtures."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernel_built() -> None:
    """Compile the C++ CPU attention kernel before any test runs (`scripts/setup.sh` does; an older .venv may not
    have): an engine whose first step waits a minute on the compiler answers nobody, and the test times out."""
    from kernels import cpu_attention

    if not torch.cuda.is_available():
        cpu_attention.available()


@pytest.fixture(scope="module")
def parts():
    """What the server tests serve: the seeded `tiny` model and the shipped codec. A seeded codec of the published
    size encodes and decodes one conversation's 4 frames in 54 ms on one thread of a CPU without AVX-512, over their
    53 ms of audio: nothing served with it there is real time (the shipped codec: 23 ms)."""
    from codec import EncodecTokenizer
    from s2s import ModelConfig, S2SModel
    from s2s.weights import shipped

    return S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0), EncodecTokenizer.from_pretrained(shipped("codec"))
