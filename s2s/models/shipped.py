"""The shipped weights, trained on this machine by their own commands (each folder's `training.json` holds the
exact command, its time and its record): the codec (`s2s train codec`) and the echo model (`s2s train echo`), the
defaults of `s2s serve`, `s2s demo`, `s2s roundtrip` and `s2s bench oracle`.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).parents[1] / "weights"
CODEC = FOLDER / "codec"
MODEL = FOLDER / "echo"


def shipped(which: str) -> Path:
    """The folder of the shipped `codec` or `model`, or a FileNotFoundError naming the command that makes it."""
    folder = {"codec": CODEC, "model": MODEL}[which]
    if not (folder / "config.json").is_file():
        command = "s2s train codec" if which == "codec" else "s2s train echo"
        raise FileNotFoundError(f"the shipped {which} is missing from {folder}: make it with `{command}`")
    return folder
