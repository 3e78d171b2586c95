"""Run Triton kernels in interpreter mode on machines without CUDA (before any kernel is defined); shared fixtures;
how the suite runs on several workers (pytest-xdist: `-n auto` in pyproject.toml) without starving real time.

Tests marked `paced` keep real time (servers streaming audio at pace, deadlines, a cluster of processes): they run
last, each alone (`pytest_runtest_protocol`). Every other test runs beside another, on as many workers as
`pytest_xdist_auto_num_workers` says; each file stays on one worker (`--dist loadfile`: its module fixtures are set up
once, its tests run in file order). (Not xdist's groups: pytest-xdist 3.8 marks a group in a test's `_nodeid`, which
pytest 9.2 no longer reads, so `--dist loadgroup` runs each test on its own.)"""

import fcntl
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread in the test process: its tensors are small, so a second thread buys little and costs a core that
# the servers the tests start (subprocesses, engine threads) need; tests that vary the count set it themselves.
torch.set_num_threads(1)

MAX_WORKERS = 4  # past a few, workers mostly wait for the paced tests, and each holds its own torch and models


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker a core, up to `MAX_WORKERS`; none (all in this process) on one core."""
    cores = len(os.sched_getaffinity(0))
    return 0 if cores < 2 else min(cores, MAX_WORKERS)


def pytest_collection_modifyitems(config, items) -> None:
    """Files with no paced test first, then those with some (their paced tests after the others), then the paced
    files; each file's tests in their order. xdist (`--dist loadfile`) hands a worker a whole file at a time, in this
    order: the paced tests come once the other workers run out of files, and run mostly one after another."""
    paced = {item: item.get_closest_marker("paced") is not None for item in items}
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(paced[item])
    rank = {path: 0 if not any(marks) else 2 if all(marks) else 1 for path, marks in files.items()}
    items.sort(key=lambda item: (rank[item.path], paced[item]))  # (stable)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, every test holds the run's lock (a file all workers open) while it runs: a paced one alone, any
    other shared. A paced test also takes the turnstile before the lock, so that no other test starts meanwhile: it
    waits for those under way to end, not for every other worker to run out of tests. (Nothing is held between
    tests: xdist holds a worker's last test until the others' are done.)"""
    if not hasattr(item.config, "workerinput") or item.config.option.basetemp is None:
        return (yield)
    folder = Path(item.config.option.basetemp).parent  # the run's (each worker's is a folder in it)
    paced = item.get_closest_marker("paced") is not None
    with open(folder / "turnstile", "a+") as turnstile, open(folder / "paced.lock", "a+") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if paced:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the tests under way end; none starts, all wait at the turnstile
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)  # (a paced test waiting holds it: this one waits for it)
            fcntl.flock(lock, fcntl.LOCK_SH)
        return (yield)


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
    from s2s.models.shipped import shipped

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


def cores_of_this_worker(config) -> int:
    """The cores a test may keep busy: all of them with no other worker, else its share. Threads beyond that wait on
    each other (torch's spin): beside another worker, a 17 s test on two threads of a 2-core machine took 270 s."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    return max(1, len(os.sched_getaffinity(0)) // workers)


@pytest.fixture
def cores(request) -> int:
    """`cores_of_this_worker`: for a test's subprocess (its `--threads`)."""
    return cores_of_this_worker(request.config)


@pytest.fixture
def worker_threads(request):
    """As many torch threads as `cores_of_this_worker`, for one test: for work that more threads run faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(cores_of_this_worker(request.config))
    yield
    torch.set_num_threads(before)


@pytest.fixture
def two_threads():
    """Two torch threads for one test (the suite's process keeps one), for what it checks on two threads (for speed
    alone: `worker_threads`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
