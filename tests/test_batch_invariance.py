"""Batch invariance: with `batch_invariant=True` a step's K/V and logits, and a codec row's codes and PCM, are the
same bits whatever else shares its calls, its place among them and how its sequence was chunked. Each property is
checked against the normal path too, which differs (that is what the mode is for, and it shows the checks can fail).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_model import Pages, random_tokens

from codec import EncodecTokenizer, streaming
from paged_kernels import batch_invariant
from s2s import ModelConfig, PagedBatch, S2SModel, SamplingParams, sample

FS = 320


@pytest.fixture(autouse=True)
def one_thread():
    """Each test starts on one thread and leaves the process on it (the tile test sets its own count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- model --------------------------------------------------------------------------------------------------------


def alone(model: S2SModel, tokens: torch.Tensor, page_size: int, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence by itself in one chunk: the logits after each of its steps, and the K/V it stored."""
    pages = Pages(model.config, page_size)
    batch = PagedBatch.build([0], [len(tokens)], [pages.grow(0, len(tokens))], page_size)
    hidden = model.backbone.forward_paged(model.embed(tokens), batch, pages.k, pages.v, invariant)
    return model.logits(hidden, batch_invariant.linear if invariant else F.linear), pages.kv(0, len(tokens))


def differences(model: S2SModel, lengths: list[int], page_size: int, seed: int, invariant: bool) -> list[str]:
    """Compute the sequences together in random rounds (each taking part or not, with a chunk of random length, in a
    random place in the batch), and list every step whose logits or K/V are not the bits of `alone`."""
    seqs = [random_tokens(model.config, n, seed=seed + s) for s, n in enumerate(lengths)]
    want = [alone(model, t, page_size, invariant) for t in seqs]
    rng = random.Random(seed)
    pages = Pages(model.config, page_size)
    done = [0] * len(seqs)
    out = []
    while any(d < len(t) for d, t in zip(done, seqs, strict=True)):
        todo = [s for s, t in enumerate(seqs) if done[s] < len(t) and rng.random() < 0.7]
        rng.shuffle(todo)
        todo = [(s, seqs[s][done[s] : done[s] + rng.choice([1, 1, 2, 3, 5, 8, 13])], done[s]) for s in todo]
        if not todo:
            continue
        logits = pages.step(model, todo, invariant)[0].state
        for row, (s, chunk, cached) in enumerate(todo):
            done[s] = cached + len(chunk)
            if not torch.equal(logits[row], want[s][0][done[s] - 1]):
                out.append(f"logits of sequence {s} step {done[s] - 1}")
    for s, t in enumerate(seqs):
        if not torch.equal(pages.kv(s, len(t)), want[s][1]):
            out.append(f"K/V of sequence {s}")
    return out


@pytest.fixture(scope="module")
def tiny() -> S2SModel:
    return S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0)


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 5, 16]),
    window=st.sampled_from([None, 7]),
    seed=st.integers(0, 1000),
)
def test_a_step_is_the_same_bits_in_any_batch_and_chunking(lengths, page_size, window, seed) -> None:
    model = S2SModel.from_seed(ModelConfig.preset("tiny", sliding_window=window), seed=0)
    assert differences(model, lengths, page_size, seed, invariant=True) == []


def test_a_step_is_the_same_bits_on_two_threads(two_threads, tiny: S2SModel) -> None:
    assert differences(tiny, [23, 7, 30, 12], page_size=5, seed=3, invariant=True) == []


MKL_ONLY = pytest.mark.skipif(
    not torch.backends.mkl.is_available(), reason="the controls show MKL's and oneDNN's sums; other BLAS may agree"
)


@MKL_ONLY
def test_the_normal_path_depends_on_the_batch(tiny: S2SModel) -> None:
    """What the invariant path fixes: MKL's sgemm sums a row by an order that depends on M, and the prefill
    attention sums in another order than the decode kernel."""
    assert differences(tiny, [20, 9, 14], 16, seed=0, invariant=False) != []


@pytest.mark.parametrize("threads", [1, 2])
def test_linear_tiles_are_position_invariant(threads: int) -> None:
    """The property `batch_invariant.linear` relies on: within a tile, a row's result does not depend on its place
    or its neighbours; and a row computed alone equals the same row inside many tiles."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    normal_differs = []
    for k, n in ((64, 128), (256, 768), (768, 256)):
        w, x = torch.randn(n, k, generator=g), torch.randn(3 * batch_invariant.TILE + 1, k, generator=g)
        rows = torch.stack([batch_invariant.linear(x[i : i + 1], w)[0] for i in range(len(x))])
        assert torch.equal(batch_invariant.linear(x, w), rows)
        assert torch.equal(batch_invariant.linear(x.flip(0), w), rows.flip(0))
        normal_differs.append(not torch.equal(F.linear(x, w)[:1], F.linear(x[:1], w)))
    assert any(normal_differs) or not torch.backends.mkl.is_available(), "the control: plain sgemm depends on M"


def test_batch_invariant_forward_is_cpu_fp32_only() -> None:
    model = S2SModel.from_seed(ModelConfig.preset("tiny"), seed=0, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="CPU fp32 only"):
        Pages(model.config, 4).step(model, [(0, random_tokens(model.config, 3, seed=0), 0)], batch_invariant=True)


def test_sampling_a_row_alone_or_in_a_batch() -> None:
    """`sample` is row-wise already (one generator a row; its reductions and elementwise ops are per row)."""
    g = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=i)
        for i, (t, k, p) in enumerate([(1.0, 250, 1.0), (0.8, 0, 0.9), (0.0, 250, 1.0), (1.3, 50, 0.95)] * 2)
    ]
    together, apart = [p.generator() for p in params], [p.generator() for p in params]
    for _ in range(20):
        logits = 3 * torch.randn(len(params), 2, 1027, generator=g)
        batch = sample(logits, params, together, banned_id=1024)
        for i in range(len(params)):
            assert torch.equal(
                sample(logits[i : i + 1], params[i : i + 1], apart[i : i + 1], banned_id=1024)[0], batch[i]
            )


# ---- codec --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> EncodecTokenizer:
    return EncodecTokenizer.from_pretrained(seed=0)


def leaves(state: streaming.State) -> list[torch.Tensor]:
    return [state] if isinstance(state, torch.Tensor) else [t for s in state for t in leaves(s)]


def carried(stream, row: int) -> list[torch.Tensor]:
    """A row's carried state (convolution inputs, LSTM h and c): computed values, unlike the codes, which would
    hide a difference below the quantizer's margins."""
    return leaves(streaming.gather_rows(stream._states.state, torch.tensor([row])))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def sizes(total: int, rng: random.Random, least: int, most: int) -> list[int]:
    """Random sizes in [least, most] that add up to `total` (the last one cut short)."""
    out = []
    while sum(out) < total:
        out.append(min(total - sum(out), rng.randint(least, most)))
    return out


def encode(tok: EncodecTokenizer, invariant: bool, batch_size: int, row: int, chunks: list[int], seed: int):
    """Stream a signal into `row` in pushes of `chunks` samples, each push also carrying noise of random lengths for
    every other row, rows in a random order. Returns the row's codes and final state."""
    enc = tok.streaming_encoder(batch_size, invariant)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    wav = 0.3 * torch.randn(sum(chunks), generator=torch.Generator().manual_seed(0))
    codes, at = [], 0
    for n in chunks:
        rows = list(range(batch_size))
        rng.shuffle(rows)
        pcm = [wav[at : at + n] if r == row else 0.3 * torch.randn(rng.randint(0, 700), generator=g) for r in rows]
        codes.append(enc.push([p.clamp(-1, 1) for p in pcm], rows=rows)[rows.index(row)])
        at += n
    return torch.cat(codes, -1), carried(enc, row)


def decode(tok: EncodecTokenizer, invariant: bool, batch_size: int, row: int, chunks: list[int], seed: int):
    """`encode`'s pattern for the decoder: the row's codes in pushes of `chunks` frames beside random codes."""
    dec = tok.streaming_decoder(batch_size, invariant)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    codes = torch.randint(
        0, tok.codebook_size, (tok.num_codebooks, sum(chunks)), generator=torch.Generator().manual_seed(0)
    )
    pcm, at = [], 0
    for n in chunks:
        rows = list(range(batch_size))
        rng.shuffle(rows)
        other = torch.randint(0, tok.codebook_size, (batch_size, tok.num_codebooks, n), generator=g)
        other[rows.index(row)] = codes[:, at : at + n]
        pcm.append(dec.push(other, rows=rows)[rows.index(row)])
        at += n
    return torch.cat(pcm), carried(dec, row)


@pytest.mark.parametrize("seed", [1, 2])
def test_codec_rows_are_the_same_bits_in_any_call_pattern(tok: EncodecTokenizer, seed: int) -> None:
    """Against the row alone, one frame a push: another row index, other rows in every call, random chunks."""
    rng = random.Random(seed)
    frames = 16
    want_codes, want_state = encode(tok, True, 1, 0, [FS] * frames, seed=0)
    codes, state = encode(tok, True, 4, rng.randrange(4), sizes(frames * FS, rng, 0, 3 * FS), seed)
    assert torch.equal(codes, want_codes) and same(state, want_state)
    want_pcm, want_state = decode(tok, True, 1, 0, [1] * frames, seed=0)
    pcm, state = decode(tok, True, 4, rng.randrange(4), sizes(frames, rng, 1, 4), seed)
    assert torch.equal(pcm, want_pcm) and same(state, want_state)


@MKL_ONLY
def test_codec_normal_calls_depend_on_the_pattern(tok: EncodecTokenizer) -> None:
    rng = random.Random(0)
    frames = 16
    _, want = encode(tok, False, 1, 0, [FS] * frames, seed=0)
    assert not same(encode(tok, False, 4, 2, sizes(frames * FS, rng, 0, 3 * FS), 1)[1], want)
    want_pcm, _ = decode(tok, False, 1, 0, [1] * frames, seed=0)
    assert not torch.equal(decode(tok, False, 4, 1, [1] * frames, 1)[0], want_pcm)
