"""`s2s weights`: where the shipped codec and model are, and how they were made."""

from __future__ import annotations

import argparse
import json

from s2s.models.shipped import shipped


def run(args: argparse.Namespace) -> None:
    folders = {"codec": shipped("codec"), "model": shipped("model")}
    if args.json:
        print(json.dumps({name: str(folder) for name, folder in folders.items()}))
        return
    for name, folder in folders.items():
        made = json.loads((folder / "training.json").read_text())
        size = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
        print(f"{name}: {folder} ({size:.1f} MB), made by `{made['command']}` in {made['seconds'] / 60:.0f} min")
