"""codec.load_tokenizer: either codec from a path (an EnCodec folder, Kyutai's Mimi file with its config given or
beside it, a transformers Mimi folder), and a clear error, at the call and at the command line, for a path that is
none of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_mimi import kyutai_config, transformers_mimi
from transformers import EncodecConfig, EncodecModel

from codec import EncodecTokenizer, MimiTokenizer, load_tokenizer
from server.cli.engine_args import engine_of
from server.cli.main import main, parser

TINY_MIMI = kyutai_config([4, 4, 2], 375, layers=1, n_q=8)  # 64-sample frames, 8 codebooks of 64


def noise(samples: int, seed: int = 0) -> np.ndarray:
    return (0.3 * np.random.default_rng(seed).standard_normal((2, samples))).clip(-1, 1).astype(np.float32)


@pytest.fixture(scope="module")
def mimi_file(tmp_path_factory) -> tuple[Path, MimiTokenizer]:
    """A tiny random Mimi saved as Kyutai's file, its config beside it (`save_pretrained`)."""
    tok = MimiTokenizer.random(TINY_MIMI, seed=3)
    path = tmp_path_factory.mktemp("mimi") / "tiny.safetensors"
    tok.save_pretrained(path)
    return path, tok


def test_an_encodec_folder_gives_encodec_at_the_bandwidth_asked(tmp_path) -> None:
    model = EncodecModel(EncodecConfig(num_filters=4, hidden_size=16, codebook_dim=16, num_lstm_layers=1))
    model.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path, bandwidth=3.0, num_codebooks=2)  # (num_codebooks is Mimi's)
    assert isinstance(tok, EncodecTokenizer)
    assert (tok.num_codebooks, tok.frame_size) == (4, 320)


def test_a_mimi_file_finds_its_config_beside_it_or_takes_one(mimi_file, tmp_path) -> None:
    path, saved = mimi_file
    assert json.loads(path.with_suffix(".json").read_text()) == saved.config.to_kyutai()
    x = noise(20 * saved.frame_size)
    tok = load_tokenizer(path, bandwidth=6.0, num_codebooks=6)  # (bandwidth is EnCodec's)
    assert isinstance(tok, MimiTokenizer)
    assert (tok.num_codebooks, tok.frame_size, tok.codebook_size) == (6, 64, 64)
    codes = tok.encode(x)
    assert torch.equal(codes, saved.encode(x)[:, :6]) and codes.unique().numel() > 10

    alone = tmp_path / "alone.safetensors"  # no alone.json: Kyutai's full-size Mimi, which these weights do not fit
    shutil.copy(path, alone)
    with pytest.raises(ValueError, match="Mimi checkpoint .*alone.safetensors"):
        load_tokenizer(alone)
    for config in (path.with_suffix(".json"), TINY_MIMI):
        assert torch.equal(load_tokenizer(alone, config=config).encode(x), saved.encode(x))


def test_a_transformers_mimi_folder_gives_mimi(tmp_path) -> None:
    transformers_mimi(tmp_path)
    tok = load_tokenizer(tmp_path, num_codebooks=6)
    assert isinstance(tok, MimiTokenizer) and (tok.num_codebooks, tok.frame_size) == (6, 1920)
    x = noise(4 * 1920)
    assert torch.equal(tok.encode(x), MimiTokenizer.from_pretrained(tmp_path, num_codebooks=6).encode(x))
    with pytest.raises(ValueError, match="config is for a Mimi file"):
        load_tokenizer(tmp_path, config=TINY_MIMI)


def test_a_path_that_is_no_codec_is_told(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no codec at .*give an EnCodec folder, a Mimi safetensors file"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("not weights")
    with pytest.raises(ValueError, match="notes.txt is not a safetensors file"):
        load_tokenizer(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama', not a codec"):
        load_tokenizer(tmp_path / "llama")


def test_the_commands_tell_a_path_that_is_no_codec(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("not weights")
    args = parser().parse_args(["serve", "--codec", str(tmp_path / "notes.txt"), "--preset", "tiny", "--threads", "1"])
    with pytest.raises(SystemExit, match="--codec: .*notes.txt is not a safetensors file"):
        engine_of(args)
    with pytest.raises(SystemExit, match="--codec: no codec at"):
        main(["roundtrip", "--codec", str(tmp_path / "missing")])
