"""codec/: offline paths equal transformers' EnCodec, streaming paths equal the offline ones in any chunking."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import EncodecConfig, EncodecModel

from codec import BANDWIDTHS, EncodecTokenizer, stream_layers
from codec.pcm import load_wav
from speech.sample import SAMPLE_PATH, have_espeak, synthesize

FS = 320
SLOW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok() -> EncodecTokenizer:
    return EncodecTokenizer.from_pretrained(seed=0)


def noise(frames: int, rows: int = 1, seed: int = 0, extra: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(frames * FS + extra) / 24000
    x = 0.3 * torch.randn(rows, frames * FS + extra, generator=g) * (0.6 + 0.4 * torch.sin(2 * math.pi * 2 * t))
    return x.clamp(-1, 1)


def assert_codes_equal_up_to_ties(tok: EncodecTokenizer, wav: torch.Tensor, got: torch.Tensor, want: torch.Tensor):
    """Codes must be equal, except where the offline quantizer's choice was a floating-point tie.

    The streaming encoder computes the same latents in another order, so they differ from the offline ones by ~1e-7;
    in 128 dimensions two codebook entries can be that close in distance. Where the codes differ, the first differing
    codebook's two nearest entries must be within `margin` of each other, and such frames must be rare.
    """
    got, want = got.reshape(want.shape), want
    if torch.equal(got, want):
        return
    wav = torch.as_tensor(wav).reshape(-1, wav.shape[-1])[..., : want.shape[-1] * FS]
    with torch.inference_mode():
        residual = tok.model.encoder(wav[:, None]).transpose(1, 2)  # [B, F, D]
        first_diff = (got != want).int().argmax(1)  # [B, F]
        differ = (got != want).any(1)
        for k, layer in enumerate(tok.model.quantizer.layers[: tok.num_codebooks]):
            book = layer.codebook
            near = torch.cdist(residual, book.embed[None]).topk(2, largest=False).values
            margin = near[..., 1] - near[..., 0]
            assert (margin[differ & (first_diff == k)] < 1e-5).all(), "codes differ where the choice was no tie"
            residual = residual - book.decode(book.encode(residual))
    assert int(differ.sum()) <= max(1, 0.02 * differ.numel()), f"{int(differ.sum())} of {differ.numel()} frames differ"


def split(total: int, sizes: list[int]) -> list[tuple[int, int]]:
    """Cut range(total) into consecutive pieces of the given sizes (cycled), the last one clipped."""
    out, start, i = [], 0, 0
    while start < total:
        size = sizes[i % len(sizes)]
        out.append((start, min(total, start + size)))
        start += size
        i += 1
    return out


# ---- offline paths against transformers -------------------------------------------------------------------------


def test_attributes_and_bandwidths() -> None:
    for bw, k in zip(BANDWIDTHS, (2, 4, 8, 16, 32), strict=True):
        tok = EncodecTokenizer.from_pretrained(bandwidth=bw)
        assert (tok.sample_rate, tok.frame_size, tok.frame_rate, tok.codebook_size) == (24000, 320, 75, 1024)
        assert tok.num_codebooks == k
    with pytest.raises(ValueError, match="bandwidth"):
        EncodecTokenizer.from_pretrained(bandwidth=2.0)


def test_seeded_weights_are_reproducible_and_codes_varied(tok: EncodecTokenizer) -> None:
    other = EncodecTokenizer.from_pretrained(seed=0)
    x = noise(20)
    codes = tok.encode(x)
    assert torch.equal(codes, other.encode(x))
    assert codes.unique().numel() > 10, "seeded codebooks should give varied codes"
    assert not torch.equal(codes, EncodecTokenizer.from_pretrained(seed=1).encode(x))


@pytest.mark.parametrize("bandwidth", [1.5, 6.0])
def test_equals_transformers_on_same_weights(tmp_path, bandwidth: float) -> None:
    tok = EncodecTokenizer.from_pretrained(bandwidth=bandwidth, seed=3)
    tok.save_pretrained(tmp_path)
    ref = EncodecModel.from_pretrained(tmp_path).eval()  # weight norm in place, as transformers ships it
    assert any("parametrizations" in k for k in ref.state_dict())
    x = noise(25, rows=2, extra=123)
    with torch.no_grad():
        ref_codes = ref.encode(x[:, None], bandwidth=bandwidth).audio_codes[0]
        ref_audio = ref.decode(ref_codes[None], [None]).audio_values[:, 0]
    codes = tok.encode(x)
    assert codes.shape == (2, tok.num_codebooks, math.ceil(x.shape[-1] / FS))
    assert_codes_equal_up_to_ties(tok, x, codes, ref_codes)
    audio = tok.decode(ref_codes)
    assert audio.shape == (2, codes.shape[-1] * FS)
    assert (audio - ref_audio).abs().max() <= 1e-5


def test_loads_tiny_transformers_checkpoint(tmp_path) -> None:
    cfg = EncodecConfig(num_filters=4, hidden_size=16, codebook_dim=16, num_lstm_layers=1)
    torch.manual_seed(5)
    model = EncodecModel(cfg).eval()
    for layer in model.quantizer.layers:
        layer.codebook.embed.normal_()
    model.save_pretrained(tmp_path)
    tok = EncodecTokenizer.from_pretrained(tmp_path, bandwidth=3.0)
    assert tok.num_codebooks == 4
    x = noise(12, rows=1)
    with torch.no_grad():
        ref_codes = model.encode(x[:, None], bandwidth=3.0).audio_codes[0]
        ref_audio = model.decode(ref_codes[None], [None]).audio_values[:, 0]
    assert_codes_equal_up_to_ties(tok, x, tok.encode(x), ref_codes)
    assert (tok.decode(ref_codes) - ref_audio).abs().max() <= 1e-5
    # and our own save round-trips
    tok.save_pretrained(tmp_path / "again")
    again = EncodecTokenizer.from_pretrained(tmp_path / "again", bandwidth=3.0)
    assert_codes_equal_up_to_ties(tok, x, again.encode(x), ref_codes)


def test_bad_checkpoint_folders(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        EncodecTokenizer.from_pretrained(tmp_path)
    EncodecModel(EncodecConfig(sampling_rate=48000, chunk_length_s=1.0, overlap=0.01, normalize=True)).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="not a causal 24 kHz"):
        EncodecTokenizer.from_pretrained(tmp_path)


# ---- streaming decoder --------------------------------------------------------------------------------------------


def decode_streaming(tok: EncodecTokenizer, codes: torch.Tensor, sizes: list[int]) -> list[tuple[int, torch.Tensor]]:
    dec = tok.streaming_decoder(codes.shape[0])
    pushes = []
    for a, b in split(codes.shape[-1], sizes):
        out = dec.push(codes[..., a:b])
        assert out.shape == (codes.shape[0], (b - a) * FS), "a frame's audio must come out in the push that brings it"
        pushes.append((b, out))
    return pushes


@SLOW
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6), frames=st.integers(1, 24))
def test_streaming_decoder_any_chunking(tok: EncodecTokenizer, sizes: list[int], frames: int) -> None:
    codes = tok.encode(noise(frames, rows=2, seed=frames))
    full = tok.decode(codes)
    start = 0
    for known, out in decode_streaming(tok, codes, sizes):
        # every push emits exactly what decode() of the codes known so far gives for its frames ...
        offline_so_far = tok.decode(codes[..., :known])
        assert (out - offline_so_far[:, start * FS :]).abs().max() <= 1e-5
        start = known
    # ... so once the start-up look-ahead is covered, the stream equals decode() of the whole sequence
    stream = torch.cat([out for _, out in decode_streaming(tok, codes, sizes)], dim=-1)
    settled = (tok.decoder_warmup_frames - 1) * FS
    if full.shape[-1] > settled:
        assert (stream[:, settled:] - full[:, settled:]).abs().max() <= 1e-5


@pytest.mark.parametrize("sizes", [[1], [2], [3, 1, 4], [64]])
def test_streaming_decoder_exact_when_start_is_known(tok: EncodecTokenizer, sizes: list[int]) -> None:
    codes = tok.encode(noise(40, rows=3, seed=7))
    full = tok.decode(codes)
    # with the first push covering the look-ahead, every sample equals the offline decode
    first = tok.decoder_warmup_frames
    dec = tok.streaming_decoder(3)
    outs = [dec.push(codes[..., :first])]
    outs += [dec.push(codes[..., first + a : first + b]) for a, b in split(40 - first, sizes)]
    assert (torch.cat(outs, -1) - full).abs().max() <= 1e-5


def test_streaming_decoder_rows_are_independent(tok: EncodecTokenizer) -> None:
    codes = tok.encode(noise(20, rows=3, seed=11))
    full = tok.decode(codes)
    dec = tok.streaming_decoder(4)
    got: dict[int, list[torch.Tensor]] = {0: [], 2: [], 3: []}
    # row 3 starts late, rows move in different groupings, row 1 never used
    got[0].append(dec.push(codes[0:1, :, :5], rows=[0])[0])
    got[0].append(dec.push(codes[0:1, :, 5:8], rows=[0])[0])
    got[2].append(dec.push(codes[1:2, :, :8], rows=[2])[0])
    for a in range(8, 20, 2):
        out = dec.push(torch.stack([codes[1, :, a : a + 2], codes[0, :, a : a + 2]]), rows=[2, 0])
        got[2].append(out[0])
        got[0].append(out[1])
    for a in range(0, 20, 4):
        got[3].append(dec.push(codes[2:3, :, a : a + 4], rows=[3])[0])
    settled = (tok.decoder_warmup_frames - 1) * FS  # rows 0 and 3 start with pushes shorter than the look-ahead
    for row, src in ((0, 0), (2, 1), (3, 2)):
        assert (torch.cat(got[row])[settled:] - full[src, settled:]).abs().max() <= 1e-5
    # reset starts the row over as a new stream
    dec.reset(0)
    again = torch.cat([dec.push(codes[2:3, :, a : a + 10], rows=[0])[0] for a in range(0, 20, 10)])
    assert (again - full[2]).abs().max() <= 1e-5


def test_fused_lstm_steps_like_the_hand_stepped_one(tok: EncodecTokenizer) -> None:
    """A GPU runs EnCodec's LSTM through torch's fused LSTM: same outputs and carried (h, c) as the CPU stepping,
    chunk after chunk, rows first in the state as the streaming rows need."""
    lstm = next(layer for layer in tok.decoder_net.layers if isinstance(layer, stream_layers._LSTM))
    x = torch.randn(3, lstm.hidden, 9, generator=torch.Generator().manual_seed(0))
    fused_state = stepped_state = None
    for a, b in ((0, 1), (1, 5), (5, 9)):
        fused, fused_state = lstm.fused(x[..., a:b], fused_state)
        stepped, stepped_state = lstm.stepped(x[..., a:b], stepped_state)
        torch.testing.assert_close(fused, stepped, rtol=1e-5, atol=1e-5)
        for f, s in zip(fused_state, stepped_state, strict=True):
            assert f.shape == s.shape == (3, lstm.lstm.num_layers, lstm.hidden)
            torch.testing.assert_close(f, s, rtol=1e-5, atol=1e-5)


# ---- streaming encoder --------------------------------------------------------------------------------------------


@SLOW
@given(
    sizes=st.lists(st.integers(0, 1500), min_size=1, max_size=6).filter(any),
    frames=st.integers(1, 20),
    tail=st.integers(0, 319),
)
def test_streaming_encoder_any_chunking(tok: EncodecTokenizer, sizes: list[int], frames: int, tail: int) -> None:
    x = noise(frames, rows=2, seed=frames, extra=tail)
    total = x.shape[-1]
    want = tok.encode(x[..., : frames * FS]) if frames else None
    enc = tok.streaming_encoder(2)
    got: list[list[torch.Tensor]] = [[], []]
    for a, b in split(total, sizes):
        out = enc.push(x[..., a:b])
        complete = b // FS
        emitted = sum(c.shape[-1] for c in got[0])
        expect = complete - emitted if complete >= tok.encoder_warmup_frames else 0
        assert out[0].shape == (tok.num_codebooks, expect), "each frame comes out as soon as it is complete"
        for row in range(2):
            got[row].append(out[row])
    stream = torch.stack([torch.cat(g, -1) for g in got])
    if frames >= tok.encoder_warmup_frames:
        assert_codes_equal_up_to_ties(tok, x[..., : frames * FS], stream, want)
    else:
        assert stream.shape[-1] == 0  # still inside the start-up look-ahead: nothing is final yet


def test_streaming_encoder_rows_with_ragged_chunks(tok: EncodecTokenizer) -> None:
    x = noise(30, rows=3, seed=2)
    want = tok.encode(x)
    enc = tok.streaming_encoder(3)
    got: list[list[torch.Tensor]] = [[], [], []]
    pos = [0, 0, 0]
    rng = np.random.default_rng(0)
    while min(pos) < x.shape[-1]:
        sizes = [int(rng.integers(0, 900)) for _ in range(3)]
        chunks = [x[r, pos[r] : pos[r] + sizes[r]] for r in range(3)]
        for r, codes in enumerate(enc.push(chunks)):
            got[r].append(codes)
            pos[r] += sizes[r]
    assert_codes_equal_up_to_ties(tok, x, torch.stack([torch.cat(g, -1) for g in got]), want)
    enc.reset(1)
    assert_codes_equal_up_to_ties(tok, x[1:2], enc.push(x[1:2, :], rows=[1])[0], want[1:2])


class _DeviceOps(TorchDispatchMode):
    """Counts aten calls that would launch device work: views launch none."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def test_a_push_s_device_work_does_not_grow_with_its_rows(tok: EncodecTokenizer) -> None:
    """The engine pushes every conversation's audio in one call a tick: a loop of ops over rows is a loop of kernel
    launches on a GPU (`s2s bench launches`)."""

    def ops(rows: int) -> tuple[int, int, int]:
        enc, dec = tok.streaming_encoder(rows), tok.streaming_decoder(rows)
        x = noise(12, rows=rows, seed=rows).numpy()  # host PCM, as the engine pushes it
        codes = torch.stack(enc.push(x[:, : 8 * FS]))  # past the warm-ups: the steady state is what is counted
        dec.push(codes)
        copies = []  # a copy to or from the device dispatches no op on the CPU: count the calls that make one

        def counted(method):
            def call(self, *args, **kwargs):
                copies.append(method.__name__)
                return method(self, *args, **kwargs)

            return call

        with (
            mock.patch.object(torch.Tensor, "to", counted(torch.Tensor.to)),
            mock.patch.object(torch.Tensor, "cpu", counted(torch.Tensor.cpu)),
            _DeviceOps() as encoding,
        ):
            enc.push(x[:, 8 * FS :])
        with _DeviceOps() as decoding:
            dec.push(codes[..., :4])
        return encoding.count, decoding.count, sorted(copies)

    one, eight = ops(1), ops(8)
    assert one[2] == ["cpu", "to"]  # the PCM over, the codes back
    assert one == eight


# ---- real speech -------------------------------------------------------------------------------------------------


def real_speech() -> np.ndarray:
    if have_espeak():
        return synthesize("The quick brown fox jumps over the lazy dog.")
    pytest.fail("espeak-ng is missing: scripts/setup.sh installs it")


def test_real_speech_streams_equal_offline(tok: EncodecTokenizer) -> None:
    wav = real_speech()
    assert wav.dtype == np.float32 and np.abs(wav).max() > 0.05 and len(wav) > 24000
    usable = len(wav) // FS * FS
    codes = tok.encode(wav[:usable])
    enc = tok.streaming_encoder(1)
    stream_codes = torch.cat([enc.push(wav[None, a : a + 1920])[0] for a in range(0, usable, 1920)], -1)
    assert_codes_equal_up_to_ties(tok, torch.from_numpy(wav[:usable]), stream_codes, codes)
    dec = tok.streaming_decoder(1)
    first = tok.decoder_warmup_frames
    audio = [dec.push(codes[..., :first])] + [dec.push(codes[..., f : f + 1]) for f in range(first, codes.shape[-1])]
    assert (torch.cat(audio, -1) - tok.decode(codes)).abs().max() <= 1e-5


def test_kept_speech_sample_loads_at_24k() -> None:
    wav = load_wav(SAMPLE_PATH)
    assert wav.dtype == np.float32 and 2.5 * 24000 < len(wav) < 5 * 24000 and np.abs(wav).max() > 0.05


# ---- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wav", "match"),
    [
        (np.zeros((1, 1, 320), np.float32), r"shape \[T\] or \[B, T\]"),
        (np.array([0.0, np.nan], np.float32), "NaN or inf"),
        (np.array([0.0, np.inf], np.float32), "NaN or inf"),
        (np.zeros(320, np.int16), "float32"),
        (torch.zeros(320, dtype=torch.int32), "float32"),
        (np.zeros(0, np.float32), "empty"),
        (np.zeros((0, 320), np.float32), "empty"),
        (np.full(320, 3000.0, np.float32), r"outside \[-1, 1\]"),
        ([0.0] * 320, "numpy array or torch tensor"),
    ],
)
def test_encode_bad_input(tok: EncodecTokenizer, wav, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.encode(wav)


def test_wrong_sample_rate(tok: EncodecTokenizer) -> None:
    with pytest.raises(ValueError, match="16000 Hz .* resample"):
        tok.encode(np.zeros(320, np.float32), sample_rate=16000)
    with pytest.raises(ValueError, match="resample"):
        tok.streaming_encoder(1).push(np.zeros((1, 320), np.float32), sample_rate=44100)


@pytest.mark.parametrize(
    ("codes", "match"),
    [
        (torch.zeros(2, 5, dtype=torch.long), r"shape \[B, K, F\]"),
        (torch.zeros(1, 3, 5, dtype=torch.long), "3 codebooks"),
        (torch.full((1, 2, 5), 1024, dtype=torch.long), r"\[0, 1024\)"),
        (torch.full((1, 2, 5), -1, dtype=torch.long), r"\[0, 1024\)"),
        (torch.zeros(1, 2, 5), "integers"),
        (torch.zeros(1, 2, 0, dtype=torch.long), "empty"),
    ],
)
def test_decode_bad_input(tok: EncodecTokenizer, codes: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.decode(codes)
    with pytest.raises(ValueError, match=match):
        tok.streaming_decoder(max(1, codes.shape[0]) if codes.dim() == 3 else 1).push(codes)


def test_streaming_bad_rows(tok: EncodecTokenizer) -> None:
    dec = tok.streaming_decoder(2)
    codes = torch.zeros(1, 2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="out of range"):
        dec.push(codes, rows=[2])
    with pytest.raises(ValueError, match="1 rows of input for 2"):
        dec.push(codes, rows=[0, 1])
    with pytest.raises(ValueError, match="repeat"):
        dec.push(torch.zeros(2, 2, 1, dtype=torch.long), rows=[1, 1])
    with pytest.raises(ValueError, match="batch_size"):
        tok.streaming_encoder(0)
    enc = tok.streaming_encoder(1)
    with pytest.raises(ValueError, match="1-D"):
        enc.push([np.zeros((2, 2), np.float32)])
    # a rejected push leaves the stream untouched
    x = noise(10)
    with pytest.raises(ValueError):
        enc.push([np.array([np.nan], np.float32)])
    assert_codes_equal_up_to_ties(tok, x, torch.cat(enc.push(x), -1), tok.encode(x))


def test_tie_helper_rejects_real_differences(tok: EncodecTokenizer) -> None:
    x = noise(12)
    codes = tok.encode(x)
    wrong = codes.clone()
    wrong[0, 0, 5] = (wrong[0, 0, 5] + 1) % 1024
    with pytest.raises(AssertionError, match="no tie"):
        assert_codes_equal_up_to_ties(tok, x, wrong, codes)
