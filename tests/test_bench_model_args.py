"""bench/common.py's model choice (`add_model_args`, `model_choice`): what weights a benchmark serves, the `s2s serve`
arguments and the rows' label for each, and what it refuses."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.common import ModelChoice, add_model_args, model_choice, model_label, model_server_args
from s2s.models.shipped import MODEL


def parsed(argv: list[str], default: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_args(p, default)
    return p.parse_args(argv)


def test_neither_flag_serves_the_shipped_codec_and_echo_model() -> None:
    args = parsed([])
    assert model_choice(args) == ModelChoice()
    assert model_server_args(args) == []  # `s2s serve` with no flags: the shipped weights
    assert model_label(args) == "shipped echo"
    assert model_choice(args).frame_size == 320  # the shipped EnCodec's


def test_a_bench_default_preset_serves_when_neither_flag_is_given() -> None:
    assert model_server_args(parsed([], default="tiny")) == ["--preset", "tiny"]
    assert model_label(parsed([], default="tiny")) == "preset tiny"
    assert model_server_args(parsed(["--model", str(MODEL)], default="tiny")) == ["--model", str(MODEL)]


def test_a_preset() -> None:
    args = parsed(["--preset", "small"])
    assert model_server_args(args) == ["--preset", "small"]
    assert model_label(args) == "preset small"
    assert model_choice(args).preset == "small" and model_choice(args).folder is None


def test_a_model_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my_echo"
    folder.mkdir()
    args = parsed(["--model", str(folder)])
    assert model_server_args(args) == ["--model", str(folder)]
    assert model_label(args) == "my_echo"
    assert model_choice(args).frame_size == 320  # no codec of its own: the shipped one
    assert model_label(parsed(["--model", str(MODEL)])) == "shipped echo"  # the shipped folder, named


def test_both_flags_an_unknown_preset_or_a_missing_folder_exit(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--model and --preset"):
        model_choice(parsed(["--model", str(tmp_path), "--preset", "tiny"]))
    with pytest.raises(SystemExit, match="--model and --preset"):
        model_server_args(parsed(["--model", str(tmp_path), "--preset", "tiny"], default="tiny"))
    with pytest.raises(SystemExit, match="--preset"):
        model_choice(parsed(["--preset", "huge"]))
    with pytest.raises(SystemExit, match="not a model folder"):
        model_choice(parsed(["--model", str(tmp_path / "absent")]))


def test_frames_keep_their_seconds_on_a_codec_of_longer_frames() -> None:
    encodec = ModelChoice()
    assert [encodec.frames(n) for n in (4, 150, 225)] == [4, 150, 225]
    mimi = ModelChoice(Path("moshi"))
    mimi.__dict__["frame_size"] = 1920  # (what a folder holding Mimi reads: 80 ms frames)
    assert mimi.frame_s == 0.08
    assert [mimi.frames(n) for n in (4, 150, 225)] == [1, 25, 38]


def test_load_gives_the_weights_serve_would() -> None:
    model, tok = ModelChoice(preset="tiny").load()
    assert model.config.hidden_size == 64 and model.config.num_codebooks == tok.num_codebooks
    model, tok = ModelChoice().load()
    assert model.config.hidden_size == 384 and tok.frame_size == 320  # the shipped echo model over the shipped codec
