"""`s2s infer` against Kyutai's own offline pipeline: a tiny Kyutai-layout folder with a Mimi, written by Kyutai's
code (`tests/moshi_reference.py`, in .venv-moshi), which also runs its pipeline over the same WAV file
(`pipeline_wav`: streaming Mimi encode frame by frame, `LMGen(lm, use_sampling=False).step` per frame, streaming
Mimi decode of each returned frame's audio codes; CPU, fp32). At temperature 0, `s2s infer`'s frames (text id and
codes) must equal Kyutai's frame for frame, and its reply WAV Kyutai's decoded audio.

The Mimi has 20 ms frames (`ratios=(8, 6, 5)`: a 240-sample hop, 480-sample frames), not `tiny_mimi_config`'s
default 64-sample ones: a second of audio is then 51 frames, not 376, which keeps Kyutai's CPU steps (three of them a
frame: encode, LM, decode) within the file's time; the LM's attention window (`context=16`) is still well inside
the file (crossed at frame 16, and again at 32 where a page of 16 steps leaves the window).

The Mimi transformers' window (128 steps at 100 Hz) holds the whole file: past its window Kyutai's streaming Mimi
leaves its own offline Mimi (its ring of exactly `context` keys drops, at a frame's second step, a key the frame's
first step attended to; after 10 s with Kyutai's Mimi), and the engine's Mimi is Kyutai's offline one (docs/DESIGN.md,
"Mimi"). The reference's "full_window" pipeline variant shows it. The last test replays the engine's stream through
its own teacher-forced forward (no Kyutai code): a difference of the streaming path alone would show there."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from moshi_reference import run_reference, tiny_lm_kwargs, tiny_mimi_config

from codec.pcm import load_wav, save_wav
from s2s.models.family import load_model
from s2s.models.moshi.text import TextPieces
from server.cli.main import main

DEP_Q = 8
FRAME = 480  # 2 x the hop of ratios (8, 6, 5)
SAMPLES = 24000 + 37  # about 1 s, the last frame partial: the engine and the reference pad it with zeros


def noise_and_tones(samples: int, seed: int) -> np.ndarray:
    """Seeded noise under two tones, a third from the middle on, and a short silence: in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / 24000
    x = 0.15 * rng.standard_normal(samples) + 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1230 * t)
    x += 0.25 * np.sin(2 * np.pi * 3100 * t) * (t > 0.5)
    x[(t > 0.3) & (t < 0.4)] = 0
    return np.clip(x, -1, 1).astype(np.float32)


@pytest.fixture(scope="module")
def infer(tmp_path_factory) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("moshi_infer")
    wav_path = out / "in.wav"
    save_wav(wav_path, noise_and_tones(SAMPLES, seed=11))
    lm = tiny_lm_kwargs(DEP_Q, context=16)
    mimi = tiny_mimi_config(DEP_Q, bins=lm["card"], ratios=(8, 6, 5))
    mimi["transformer"]["context"] = 128  # the file's 102 transformer steps: within it (see the module's docstring)
    config = {"name": "m", "seed": 7, "lm": lm, "batch": 1, "steps": 2, "mimi_config": mimi}
    config.update(pipeline_wav=str(wav_path))
    run_reference({"configs": [config]}, out)
    folder = out / "m"
    reply, steps = out / "reply.wav", out / "steps.json"
    main(["infer", "--model", str(folder), str(wav_path), str(reply), "--json", str(steps), "--temperature", "0"])
    ref = np.load(folder / "pipeline.npz")
    summary = json.loads((folder / "summary.json").read_text())["pipeline"]
    return SimpleNamespace(
        folder=folder, wav=wav_path, reply=reply, steps=json.loads(steps.read_text()), ref=ref, summary=summary
    )


def test_the_reference_heard_the_file_as_the_engine_does(infer) -> None:
    n = math.ceil(SAMPLES / FRAME)
    assert infer.summary["frame_size"] == FRAME and infer.summary["input_frames"] == n == 51
    assert infer.ref["frames"].shape == (n - 1, 1 + DEP_Q)
    assert infer.ref["user_codes"].shape == (DEP_Q, n)
    wav = load_wav(infer.wav)  # the engine's reading of the file
    np.testing.assert_array_equal(infer.ref["wav"], np.pad(wav, (0, n * FRAME - SAMPLES)))
    # not a degenerate stream: the text and codes vary, the reply is audible
    assert infer.summary["distinct_text"] > 10 and infer.summary["distinct_codes"] > 30
    assert 0.05 < infer.summary["audio_max_abs"] < 1


def test_one_frame_per_input_frame_but_the_first(infer) -> None:
    steps = infer.steps
    assert steps["model"] == str(infer.folder)
    assert steps["frame_s"] == pytest.approx(FRAME / 24000)
    n = math.ceil(SAMPLES / FRAME)
    assert [s["frame"] for s in steps["frames"]] == list(range(1, n))


def engine_frames(infer) -> np.ndarray:
    """`s2s infer`'s frames 1 .. n - 1 as [n - 1, 1 + dep_q]: the text id, then the codes."""
    return np.array([[s["text_id"], *s["codes"]] for s in infer.steps["frames"]])


def differing(got: np.ndarray, want: np.ndarray, names: tuple[str, str] = ("engine", "Kyutai")) -> str:
    """'' if the frames are equal, else which differ (numbered 1 .. as the JSON numbers them) and the first pair."""
    assert got.shape == want.shape, (got.shape, want.shape)
    rows = np.flatnonzero((got != want).any(1))
    if rows.size == 0:
        return ""
    f = rows[0]
    return (
        f"{rows.size} of {len(want)} frames differ (frames {(rows + 1).tolist()}); frame {f + 1}: "
        f"{names[0]} {got[f].tolist()}, {names[1]} {want[f].tolist()}"
    )


def test_text_ids_and_codes_equal_kyutais_frame_for_frame(infer) -> None:
    assert not differing(engine_frames(infer), infer.ref["frames"])


def test_text_pieces_are_the_tokenizer_s(infer) -> None:
    pieces = TextPieces(infer.folder / "tokenizer.model", (3, 0))
    for s in infer.steps["frames"]:
        assert s["text"] == pieces.processor.id_to_piece(s["text_id"])


def test_the_reply_wav_is_kyutais_decoded_audio(infer) -> None:
    """`save_wav` writes 16-bit PCM (x * 32767, rounded; read back as / 32768): within 1.5 / 32768 of the float
    audio in [-1, 1], inside 1e-4."""
    want = infer.ref["audio"]
    got = load_wav(infer.reply)
    assert got.shape == want.shape == ((math.ceil(SAMPLES / FRAME) - 1) * FRAME,)
    assert np.abs(want).max() < 1  # (no clipping)
    err = np.abs(got - want).reshape(-1, FRAME).max(1)  # per frame, 1 .. n - 1
    bad = np.flatnonzero(err >= 1e-4)
    assert bad.size == 0, f"frames {(bad + 1).tolist()} differ, by up to {err.max():.3g}"


# ---- the engine's stream against its own teacher-forced forward ---------------------------------------------------


def test_the_engine_s_stream_is_its_own_teacher_forced_greedy(infer) -> None:
    """The engine's frames replayed as teacher-forced codes (tests/moshi_reference.py's `replay_codes`: column j
    holds frame j + 1 and the user codes of frame j + 1) through its own `MoshiLM.forward`, whose attention is
    Kyutai's sliding window (`context` steps, tests/test_moshi.py): each column's greedy tokens must be the frame
    the stream sampled. No Kyutai code: a streaming-only difference of the LM shows here."""
    frames = engine_frames(infer)
    user = infer.ref["user_codes"]  # Kyutai's streaming Mimi's codes, within its window: the engine's
    replay = torch.from_numpy(np.concatenate([frames.T, user[:, 1:]], 0)[None].astype(np.int64))
    model, _ = load_model(infer.folder, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        text, audio = model(replay)
    greedy = torch.cat([text.argmax(-1), audio[0].nan_to_num(float("-inf")).argmax(-1)], 0).numpy().T  # [n - 1, 9]
    # (the last column's delayed codebooks are not predicted: the frame after it would hold them)
    assert not differing(frames[:-1], greedy[:-1], ("stream", "teacher-forced"))


def infer_exit(*argv: str) -> str:
    """`s2s infer ARGV`'s SystemExit message (a traceback fails the test)."""
    with pytest.raises(SystemExit) as e:
        main(["infer", *argv, "--temperature", "0"])
    assert isinstance(e.value.code, str), e.value.code
    return e.value.code


def test_a_missing_model_folder_is_named(infer, tmp_path) -> None:
    message = infer_exit("--model", str(tmp_path / "nowhere"), str(infer.wav), str(tmp_path / "reply.wav"))
    assert message.startswith("s2s infer:") and "nowhere" in message
    assert not (tmp_path / "reply.wav").exists()


def test_an_input_that_is_not_a_wav_is_named(infer, tmp_path) -> None:
    not_wav = tmp_path / "notes.wav"
    not_wav.write_text("this is not audio\n")
    message = infer_exit("--model", str(infer.folder), str(not_wav), str(tmp_path / "reply.wav"))
    assert message.startswith("s2s infer:") and "notes.wav" in message
    message = infer_exit("--model", str(infer.folder), str(tmp_path / "absent.wav"), str(tmp_path / "reply.wav"))
    assert message.startswith("s2s infer:") and "absent.wav" in message
    assert not (tmp_path / "reply.wav").exists()
