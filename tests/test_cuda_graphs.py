"""s2s/runner/cuda_graphs.py: decode rounds from static, padded buffers equal the eager paged forward.

On a CUDA machine the graphs are captured and replayed; on a CPU the same buffers and padding run eagerly, so
everything but the capture itself is checked here too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from s2s import ModelConfig, PagedBatch, S2SModel, SamplingParams
from s2s.engine.engine import CodesEvent, Engine, EngineConfig
from s2s.runner.batch import page_table
from s2s.runner.cuda_graphs import DecodeGraphs, bucket_sizes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAPTURE = DEVICE == "cuda"
PAGE = 4


@pytest.fixture(scope="module")
def model() -> S2SModel:
    return S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=2, codebook_size=64), seed=0, device=DEVICE)


def pool(model: S2SModel, num_pages: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, PAGE, cfg.num_key_value_heads, cfg.head_dim)
    k = [torch.randn(shape, generator=g).to(DEVICE) for _ in range(cfg.num_hidden_layers)]
    v = [torch.randn(shape, generator=g).to(DEVICE) for _ in range(cfg.num_hidden_layers)]
    return k, v


def test_buckets_cover_every_batch_size() -> None:
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


def run(graphs: DecodeGraphs, tokens: np.ndarray, cached: list[int], pages: list[list[int]]) -> torch.Tensor:
    return graphs.run(tokens, np.array(cached), page_table(pages), np.array([len(p) for p in pages]))


def check_round(model: S2SModel, graphs: DecodeGraphs, k, v, n: int, seed: int) -> None:
    """One round of n sequences through `graphs` equals the eager forward, logits and K/V both."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, 40))
    cached = [int(c) for c in rng.integers(0, 20, n)]
    pages = [[int(p) for p in perm[6 * s : 6 * s + c // PAGE + 1]] for s, c in enumerate(cached)]
    tokens = rng.integers(0, cfg.vocab_size, (n, cfg.step_width))
    k_ref, v_ref = [t.clone() for t in k], [t.clone() for t in v]

    got = run(graphs, tokens, cached, pages)

    batch = PagedBatch.build(cached, [1] * n, pages, PAGE, device=DEVICE)
    want = model.forward_paged(torch.from_numpy(tokens).to(DEVICE), batch, k_ref, v_ref).state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for layer in range(cfg.num_hidden_layers):  # the same K/V written, and nothing else (padding stores nothing)
        torch.testing.assert_close(k[layer], k_ref[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[layer], v_ref[layer], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_a_padded_round_equals_the_eager_forward_and_writes_only_its_slots(model, n) -> None:
    k, v = pool(model, 40, seed=n)
    graphs = DecodeGraphs(model, k, v, PAGE, max_batch=8, max_pages=6, capture=CAPTURE)  # bucket 4 or 8: padded
    check_round(model, graphs, k, v, n, seed=n)


def test_buckets_replay_right_in_any_order(model) -> None:
    """Graphs share one memory pool and one set of static buffers: a small round between two large ones."""
    k, v = pool(model, 40, seed=9)
    graphs = DecodeGraphs(model, k, v, PAGE, max_batch=8, max_pages=6, capture=CAPTURE)
    for i, n in enumerate((6, 1, 6, 2)):
        check_round(model, graphs, k, v, n, seed=10 + i)


@pytest.mark.skipif(not CAPTURE, reason="only a captured graph reuses its output buffer: needs a CUDA device")
def test_the_logits_of_a_round_survive_the_next_round(model) -> None:
    """The engine keeps a conversation's logits across rounds: they must not alias the graph's output buffer."""
    cfg = model.config
    k, v = pool(model, 10, seed=7)
    graphs = DecodeGraphs(model, k, v, PAGE, max_batch=2, max_pages=4, capture=CAPTURE)
    first = run(graphs, np.ones((1, cfg.step_width), dtype=np.int64), [0], [[1]])
    kept = first.clone()
    run(graphs, np.full((1, cfg.step_width), 5, dtype=np.int64), [1], [[1]])
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


def test_bad_rounds_are_refused(model) -> None:
    cfg = model.config
    k, v = pool(model, 10, seed=1)
    graphs = DecodeGraphs(model, k, v, PAGE, max_batch=2, max_pages=2, capture=False)
    ok = np.zeros((1, cfg.step_width), dtype=np.int64)
    with pytest.raises(ValueError, match="lie in"):
        run(graphs, ok + cfg.vocab_size, [0], [[1]])
    with pytest.raises(ValueError, match="step tokens"):
        run(graphs, np.zeros((1, 3), dtype=np.int64), [0], [[1]])
    with pytest.raises(ValueError, match="no page"):
        run(graphs, ok, [4], [[1]])  # position 4 needs a second page of 4 steps
    with pytest.raises(ValueError, match="exceed"):
        run(graphs, np.zeros((3, cfg.step_width), dtype=np.int64), [0, 0, 0], [[1], [2], [3]])
    assert not graphs.fits(1, page_table([[1, 2, 3]]))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="CUDA device"):
            DecodeGraphs(model, k, v, PAGE, max_batch=2, max_pages=2)


def counted(run, sizes: list[int]):
    def wrapped(tokens, cached_lens, table, lengths, shifts, fill):
        sizes.append(len(cached_lens))
        return run(tokens, cached_lens, table, lengths, shifts, fill)

    return wrapped


def test_an_engine_on_graphs_streams_what_the_eager_engine_streams() -> None:
    """Three duplex conversations (bucket 4: one padded row) fed the same codes, greedy, with and without graphs,
    for five windows of their bounded context: the graphs take every round, the window sliding included."""
    model = S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=1, codebook_size=256), seed=0, device=DEVICE)
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 256, (1, 240)) for _ in range(3)]
    streams, rounds = [], []
    for graphs in (False, True):
        cfg = EngineConfig(
            max_context=48,
            num_pages=200,
            calibration_ticks=0,
            max_conversations=4,
            frames_per_tick=4,
            cuda_graphs=False,
        )
        engine = Engine(model, None, cfg)
        if graphs:  # on a CPU the engine never builds them: give it the eager twin of what a GPU captures
            graphs = DecodeGraphs(model, engine.pool.k, engine.pool.v, 16, 4, max_pages=32, capture=CAPTURE)
            graphs.run = counted(graphs.run, rounds)
            engine.runner.graphs = graphs
        cids = [engine.open("duplex", sampling=SamplingParams(temperature=0)) for _ in inputs]
        for f in range(0, 240, 4):
            for cid, codes in zip(cids, inputs, strict=True):
                engine.push_codes(cid, codes[:, f : f + 4])
            engine.step()
        assert all(s.dropped >= 10 for s in engine.sessions.values())  # past the window: pages left the table
        out = []
        for cid in cids:
            q = engine.event_queue(cid)
            events = [q.get() for _ in range(q.qsize())]
            out.append(np.concatenate([e.codes for e in events if isinstance(e, CodesEvent)], axis=1))
        streams.append(out)
    assert len(rounds) >= 230 and set(rounds) == {3}  # every round of the graphed engine, padded to 4
    for eager, graphed in zip(*streams, strict=True):
        assert eager.shape[1] >= 230  # they spoke
        np.testing.assert_array_equal(eager, graphed)


def test_the_prefill_warm_up_stores_nothing() -> None:
    """On a GPU the engine runs the attention kernel's prefill tiles at start (Triton builds each on first use):
    the pool must come out as it went in."""
    model = S2SModel.from_seed(ModelConfig.preset("tiny", num_codebooks=1, codebook_size=256), seed=0, device=DEVICE)
    engine = Engine(model, None, EngineConfig(num_pages=8, calibration_ticks=0, cuda_graphs=False))
    for t in engine.pool.k + engine.pool.v:
        t.normal_()
    before = [t.clone() for t in engine.pool.k + engine.pool.v]
    engine.runner.warm_up_prefill()
    for t, b in zip(engine.pool.k + engine.pool.v, before, strict=True):
        assert torch.equal(t, b)
