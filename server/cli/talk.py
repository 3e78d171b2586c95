"""`s2s client`: stream a WAV file to a server and save its reply; the model's text stream, if it has one, is printed
as it comes."""

from __future__ import annotations

import argparse
import asyncio
import sys

from codec.pcm import SAMPLE_RATE, load_wav, save_wav
from server.moshi.client import talk


def run(args: argparse.Namespace) -> None:
    wav = load_wav(args.wav)
    result = asyncio.run(talk(args.url, wav, args.mode, args.codec, args.speed, args.listen, on_text=print_piece))
    if result.text:  # (the line of text printed as it came)
        print()
    print(f"sent {len(wav) / SAMPLE_RATE:.2f} s; got {len(result.reply) / SAMPLE_RATE:.2f} s of audio back")
    if result.turn_latency_s is not None:
        print(f"turn latency (end of speech -> first reply audio): {result.turn_latency_s * 1000:.0f} ms")
    for e in result.errors:
        print(f"server error: {e}")
    save_wav(args.out, result.reply)
    print(f"wrote {args.out}")


def print_piece(piece: str) -> None:
    """The model's text as it comes, piece by piece on one line, as Kyutai's client prints it (`RawPrinter`)."""
    sys.stdout.write(piece)
    sys.stdout.flush()
