"""The `s2s` command: `serve`, `client`, `demo`, `roundtrip` (the codec alone), `infer` (a model over a file),
`weights`, `cluster`, `train codec|echo` and `bench NAME` (bench/). Each subcommand is a module of this package,
imported when it runs: `s2s weights` need not load torch."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import runpy
import sys
from pathlib import Path

from server.cli.options import CODEC_HELP, add_engine_args, add_serve_args

SUBCOMMANDS = {
    "serve": "serve",
    "client": "talk",
    "demo": "demo",
    "roundtrip": "roundtrip",
    "infer": "infer",
    "weights": "weights",
}
TRAINERS = {"codec": "codec.train_codec", "echo": "s2s.training.train_echo"}


def bench_names() -> list[str]:
    """Benchmark names as typed: `bench/NAME_bench.py` with underscores in NAME written as dashes."""
    spec = importlib.util.find_spec("bench")  # finds the folder without importing it
    modules = pkgutil.iter_modules(spec.submodule_search_locations if spec else [])
    return sorted(m.name.removesuffix("_bench").replace("_", "-") for m in modules if m.name.endswith("_bench"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s2s", description="Speech-to-speech serving engine")
    sub = p.add_subparsers(dest="command", required=True)
    rt = sub.add_parser("roundtrip", help="stream real speech through the codec and back")
    rt.add_argument("--codec", type=Path, default=None, help=CODEC_HELP)
    rt.add_argument("--random-weights", action="store_true", help="a seeded random codec instead of the shipped one")
    rt.add_argument("--bandwidth", type=float, default=1.5, help="EnCodec's kbps: 1.5, 3, 6, 12 or 24")
    rt.add_argument("--wav", type=Path, default=None, help="speech to use instead of espeak-ng's")
    rt.add_argument("--text", default="Hello there. This is a test of the speech codec.", help="what espeak-ng says")
    rt.add_argument("--out", type=Path, default=Path("out/roundtrip.wav"), help="where to write the decoded audio")
    inf = sub.add_parser("infer", help="a model over a WAV file offline (as Kyutai's moshi.run_inference)")
    inf.add_argument("--model", type=Path, required=True, help="a model folder (Kyutai's or transformers' Moshi)")
    inf.add_argument("input", type=Path, help="the WAV file the model hears")
    inf.add_argument("output", type=Path, help="where to write the reply audio")
    inf.add_argument("--json", type=Path, default=None, help="where to write each frame's text and codes")
    inf.add_argument("--codec", type=Path, default=None, help="a codec other than the one the model folder holds")
    inf.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    inf.add_argument("--seed", type=int, default=0)
    inf.add_argument("--max-context-s", type=float, default=240.0, help="the engine's attention window, in seconds")
    sv = sub.add_parser("serve", help="run the websocket server")
    add_serve_args(sv)
    cl = sub.add_parser("client", help="stream a WAV file to a server and save the reply")
    cl.add_argument("url", help="ws://host:port")
    cl.add_argument("--wav", type=Path, required=True)
    cl.add_argument("--out", type=Path, default=Path("out/reply.wav"))
    cl.add_argument("--mode", default="turn", choices=["turn", "duplex"])
    cl.add_argument("--codec", default="opus", choices=["opus", "pcm16"])
    cl.add_argument("--speed", type=float, default=1.0, help="x real time")
    cl.add_argument("--listen", type=float, default=3.0, help="seconds to keep listening after the speech")
    dm = sub.add_parser("demo", help="start a server on the offline default and hold a conversation with it")
    add_engine_args(dm)
    dm.add_argument("--out", type=Path, default=Path("out/demo"), help="folder for the question and reply WAVs")
    dm.add_argument("--sentence", default="the train leaves at seven tonight", help="one of the held-out sentences")
    sub.add_parser("cluster", help="replicas behind HAProxy (s2s cluster --help), and status, add, drain")
    wt = sub.add_parser("weights", help="where the shipped codec and model are, and how they were made")
    wt.add_argument("--json", action="store_true", help='print {"codec": PATH, "model": PATH}')
    tr = sub.add_parser("train", help="train the shipped weights (s2s train codec|echo --help)")
    tr.add_argument("what", choices=sorted(TRAINERS), help="codec: codec/train_codec.py; echo: s2s/training/")
    tr.add_argument("rest", nargs=argparse.REMAINDER)
    b = sub.add_parser("bench", help="run a benchmark from bench/ (s2s bench NAME --help)")
    b.add_argument("name", help="one of: " + ", ".join(bench_names()))
    b.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cluster"]:  # its own parser: options of `s2s serve` pass through it to the replicas
        return importlib.import_module("server.cli.cluster").main(argv[1:])
    p = parser()
    args = p.parse_args(argv)
    if args.command in SUBCOMMANDS:
        importlib.import_module(f"server.cli.{SUBCOMMANDS[args.command]}").run(args)
    elif args.command == "train":
        importlib.import_module(TRAINERS[args.what]).main(args.rest)
    elif args.command == "bench":
        if args.name not in bench_names():
            p.error(f"unknown benchmark {args.name!r}; choose from {', '.join(bench_names())}")
        sys.argv = [f"s2s bench {args.name}", *args.rest]
        runpy.run_module(f"bench.{args.name.replace('-', '_')}_bench", run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # (`python -m server.cli` is the usual way)
    main()
