"""Run Triton kernels in interpreter mode on machines without CUDA (before any kernel is defined); shared fixtures."""

import math
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread in the test process: its tensors are small, so a second thread buys little and costs a core that
# the servers the tests start (subprocesses, engine threads) need; tests that vary the count set it themselves.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernel_built() -> None:
    """Compile the C++ CPU attention kernel before any test runs (`scripts/setup.sh` does; an older .venv may not
    have): an engine whose first step waits a minute on the compiler answers nobody, and the test times out."""
    from paged_kernels import cpu_attention

    if not torch.cuda.is_available():
        cpu_attention.available()


@pytest.fixture(scope="module")
def parts():
    """What the server tests serve: the seeded `tiny` model and the shipped codec. On one thread of a 2-core CPU
    without AVX-512, a seeded codec of the published size takes about as long to encode and decode a conversation's
    frames as they last, so nothing served with it there keeps real time; the shipped codec takes under half that.

    The model never draws the END code: seeded weights draw it about once in `vocab_size` frames, so a turn's reply
    could end after a frame or two, before a test speaks over it or reads it. Its replies last `max_reply_frames`."""
    from codec import EncodecTokenizer
    from s2s import ModelConfig, S2SModel
    from s2s.weights import shipped

    model = S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0)
    logits = model.logits

    def without_end(hidden: torch.Tensor, linear=torch.nn.functional.linear) -> torch.Tensor:
        out = logits(hidden, linear)
        out[..., 0, model.config.end_id] = -math.inf
        return out

    model.logits = without_end
    return model, EncodecTokenizer.from_pretrained(shipped("codec"))


@pytest.fixture(scope="session")
def takes():
    """The oracle's held-out takes (`speech/oracle.py`), synthesized once for every module that hears them."""
    from speech import oracle

    return oracle.takes()


@pytest.fixture(scope="session")
def originals_rate(takes):
    """`oracle.rate` over the clean originals of some of `takes`, read from one recognition of every clean take in
    the session, instead of recognising the same clean audio again in every test."""
    from speech import oracle

    heard = {id(t): oracle.heard(t.pcm) == t.index for t in takes}
    return lambda some: float(np.mean([heard[id(t)] for t in some]))


@pytest.fixture
def two_threads():
    """Two torch threads for one test (the suite's process keeps one): for work that two run faster, in this
    process alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
