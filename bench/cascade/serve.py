"""The cascade as a server: `python -m bench.cascade.serve [s2s serve's options]`, as `s2s bench cascade` runs it.

The options describe the speech engine (TTS, `tts=engine`); the text decoder is the same preset on the same device,
with the same reply length and conversation limit.
"""

from __future__ import annotations

import argparse

import uvloop

from server.cli.options import add_server_args, server_options

MODULE = "bench.cascade.serve"


async def _serve(args: argparse.Namespace) -> None:
    options = server_options(args)  # a bad one exits before the engines' imports
    # imported here, not above: the speech-to-text workers are spawned, and a spawned process imports its parent's
    # main module (this one) first, which would cost each of them the engine's imports (seconds) for nothing
    from bench.cascade.server import CascadeServer
    from bench.cascade.text import text_engine_for
    from server.app import serve_until_sigterm
    from server.cli.engine_args import engine_of, placement_of

    speech, _ = engine_of(args)  # first: it sets the torch threads both engines calibrate with
    device, dtype = placement_of(args)
    text = text_engine_for(
        args.preset,
        args.max_reply_frames * speech.cfg.frame_s,
        args.max_conversations,
        device,
        dtype,
        cuda_graphs=not args.enforce_eager,
    )
    server = CascadeServer(text, speech, options)

    def note() -> str:
        stt = server.stt
        return (
            f"speech-to-text: {len(stt.pools)} worker(s), {stt.rtf:.3f} s of search per second of audio, "
            f"{stt.per_worker()} streams each"
        )

    await serve_until_sigterm(server, note)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="Serve the STT -> LLM -> TTS cascade")
    add_server_args(p)
    uvloop.run(_serve(p.parse_args(argv)))  # the event loop `s2s serve` runs: the baseline at its best


if __name__ == "__main__":
    main()
