"""codec.MimiTokenizer against Kyutai's own Mimi (moshi 0.2.13, run in .venv-moshi by tests/mimi_reference.py) and
transformers' MimiModel, on tiny random configurations built here; its streaming against the offline paths in
random chunkings; bad input.

What is the reference where. Offline: Kyutai's `MimiModel.encode` (codes, exactly) and `decode` (audio, 1e-4 in fp32).
Streaming encoder: those offline codes. Streaming decoder: Kyutai's frame-by-frame streaming decode, as far as it
equals Kyutai's offline decode, and the offline decode after that. Kyutai's streaming transformers keep their keys in a
ring of `context` steps and write a whole frame's `stride` steps (the 2x resampling's: 2 for Mimi) before attending,
so once a stream is past the context, the first step of each frame attends to `context - stride + 1` steps instead of
the `context` steps that its offline pass (and transformers' sliding window) gives: Kyutai's streaming departs from
its own offline output from frame `context // stride` on (frame 125, 10 s, for Kyutai's Mimi). A stream that equals
offline in every chunking cannot equal both there; these tests ask for offline, and the configurations with a short
context run their streams well past it.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from mimi_reference import signals
from safetensors.torch import load_file, save_file
from transformers import MimiConfig, MimiModel
from transformers.models.mimi.modeling_mimi import MimiLayerScale

from codec import MimiTokenizer

ROOT = Path(__file__).resolve().parents[1]
MOSHI_PYTHON = ROOT / ".venv-moshi" / "bin" / "python"
REFERENCE = Path(__file__).resolve().parent / "mimi_reference.py"
needs_moshi = pytest.mark.skipif(
    not MOSHI_PYTHON.exists(), reason=f"Kyutai's Mimi needs {MOSHI_PYTHON} (run scripts/setup_moshi_client.sh)"
)
ROWS = 8  # rows (conversations) in every reference batch and every streaming test
TOL = 1e-4  # fp32 audio


def kyutai_config(
    ratios: list[int],
    frame_rate: float,
    *,
    dim: int = 32,
    n_filters: int = 4,
    layers: int = 2,
    heads: int = 4,
    ff: int = 64,
    context: int = 250,
    n_q: int = 8,
    bins: int = 64,
    q_dim: int = 16,
    residual_layers: int = 1,
) -> dict:
    """A Mimi config as `moshi.models.loaders.get_mimi` reads it: Kyutai's `_mimi_config` at other sizes."""
    seanet = {
        "channels": 1,
        "dimension": dim,
        "causal": True,
        "n_filters": n_filters,
        "n_residual_layers": residual_layers,
        "activation": "ELU",
        "compress": 2,
        "dilation_base": 2,
        "disable_norm_outer_blocks": 0,
        "kernel_size": 7,
        "residual_kernel_size": 3,
        "last_kernel_size": 3,
        "norm": "none",
        "pad_mode": "constant",
        "ratios": ratios,
        "true_skip": True,
    }
    transformer = {
        "d_model": dim,
        "num_heads": heads,
        "num_layers": layers,
        "causal": True,
        "layer_scale": 0.01,
        "context": context,
        "conv_layout": True,
        "max_period": 10000,
        "gating": "none",
        "norm": "layer_norm",
        "positional_embedding": "rope",
        "dim_feedforward": ff,
        "input_dimension": dim,
        "output_dimensions": [dim],
    }
    quantizer = {"dimension": q_dim, "n_q": n_q, "bins": bins, "input_dimension": dim, "output_dimension": dim}
    return {
        "sample_rate": 24000,
        "channels": 1,
        "frame_rate": frame_rate,
        "seanet": seanet,
        "quantizer": quantizer,
        "transformer": transformer,
    }


# name: (seed, config, num_codebooks, frames)
CONFIGS = {
    # Kyutai's Mimi at reduced widths: ratios 8, 6, 5, 4 (1920-sample frames), 12.5 Hz after a 2x downsampling, context
    # 250; 2 transformer layers of 8, 12 codebooks in the file of which 8 are used (32 and 8 for Moshi)
    "kyutai_shape": (0, kyutai_config([8, 6, 5, 4], 12.5, n_q=12), 8, 12),
    # 64-sample frames, 3 layers, a context of 5 steps (2.5 frames) that the streams run far past, 4 of 6 codebooks
    "ratios_442": (1, kyutai_config([4, 4, 2], 375, layers=3, context=5, n_q=6), 4, 20),
    # a 4x resampling (200 Hz encoder, 50 Hz codes), 1 layer of 2 heads, 2 residual blocks a stage, 32 bins, context 7
    "ratios_654_x4": (
        2,
        kyutai_config([6, 5, 4], 50, dim=24, heads=2, layers=1, context=7, n_q=4, bins=32, residual_layers=2),
        4,
        16,
    ),
}


@dataclass
class Ref:
    """One configuration's files and Kyutai's outputs on them (tests/mimi_reference.py)."""

    name: str
    weights: Path
    config_path: Path
    config: dict
    num_codebooks: int
    frames: int
    frame_size: int
    stride: int  # encoder steps a frame (the resampling's)
    npz: dict[str, np.ndarray]
    summary: dict

    @property
    def exact_stream_frames(self) -> int:
        """Frames over which Kyutai's streaming equals its offline output (the module docstring)."""
        return self.config["transformer"]["context"] // self.stride

    def tokenizer(self) -> MimiTokenizer:
        return MimiTokenizer.from_pretrained(self.weights, config=self.config_path, num_codebooks=self.num_codebooks)


Refs = dict[str, Ref]
Toks = dict[str, MimiTokenizer]


@pytest.fixture(scope="module")
def kyutai(tmp_path_factory) -> Refs:
    """Kyutai's Mimi on every configuration, in one run of .venv-moshi's Python (seconds)."""
    if not MOSHI_PYTHON.exists():
        pytest.skip(f"Kyutai's Mimi needs {MOSHI_PYTHON} (run scripts/setup_moshi_client.sh)")
    out = tmp_path_factory.mktemp("kyutai_mimi")
    spec = {
        "configs": [
            {"name": name, "seed": seed, "mimi_config": cfg, "num_codebooks": k, "rows": ROWS, "frames": frames}
            for name, (seed, cfg, k, frames) in CONFIGS.items()
        ]
    }
    (out / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [str(MOSHI_PYTHON), str(REFERENCE), str(out / "spec.json"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"the reference failed:\n{proc.stderr[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    refs = {}
    for name, (_, cfg, k, frames) in CONFIGS.items():
        hop = math.prod(cfg["seanet"]["ratios"])
        stride = round(cfg["sample_rate"] / hop / cfg["frame_rate"])
        with np.load(out / name / "ref.npz") as z:
            npz = {key: z[key] for key in z.files}
        refs[name] = Ref(
            name,
            out / name / "mimi.safetensors",
            out / name / "mimi_config.json",
            cfg,
            k,
            frames,
            summary[name]["frame_size"],
            stride,
            npz,
            summary[name],
        )
    return refs


@pytest.fixture(scope="module")
def toks(kyutai: Refs) -> Toks:
    """Ours, on each configuration's files."""
    return {name: ref.tokenizer() for name, ref in kyutai.items()}


def describe_code_mismatch(got: torch.Tensor, want: np.ndarray) -> str:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    bad = np.argwhere(got != want)
    return f"{len(bad)} of {want.size} codes differ; first [row, codebook, frame] {bad[:5].tolist()}"


def max_diff(got: torch.Tensor, want: np.ndarray) -> float:
    got = torch.as_tensor(got).float()
    assert got.shape == want.shape, (tuple(got.shape), want.shape)
    return float((got - torch.from_numpy(want)).abs().max())


configs = pytest.mark.parametrize("name", list(CONFIGS))


# ---- the reference itself -----------------------------------------------------------------------------------------


@needs_moshi
@configs
def test_reference_is_discriminating(kyutai: Refs, name: str) -> None:
    """Codes vary in every codebook, the audio depends on the codes, and Kyutai's streaming equals its own offline
    output as far as the module docstring says: else the comparisons below would prove little."""
    ref = kyutai[name]
    z, fs, n = ref.npz, ref.frame_size, ref.exact_stream_frames
    bins = ref.config["quantizer"]["bins"]
    assert z["codes"].shape == (ROWS, ref.num_codebooks, ref.frames)
    assert z["audio"].shape == z["wav"].shape == (ROWS, ref.frames * fs)
    for k in range(ref.num_codebooks):
        assert len(np.unique(z["codes"][:, k])) >= bins // 4, f"codebook {k} hardly varies"
    assert np.abs(z["audio"] - z["random_audio"]).max() > 0.1, "the decoder's output hardly depends on the codes"
    assert 0.02 < np.sqrt(np.mean(z["audio"] ** 2)) < 1.0
    np.testing.assert_array_equal(z["stream_codes"][..., :n], z["codes"][..., :n])
    for stream, offline in (("stream_audio", "audio"), ("random_stream_audio", "random_audio")):
        assert np.abs(z[stream][:, : n * fs] - z[offline][:, : n * fs]).max() < 1e-5
        if n < ref.frames:  # ... and no further (why the streaming decoder's reference is offline past the context)
            assert np.abs(z[stream][:, n * fs :] - z[offline][:, n * fs :]).max() > 1e-3
    np.testing.assert_array_equal(z["tail_codes"][..., :-1], z["codes"][..., :-1])


# ---- offline paths against Kyutai's --------------------------------------------------------------------------------


@needs_moshi
@configs
def test_attributes(kyutai: Refs, toks: Toks, name: str) -> None:
    ref = kyutai[name]
    tok = toks[name]
    assert tok.sample_rate == 24000
    assert tok.frame_size == ref.frame_size == round(24000 / ref.config["frame_rate"])
    assert tok.frame_rate == pytest.approx(ref.config["frame_rate"])
    assert tok.num_codebooks == ref.num_codebooks
    assert tok.codebook_size == ref.config["quantizer"]["bins"]


@needs_moshi
@configs
def test_encode_decode_equal_kyutai(kyutai: Refs, toks: Toks, name: str) -> None:
    ref = kyutai[name]
    tok, z = toks[name], ref.npz
    codes = tok.encode(torch.from_numpy(z["wav"]))
    assert codes.dtype == torch.long
    assert np.array_equal(codes.numpy(), z["codes"]), f"{name} encode: {describe_code_mismatch(codes, z['codes'])}"
    one = tok.encode(z["wav"][3])  # [T] and a numpy array
    assert np.array_equal(one.numpy(), z["codes"][3:4]), describe_code_mismatch(one, z["codes"][3:4])

    for codes_key, audio_key in (("codes", "audio"), ("random_codes", "random_audio")):
        audio = tok.decode(torch.from_numpy(z[codes_key]))
        assert audio.shape == (ROWS, ref.frames * ref.frame_size)
        assert max_diff(audio, z[audio_key]) <= TOL, f"{name} decode({codes_key}): {max_diff(audio, z[audio_key])}"


@needs_moshi
@configs
def test_encode_pads_the_last_frame_as_kyutai(kyutai: Refs, toks: Toks, name: str) -> None:
    ref = kyutai[name]
    z, fs = ref.npz, ref.frame_size
    codes = toks[name].encode(torch.from_numpy(z["wav"][:, : (ref.frames - 1) * fs + fs // 3]))
    assert np.array_equal(codes.numpy(), z["tail_codes"]), describe_code_mismatch(codes, z["tail_codes"])


# ---- streaming, random chunkings ----------------------------------------------------------------------------------


def plan_streams(rng: np.random.Generator, sources: int, frames: int, fs: int, per_row: int) -> list[list[tuple]]:
    """For each row, its streams one after another: (source, samples it runs for, idle steps before it starts).
    Some streams stop early, mid-frame, abandoned; most run to the end."""
    plans = []
    for _ in range(ROWS):
        row = []
        for _ in range(per_row):
            stop = frames * fs if rng.random() < 0.7 else int(rng.integers(1, frames * fs))
            row.append((int(rng.integers(sources)), stop, int(rng.integers(0, 4))))
        plans.append(row)
    return plans


@needs_moshi
@configs
@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_encoder_random_chunks_equal_kyutai(kyutai: Refs, toks: Toks, name: str, seed: int) -> None:
    """8 rows at once, each starting, pausing and stopping at random, with random pushes (partial frames, empty
    ones): every row's codes equal Kyutai's offline codes of its stream, each frame's as soon as it is complete."""
    ref = kyutai[name]
    tok, z, fs, k = toks[name], ref.npz, ref.frame_size, ref.num_codebooks
    rng = np.random.default_rng(seed)
    plans = plan_streams(rng, ROWS, ref.frames, fs, per_row=2)
    enc = tok.streaming_encoder(ROWS)
    current: list[dict | None] = [None] * ROWS
    started = [0] * ROWS
    checked = 0
    while any(plans) or any(current):
        for r in range(ROWS):  # streams start after their idle steps; a row's later stream starts from a reset
            if current[r] is None and plans[r]:
                src, stop, idle = plans[r][0]
                if idle:
                    plans[r][0] = (src, stop, idle - 1)
                    continue
                plans[r].pop(0)
                if started[r]:
                    enc.reset(r)
                started[r] += 1
                current[r] = {"src": src, "stop": stop, "pos": 0, "codes": []}
        rows = [r for r in rng.permutation(ROWS).tolist() if current[r] is not None and rng.random() < 0.8]
        if not rows:
            continue
        chunks = []
        for r in rows:
            s = current[r]
            size = int(rng.integers(0, int(2.5 * fs)))
            chunks.append(z["wav"][s["src"], s["pos"] : min(s["stop"], s["pos"] + size)])
        out = enc.push(chunks, rows=rows)
        assert len(out) == len(rows)
        for r, chunk, codes in zip(rows, chunks, out, strict=True):
            s = current[r]
            before = s["pos"] // fs
            s["pos"] += len(chunk)
            assert tuple(codes.shape) == (k, s["pos"] // fs - before), (
                f"row {r}: {tuple(codes.shape)} after {s['pos']} samples: each frame comes out once complete"
            )
            s["codes"].append(torch.as_tensor(codes))
            if s["pos"] == s["stop"]:
                got = torch.cat(s["codes"], -1).numpy()
                want = z["codes"][s["src"], :, : s["stop"] // fs]
                assert np.array_equal(got, want), (
                    f"{name} row {r} stream {started[r]} (source {s['src']}, {s['stop']} samples): "
                    f"{describe_code_mismatch(got[None], want[None])}"
                )
                checked += 1
                current[r] = None
    assert checked == 2 * ROWS


def decoder_reference(ref: Ref, src: int) -> tuple[np.ndarray, np.ndarray]:
    """Source `src` (the 8 encoded rows, then 8 rows of random codes): codes and the audio to expect from a stream of
    them: Kyutai's frame-by-frame streaming decode, then its offline decode once its streaming departs from it."""
    z, cut = ref.npz, ref.exact_stream_frames * ref.frame_size
    codes_key, stream_key, offline_key = (
        ("codes", "stream_audio", "audio") if src < ROWS else ("random_codes", "random_stream_audio", "random_audio")
    )
    row = src % ROWS
    return z[codes_key][row], np.concatenate([z[stream_key][row, :cut], z[offline_key][row, cut:]])


@needs_moshi
@configs
@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_decoder_random_chunks_equal_kyutai(kyutai: Refs, toks: Toks, name: str, seed: int) -> None:
    """8 rows at once, starting, pausing and stopping at random, pushing 1 to 3 frames at a time (rows that push as
    many frames share a call): every row's audio equals Kyutai's streaming decode of its codes (see
    `decoder_reference`), each frame's in the push that brings it."""
    ref = kyutai[name]
    tok, fs = toks[name], ref.frame_size
    rng = np.random.default_rng(100 + seed)
    plans = plan_streams(rng, 2 * ROWS, ref.frames, 1, per_row=2)  # (in frames)
    dec = tok.streaming_decoder(ROWS)
    current: list[dict | None] = [None] * ROWS
    started = [0] * ROWS
    checked = 0
    while any(plans) or any(current):
        for r in range(ROWS):
            if current[r] is None and plans[r]:
                src, stop, idle = plans[r][0]
                if idle:
                    plans[r][0] = (src, stop, idle - 1)
                    continue
                plans[r].pop(0)
                if started[r]:
                    dec.reset(r)
                started[r] += 1
                codes, audio = decoder_reference(ref, src)
                current[r] = {"src": src, "stop": stop, "pos": 0, "codes": codes, "want": audio, "audio": []}
        by_n: dict[int, list[int]] = {}
        for r in rng.permutation(ROWS).tolist():
            s = current[r]
            if s is not None and rng.random() < 0.8:
                by_n.setdefault(min(int(rng.integers(1, 4)), s["stop"] - s["pos"]), []).append(r)
        for n, rows in by_n.items():
            pieces = [current[r]["codes"][:, current[r]["pos"] : current[r]["pos"] + n] for r in rows]
            batch = torch.from_numpy(np.stack(pieces))
            out = dec.push(batch, rows=rows)
            assert tuple(out.shape) == (len(rows), n * fs), tuple(out.shape)
            for i, r in enumerate(rows):
                s = current[r]
                s["pos"] += n
                s["audio"].append(out[i].float())
                if s["pos"] == s["stop"]:
                    got = torch.cat(s["audio"]).numpy()
                    want = s["want"][: s["stop"] * fs]
                    err = np.abs(got - want)
                    assert err.max() <= TOL, (
                        f"{name} row {r} stream {started[r]} (source {s['src']}, {s['stop']} frames): max diff "
                        f"{err.max():.3g}, first bad frame {int(np.argmax(err > TOL)) // fs}"
                    )
                    checked += 1
                    current[r] = None
    assert checked == 2 * ROWS


# ---- transformers' MimiModel ---------------------------------------------------------------------------------------


def transformers_mimi(folder: Path, seed: int = 0, sliding_window: int = 6, num_quantizers: int = 8) -> MimiModel:
    """A tiny random transformers Mimi, saved with `save_pretrained`: the transformers' weights and layer scales
    raised, codebooks fitted to the residuals they quantize, the decoder's last convolution scaled to an audio-like
    level."""
    cfg = MimiConfig(
        hidden_size=32,
        num_filters=4,
        codebook_size=64,
        codebook_dim=16,
        vector_quantization_hidden_dimension=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=64,
        num_quantizers=num_quantizers,
        upsample_groups=32,
        sliding_window=sliding_window,
    )
    torch.manual_seed(seed)
    model = MimiModel(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    wav = torch.from_numpy(signals(4, 10 * 1920, seed + 7))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MimiLayerScale):
                m.scale.copy_(0.2 + 0.8 * torch.rand(m.scale.shape, generator=g))
            elif isinstance(m, torch.nn.Linear):  # (initialised with std 0.02: the transformers would hardly matter)
                m.weight.normal_(0.0, m.in_features**-0.5, generator=g)
        last = [m for m in model.decoder.modules() if isinstance(m, torch.nn.Conv1d)][-1]
        last.weight.mul_(0.03)
        last.bias.mul_(0.03)
        latent = model.encoder(wav[:, None]).latents
        q = model.quantizer
        for rvq in (q.semantic_residual_vector_quantizer, q.acoustic_residual_vector_quantizer):
            residual = rvq.input_proj(latent)
            for layer in rvq.layers:
                book = layer.codebook
                flat = residual.transpose(1, 2).reshape(-1, residual.shape[1])
                noise = torch.randn(book.codebook_size, flat.shape[1], generator=g)
                embed = flat.mean(0) + (flat.std(0) + 1e-3) * noise
                usage = 0.5 + 1.5 * torch.rand(book.codebook_size, generator=g)
                book.cluster_usage.copy_(usage)
                book.embed_sum.copy_(embed * usage[:, None])
                book._embed = None
                residual = residual - layer.decode(layer.encode(residual))
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> tuple[Path, MimiModel]:
    folder = tmp_path_factory.mktemp("transformers_mimi")
    return folder, transformers_mimi(folder)


@pytest.fixture(scope="module")
def hf_tok(hf) -> MimiTokenizer:
    return MimiTokenizer.from_pretrained(hf[0], num_codebooks=6)


def test_encode_equals_transformers(hf, hf_tok: MimiTokenizer) -> None:
    """Codes equal transformers' `MimiModel.encode` on the folder it saved, over a stream 5x its sliding window."""
    _, model = hf
    assert (hf_tok.sample_rate, hf_tok.frame_size, hf_tok.codebook_size, hf_tok.num_codebooks) == (24000, 1920, 64, 6)
    assert hf_tok.frame_rate == pytest.approx(12.5)
    wav = torch.from_numpy(signals(ROWS, 15 * 1920, 11))
    with torch.no_grad():
        want = model.encode(wav[:, None], num_quantizers=6).audio_codes
        want_audio = model.decode(want).audio_values[:, 0]
    assert want.shape == (ROWS, 6, 15)
    for k in range(6):
        assert want[:, k].unique().numel() >= 16, f"codebook {k} hardly varies"
    codes = hf_tok.encode(wav)
    assert torch.equal(codes, want), describe_code_mismatch(codes, want.numpy())
    # (transformers' offline decode; its chunked decode is no reference: issue 46)
    assert max_diff(hf_tok.decode(want), want_audio.numpy()) <= TOL
    # all 8 codebooks: the first 6 are the codes above (residual quantization)
    every = MimiTokenizer.from_pretrained(hf[0], num_codebooks=8).encode(wav)
    with torch.no_grad():
        want8 = model.encode(wav[:, None], num_quantizers=8).audio_codes
    assert torch.equal(every, want8), describe_code_mismatch(every, want8.numpy())
    assert torch.equal(every[:, :6], codes)


# ---- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wav", "match"),
    [
        (np.zeros((1, 1, 1920), np.float32), "shape"),
        (np.array([0.0, np.nan] * 960, np.float32), "NaN"),
        (np.array([0.0, np.inf] * 960, np.float32), "inf"),
    ],
)
def test_encode_bad_input(hf_tok: MimiTokenizer, wav: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hf_tok.encode(wav)
    with pytest.raises(ValueError, match=match):
        hf_tok.streaming_encoder(1).push([wav] if wav.ndim == 1 else wav)


def test_wrong_sample_rate(hf_tok: MimiTokenizer) -> None:
    with pytest.raises(ValueError, match="16000"):
        hf_tok.encode(np.zeros(1920, np.float32), sample_rate=16000)
    with pytest.raises(ValueError, match="44100"):
        hf_tok.streaming_encoder(1).push([np.zeros(1920, np.float32)], sample_rate=44100)
    assert hf_tok.encode(np.zeros(1920, np.float32), sample_rate=24000).shape == (1, 6, 1)


@pytest.mark.parametrize(
    ("codes", "match"),
    [
        (torch.zeros(6, 5, dtype=torch.long), "shape"),
        (torch.zeros(1, 3, 5, dtype=torch.long), "3 codebooks|codebooks"),
        (torch.full((1, 6, 5), 64, dtype=torch.long), "64"),
        (torch.full((1, 6, 5), -1, dtype=torch.long), "64"),
        (torch.zeros(1, 6, 5), "integer"),
    ],
)
def test_decode_bad_input(hf_tok: MimiTokenizer, codes: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hf_tok.decode(codes)
    with pytest.raises(ValueError, match=match):
        hf_tok.streaming_decoder(1).push(codes)


def test_bad_pushes_leave_every_row_untouched(hf_tok: MimiTokenizer) -> None:
    """A push that fails (a NaN in one row's chunk, a row index out of range, codes out of range in one row) raises at
    the call and changes no row: the same streams then go on to the offline result."""
    tok, fs = hf_tok, hf_tok.frame_size
    wav = signals(4, 6 * fs, 3)
    want = tok.encode(wav)
    enc = tok.streaming_encoder(4)
    got: list[list[torch.Tensor]] = [[], [], [], []]
    cuts = [0, fs + 100, 2 * fs + 7, 3 * fs, 4 * fs + 1500, 6 * fs]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        if i in (1, 3):
            poisoned = wav[1, a:b].copy()
            poisoned[len(poisoned) // 2] = np.nan
            with pytest.raises(ValueError, match="NaN"):
                enc.push([wav[0, a:b], poisoned, wav[2, a:b]], rows=[0, 1, 2])
            with pytest.raises(ValueError, match="range"):
                enc.push([wav[0, a:b], wav[1, a:b]], rows=[0, 4])
        for r, codes in enumerate(enc.push([wav[r, a:b] for r in range(4)], rows=[0, 1, 2, 3])):
            got[r].append(torch.as_tensor(codes))
    stream = torch.stack([torch.cat(g, -1) for g in got])
    assert torch.equal(stream, want), describe_code_mismatch(stream, want.numpy())

    audio = tok.decode(want)
    dec = tok.streaming_decoder(4)
    out: list[list[torch.Tensor]] = [[], [], [], []]
    for f in range(6):
        if f in (1, 4):
            bad = want[:3, :, f : f + 1].clone()
            bad[1, 2, 0] = tok.codebook_size
            with pytest.raises(ValueError, match=str(tok.codebook_size)):
                dec.push(bad, rows=[0, 1, 2])
            with pytest.raises(ValueError, match="range"):
                dec.push(want[:2, :, f : f + 1], rows=[3, 4])
        pcm = dec.push(want[:, :, f : f + 1], rows=[0, 1, 2, 3])
        for r in range(4):
            out[r].append(pcm[r])
    assert max_diff(torch.stack([torch.cat(o) for o in out]), audio.numpy()) <= TOL


def test_missing_weight_in_transformers_folder(hf, tmp_path: Path) -> None:
    folder, _ = hf
    state = load_file(folder / "model.safetensors")
    key = next(k for k in sorted(state) if "encoder_transformer" in k and k.endswith("q_proj.weight"))
    del state[key]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        MimiTokenizer.from_pretrained(tmp_path)


@needs_moshi
@pytest.mark.parametrize(
    "key",
    [
        "encoder.model.0.conv.conv.weight",
        "decoder_transformer.transformer.layers.1.self_attn.in_projs.0.weight",
        "quantizer.rvq_rest.vq.layers.0._codebook.embedding_sum",
        "upsample.convtr.convtr.convtr.weight",
    ],
)
def test_missing_weight_in_kyutai_file(kyutai: Refs, tmp_path: Path, key: str) -> None:
    ref = kyutai["kyutai_shape"]
    state = load_file(ref.weights)
    assert key in state
    del state[key]
    save_file(state, str(tmp_path / "mimi.safetensors"))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        MimiTokenizer.from_pretrained(tmp_path / "mimi.safetensors", config=ref.config_path)


@needs_moshi
def test_weights_that_do_not_fit_the_config(kyutai: Refs) -> None:
    ref = kyutai["kyutai_shape"]
    with pytest.raises(ValueError):  # tiny weights, Kyutai's full-size default config
        MimiTokenizer.from_pretrained(ref.weights)
    with pytest.raises(ValueError, match="codebooks"):  # 12 in the file
        MimiTokenizer.from_pretrained(ref.weights, config=ref.config_path, num_codebooks=13)
