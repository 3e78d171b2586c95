"""s2s/runner/sampling_graphs.py: a round's sampling from static, padded buffers chooses what `sample` chooses.

On a CUDA machine the graphs are captured and replayed; on a CPU the same buffers and padding run eagerly, so
everything but the capture itself is checked here too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s import ModelConfig, S2SModel, SamplingParams, sample
from s2s.engine.engine import CodesEvent, Engine, EngineConfig
from s2s.runner.sampling import RandomStream, _unit
from s2s.runner.sampling_graphs import SamplingGraphs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAPTURE = DEVICE == "cuda"
K, VOCAB, BANNED = 2, 67, 66

settings_of_a_row = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 0.8, 1.0, 2.0]),
    top_k=st.sampled_from([0, 1, 5, 66, 250]),  # 250: past the vocabulary
    top_p=st.sampled_from([1.0, 0.95, 0.5, 1e-6]),
    seed=st.integers(0, 2**63 - 1),
)


@pytest.fixture(scope="module")
def graphs() -> SamplingGraphs:
    return SamplingGraphs(8, K, VOCAB, BANNED, DEVICE, capture=CAPTURE)


def rows(params: list[SamplingParams], draws: list[int], seed: int) -> tuple[torch.Tensor, list, list]:
    logits = 3 * torch.randn(len(params), K, VOCAB, generator=torch.Generator().manual_seed(seed))
    return logits.to(DEVICE), [RandomStream(p.seed, d) for p, d in zip(params, draws, strict=True)]


@settings(max_examples=60, deadline=None)
@given(
    params=st.lists(settings_of_a_row, min_size=1, max_size=8),
    draws=st.lists(st.integers(0, 2**40), min_size=8, max_size=8),
    seed=st.integers(0, 1000),
)
def test_a_padded_round_chooses_what_sample_chooses(graphs, params, draws, seed) -> None:
    """Any mix of greedy, top-k, nucleus and both, at any draw count, in a padded bucket: the same codes, and each
    stream counts one draw."""
    logits, streams = rows(params, draws[: len(params)], seed)
    mine = [RandomStream(s.seed, s.draws) for s in streams]
    want = sample(logits, params, streams, BANNED).cpu().numpy()
    got = graphs.run(logits, params, mine).cpu().numpy()
    np.testing.assert_array_equal(got, want)
    assert (got != BANNED).all()
    assert [s.draws for s in mine] == [s.draws for s in streams]


def test_buckets_replay_right_in_any_order(graphs) -> None:
    """One set of static buffers for every bucket: a small round between two large ones reads none of theirs."""
    params = [SamplingParams(temperature=1.0, top_k=0, seed=s) for s in range(8)]
    for i, n in enumerate((8, 1, 6, 2)):
        logits, streams = rows(params[:n], [i] * n, seed=i)
        want = sample(logits, params[:n], [RandomStream(s.seed, s.draws) for s in streams], BANNED).cpu().numpy()
        np.testing.assert_array_equal(graphs.run(logits, params[:n], streams).cpu().numpy(), want)


def test_bad_rounds_are_refused(graphs) -> None:
    params = [SamplingParams(seed=1)] * 9
    logits, streams = rows(params, [0] * 9, seed=0)
    with pytest.raises(ValueError, match="exceed"):
        graphs.run(logits, params, streams)
    with pytest.raises(ValueError, match="params"):
        graphs.run(logits[:2], params[:3], streams[:2])
    with pytest.raises(ValueError, match="need logits"):
        graphs.run(logits[:2, :, :10], params[:2], streams[:2])
    assert not graphs.fits(9) and graphs.fits(8)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="CUDA device"):
            SamplingGraphs(2, K, VOCAB, BANNED, DEVICE)


def counted(run, rows: list[int]):
    def wrapped(logits, params, streams):
        rows.append(len(logits))
        return run(logits, params, streams)

    return wrapped


def test_an_engine_sampling_on_graphs_streams_what_the_eager_engine_streams() -> None:
    """Three seeded duplex conversations at temperature 0.8 (bucket 4: one padded row), fed the same codes, with and
    without the sampling graphs: the graphs take every round's sampling, and the streams are the same."""
    model = S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=1, codebook_size=256), seed=0, device=DEVICE)
    mcfg = model.config
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 256, (1, 120)) for _ in range(3)]
    streams, sampled = [], []
    for graphed in (False, True):
        cfg = EngineConfig(
            num_pages=200, calibration_ticks=0, max_conversations=4, frames_per_tick=4, cuda_graphs=False
        )
        engine = Engine(model, None, cfg)
        if graphed:  # on a CPU the engine never builds them: give it the eager twin of what a GPU captures
            sampler = SamplingGraphs(4, mcfg.num_codebooks, mcfg.vocab_size, mcfg.pad_id, DEVICE, capture=CAPTURE)
            sampler.run = counted(sampler.run, sampled)
            engine.runner.sampler = sampler
        cids = [engine.open("duplex", sampling=SamplingParams(temperature=0.8, seed=i)) for i in range(3)]
        for f in range(0, 120, 4):
            for cid, codes in zip(cids, inputs, strict=True):
                engine.push_codes(cid, codes[:, f : f + 4])
            engine.step()
        out = []
        for cid in cids:
            q = engine.event_queue(cid)
            events = [q.get() for _ in range(q.qsize())]
            out.append(np.concatenate([e.codes for e in events if isinstance(e, CodesEvent)], axis=1))
        streams.append(out)
    assert len(sampled) >= 110 and set(sampled) == {3}
    for eager, graphed in zip(*streams, strict=True):
        assert eager.shape[1] >= 110  # they spoke
        np.testing.assert_array_equal(eager, graphed)


def test_the_hashed_numbers_stay_below_one() -> None:
    """The largest 32-bit hash once became 1.0 in float32: infinite Gumbel noise, and a NaN score that `argmax` took
    past a row's top-k (about 3 in 100,000 draws of a mixed batch, and in every `sample_static` row)."""
    numbers = _unit(torch.tensor([0, 2**31, 2**32 - 257, 2**32 - 1], dtype=torch.int64))
    assert (numbers > 0).all() and (numbers < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(numbers))).all()
