"""The shipped weights are the default: `s2s weights --json` names them, and `--random-weights` or a `--preset`
(without `--model`) gives seeded random weights instead."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from s2s import S2SModel
from s2s.models.shipped import shipped
from server.cli.engine_args import weights_of
from server.cli.options import add_engine_args


def engine_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_weights_json_names_the_shipped_folders() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "weights", "--json"], check=True, capture_output=True, text=True
    ).stdout
    folders = {k: Path(v) for k, v in json.loads(out).items()}
    assert folders == {"codec": shipped("codec"), "model": shipped("model")}
    assert S2SModel.from_pretrained(folders["model"]).config.num_codebooks == 2


def test_the_default_is_shipped_and_random_weights_are_one_flag_away(tmp_path) -> None:
    assert weights_of(engine_args()) == (shipped("codec"), shipped("model"))
    assert weights_of(engine_args("--random-weights")) == (None, None)
    assert weights_of(engine_args("--preset", "tiny")) == (None, None)
    assert weights_of(engine_args("--model", str(tmp_path))) == (shipped("codec"), tmp_path)
