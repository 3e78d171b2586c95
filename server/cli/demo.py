"""`s2s demo`: a server on the shipped default, and a conversation with it that a recogniser hears."""

from __future__ import annotations

import argparse
import asyncio

from codec.pcm import SAMPLE_RATE, save_wav
from server.app import ChatServer, ServerOptions
from server.cli.engine_args import engine_of, weights_of
from server.moshi.client import talk
from speech import oracle
from speech.sentences import HELDOUT_SENTENCES
from speech.voices import HELDOUT_VOICES, say


async def demo(args: argparse.Namespace) -> None:
    """A held-out sentence in a held-out voice, in turn mode (pcm16) and duplex (Ogg/Opus); the recogniser says what
    the question and each reply say."""
    if args.sentence not in HELDOUT_SENTENCES:
        raise SystemExit(
            f"--sentence must be one of the held-out sentences (speech/sentences.py), got {args.sentence!r}"
        )
    engine, _ = engine_of(args)
    codec, model = weights_of(args)
    server = ChatServer(engine, ServerOptions(port=0))
    port = await server.start()
    url = f"ws://127.0.0.1:{port}"
    loaded = f"model {model}, codec {codec}" if model and codec else "seeded random weights: the replies are noise"
    print(f"server on {url}/api/chat ({loaded})")
    hear = oracle.recognizer()
    try:
        question = say(args.sentence, HELDOUT_VOICES[0])
        print(f"user ({HELDOUT_VOICES[0]}): {args.sentence!r}, {len(question) / SAMPLE_RATE:.2f} s")
        print(f"  the recogniser hears the question as: {hear.transcribe(question)!r}")
        args.out.mkdir(parents=True, exist_ok=True)
        save_wav(args.out / "question.wav", question)
        turn = await talk(url, question, mode="turn", codec="pcm16", listen_s=15.0, seed="1")
        duplex = await talk(url, question, mode="duplex", codec="opus", listen_s=1.0, seed="2")
        for name, r, how in (("turn", turn, "turn mode, pcm16"), ("duplex", duplex, "duplex, Ogg/Opus")):
            if not r.handshake or not len(r.reply):
                print(f"{how}: no reply ({'; '.join(r.errors) or 'the server refused the conversation'})")
                continue
            save_wav(args.out / f"{name}_reply.wav", r.reply)
            latency = f", turn latency {r.turn_latency_s * 1000:.0f} ms" if r.turn_latency_s else ""
            print(f"{how}: {len(r.reply) / SAMPLE_RATE:.2f} s of reply{latency}")
            print(f"  the recogniser hears the reply as: {hear.transcribe(r.reply)!r}")
        stats = engine.snapshot().stats
        print(f"engine: {stats.ticks} ticks, {stats.refused} refused, {stats.deadline_misses} deadline misses")
        print(f"wrote question.wav, turn_reply.wav and duplex_reply.wav to {args.out}")
    finally:
        await server.stop()


def run(args: argparse.Namespace) -> None:
    asyncio.run(demo(args))
