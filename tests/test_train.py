"""`s2s train codec --quick` and `s2s train echo --quick`: each runs in under a minute, writes a folder the loaders
take, and its loss falls. What is given beside `--quick` stays (here, fewer steps than its own)."""

import json
import subprocess
import sys

from transformers import EncodecModel, LlamaModel

from codec import EncodecTokenizer
from s2s import S2SModel


def run(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "server.cli", *args], check=True, capture_output=True, text=True)


def curve(folder) -> list[dict]:
    return json.loads((folder / "training.json").read_text())["loss_curve"]


def falls(folder) -> bool:
    return curve(folder)[-1]["loss"] < curve(folder)[0]["loss"]


def test_train_codec_quick(tmp_path, cores: int) -> None:
    out = tmp_path / "codec"
    run(
        "train", "codec", "--quick", "--steps", "30", "--warmup-steps", "10", "--out", str(out), "--threads", str(cores)
    )
    assert falls(out) and [c["step"] for c in curve(out)] == [0, 10, 20]  # 30 steps, not --quick's 60
    EncodecModel.from_pretrained(out)
    tok = EncodecTokenizer.from_pretrained(out, bandwidth=1.5)
    assert tok.num_codebooks == 2


def test_train_echo_quick(tmp_path, cores: int) -> None:
    """On the shipped codec's codes (on this worker's cores: `cores_of_this_worker`)."""
    out = tmp_path / "echo"
    run("train", "echo", "--quick", "--steps", "12", "--out", str(out), "--threads", str(cores))
    assert falls(out) and [c["step"] for c in curve(out)] == [0, 10]  # 12 steps, not --quick's 30
    model = S2SModel.from_pretrained(out)
    backbone = LlamaModel(model.config.to_llama_config())
    missing, unexpected = backbone.load_state_dict(model.backbone.state_dict(), strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
